"""Issue 23, item 12: once the job is set, adding parameters is the chief's right only.

A worker's certificate used to `Declare` new parameters of any size on every server (a 64 MiB slice
was accepted). Now such a declaration is refused PERMISSION_DENIED, on the unary Declare and on the
Exchange stream (before its bytes are read), and the server holds what it held; the workers' own
declarations of the job's model, and the chief's new parameters, are served as before. A real parameter
server with mutual TLS on 127.0.0.1:0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import PermissionDeniedError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.security.ca import CertFiles, ensure
from pshard.common.security.identity import Identity
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc

from .conftest import WAIT_S, Wire

NODES = [Identity("ps", "ps-0"), Identity("chief", "chief-0"), Identity("worker", "worker-1")]
MODEL = {"w": np.arange(8, dtype=np.float32)}
JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.5), job_id="declare-rights")
BIG = {"extra": np.ones(2 << 20, dtype=np.float32)}  # 8 MiB: more than one Exchange frame


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return {i.node_id: files for i, files in ensure(tmp_path, NODES).items()}


@pytest.fixture
def server(pki: dict[str, CertFiles]) -> Iterator[ServerThread]:
    running = start_server_thread(ServerSettings(), security=pki["ps-0"].security("ps", "ps-0"))
    client(running, pki, "chief-0").declare(MODEL, JOB)
    yield running
    running.stop(grace_s=0.2)


def client(server: ServerThread, pki: dict[str, CertFiles], node: str) -> PSClient:
    role = node.split("-", 1)[0]
    return PSClient([server.address], node, security=pki[node].security(role, node), timeout_s=WAIT_S,
                    transport="grpc")


def stub(server: ServerThread, pki: dict[str, CertFiles], node: str) -> pb_grpc.ParameterServerServiceStub:
    return pb_grpc.ParameterServerServiceStub(pki[node].security().channel(server.address))


def held(server: ServerThread, pki: dict[str, CertFiles]) -> tuple[int, int]:
    stats = stub(server, pki, "chief-0").GetStats(pb.GetStatsRequest(), timeout=WAIT_S)
    return stats.slices, stats.bytes_stored


def refusals(server: ServerThread) -> int:
    assert server.running.refusals is not None
    return server.running.refusals.total("PERMISSION_DENIED")


def test_a_worker_may_not_add_parameters_once_the_job_is_set(server: ServerThread,
                                                              pki: dict[str, CertFiles]) -> None:
    before, refused_before = held(server, pki), refusals(server)

    with pytest.raises(grpc.RpcError) as unary:
        stub(server, pki, "worker-1").Declare(pb.DeclareRequest(slices=[Wire.tensor("extra", BIG["extra"])]),
                                              timeout=WAIT_S)
    with pytest.raises(PermissionDeniedError) as streamed:  # PSClient declares over Exchange
        client(server, pki, "worker-1").declare({**MODEL, **BIG}, JOB)

    assert unary.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    for details in (unary.value.details(), str(streamed.value)):  # type: ignore[attr-defined]
        assert "worker-1 may not add parameters once the job is set: slice 'extra" in details
    assert held(server, pki) == before
    assert refusals(server) == refused_before + 2


def test_workers_declare_the_jobs_model_and_the_chief_may_add_parameters(server: ServerThread,
                                                                        pki: dict[str, CertFiles]) -> None:
    values = client(server, pki, "worker-1").declare(MODEL, JOB)
    np.testing.assert_array_equal(values["w"], MODEL["w"])
    slices, nbytes = held(server, pki)

    client(server, pki, "chief-0").declare({**MODEL, "b": np.zeros(3, np.float32)}, JOB)

    assert held(server, pki) == (slices + 1, nbytes + 12)
    assert refusals(server) == 0
