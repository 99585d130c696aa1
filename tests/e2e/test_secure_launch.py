"""Issue 11 end to end: `pshard launch` trains with mutual TLS on by default, certificates made on
first use; a stranger without a certificate cannot reach the running servers; --insecure says so loudly.
"""

from __future__ import annotations

import json

import grpc
import pytest
from pshard.common.rpc.health import probe

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.e2e.harness import Procs, finals, start_launcher

pytestmark = pytest.mark.e2e

RUN_TIMEOUT_S = 120
QUICK_TIMEOUT_S = 45


def test_the_launcher_trains_over_mutual_tls_with_certificates_made_on_first_use(procs: Procs) -> None:
    assert not procs.certs_dir.exists()
    data_dir = procs.tmp_path / "empty-data"  # empty: the workers fall back to scikit-learn's digits
    data_dir.mkdir()
    run = start_launcher(procs, "--ps", "1", "--workers", "1", "--chief", "--", "--mode", "sync",
                         "--epochs", "1", "--batch-size", "32", "--model", "mlp", "--optimizer", "sgd",
                         "--lr", "0.1", "--momentum", "0.9", "--seed", "0", "--data-dir", str(data_dir))
    match = run.wait_for_line(r"^launcher: cluster (\{.*\})$", QUICK_TIMEOUT_S)
    ps_address = json.loads(match.group(1))["ps"][0]
    run.wait_for_line(r"^\[ps-0\] .*security: mTLS", QUICK_TIMEOUT_S)

    # While it trains: the server answers a health check only over TLS, and a plain client gets nowhere.
    assert probe(ps_address, timeout_s=5.0, security=procs.admin_security())[0]
    assert not probe(ps_address, timeout_s=1.0)[0]
    with grpc.insecure_channel(ps_address) as plain, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.ParameterServerServiceStub(plain).GetStats(pb.GetStatsRequest(), timeout=5.0)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]

    assert run.wait(RUN_TIMEOUT_S) == 0, run.output()
    results = finals(run)
    assert set(results) == {"chief-0", "worker-0"}, run.output()
    # One sync epoch on digits: far above chance (0.10); the insecure run of test_launcher reaches 0.9+.
    assert float(results["chief-0"]["test_accuracy"]) > 0.6, results
    names = {p.name for p in procs.certs_dir.iterdir()}
    assert {"ca.pem", "ps-0.pem", "chief-0.pem", "worker-0.pem", "scheduler-0.pem", "admin.pem"} <= names


def test_insecure_turns_tls_off_with_a_loud_warning(procs: Procs) -> None:
    data_dir = procs.tmp_path / "empty-data"
    data_dir.mkdir()
    run = start_launcher(procs, "--insecure", "--ps", "1", "--workers", "1", "--", "--mode", "async",
                         "--epochs", "1", "--max-steps", "5", "--model", "mlp", "--data-dir", str(data_dir))
    assert run.wait(RUN_TIMEOUT_S) == 0, run.output()
    assert any("NO TLS AND NO AUTHENTICATION" in line for line in run.lines), run.output()
    assert not procs.certs_dir.exists()
