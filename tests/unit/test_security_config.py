"""The pure parts of issue 11's security: token files, identities, the role table, the flags, where a
service binds, and `pshard certs` being idempotent."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from cryptography import x509
from pshard.common.errors import ClusterConfigError
from pshard.common.rpc.bind import default_bind
from pshard.common.security.auth import ALLOWED, allowed, may_act_as, may_configure
from pshard.common.security.ca import ensure
from pshard.common.security.credentials import add_security_arguments, security_from_args
from pshard.common.security.identity import Identity, TokenTable, identity_from_pem

from pshard.api.v1 import coordinator_pb2
from pshard.certs import main

PS = "/pshard.api.v1.ParameterServerService/"
SCHED = "/pshard.api.v1.SchedulerService/"


def test_a_token_file_maps_secrets_to_roles_and_picks_the_clients_own_line() -> None:
    table = TokenTable.parse("# comment\nchief  c" + "0" * 16 + "\nworker w" + "0" * 16 +
                             "  # shared\nworker/worker-3 x" + "0" * 16 + "\n")
    assert table.identity_of("w" + "0" * 16) == Identity("worker")
    assert table.identity_of("x" + "0" * 16) == Identity("worker", "worker-3")
    assert table.identity_of("nope") is None
    assert table.token_for("worker", "worker-3") == "x" + "0" * 16
    assert table.token_for("worker", "worker-1") == "w" + "0" * 16
    assert table.token_for("admin") is None


@pytest.mark.parametrize(("text", "names"), [
    ("", "no 'ROLE"), ("root s" + "0" * 16, "role 'root'"), ("worker short", "16 or more"),
    ("worker a b", "got 3 fields")])
def test_a_bad_token_file_names_the_problem(text: str, names: str) -> None:
    with pytest.raises(ClusterConfigError, match=names):
        TokenTable.parse(text, "tokens")


def test_an_id_less_credential_acts_for_any_node_of_its_role_only() -> None:
    assert Identity("worker").may_be("worker-7") and not Identity("worker").may_be("chief-0")
    assert Identity("worker", "worker-1").may_be("worker-1")
    assert not Identity("worker", "worker-1").may_be("worker-0")
    assert may_act_as(None, "anything")  # security off
    assert may_act_as(Identity("admin"), "worker-0")


def test_only_the_chief_an_admin_or_a_chiefless_worker_0_configure_the_job() -> None:
    assert may_configure(Identity("chief", "chief-0")) and may_configure(Identity("admin"))
    assert may_configure(Identity("worker", "worker-0"))
    assert not may_configure(Identity("worker", "worker-1")) and not may_configure(Identity("worker"))


def test_the_role_table_matches_the_issue() -> None:
    for method in ("Push", "PushPull"):
        assert {r for r in ("chief", "worker", "ps", "scheduler", "evaluator", "admin")
                if allowed(PS + method, r)} == {"chief", "worker"}
    for method in ("Checkpoint", "SaveCheckpointPart"):
        assert not allowed(PS + method, "worker")
        assert allowed(PS + method, "chief") and allowed(PS + method, "admin")
    assert allowed("/grpc.health.v1.Health/Check", "nobody")
    assert not allowed(SCHED + "Register", "admin") and allowed(SCHED + "Register", "ps")
    # Every method of a serving worker is the coordinator's (the chief's) to call, and no other node's.
    methods = coordinator_pb2.DESCRIPTOR.services_by_name["WorkerService"].methods
    for method in (f"/pshard.api.v1.WorkerService/{m.name}" for m in methods):
        assert {r for r in ("chief", "worker", "ps", "scheduler", "evaluator", "admin")
                if allowed(method, r)} == {"chief", "admin"}, method
    # A method nobody listed (added later) is an operator's only.
    assert allowed(PS + "SomethingNew", "admin") and not allowed(PS + "SomethingNew", "chief")
    assert all(method.startswith("/pshard.api.v1.") for method in ALLOWED)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_security_arguments(parser)
    return parser


def test_flags_win_over_environment_and_tls_files_go_together(tmp_path: Path) -> None:
    files = ensure(tmp_path, [Identity("ps", "ps-0")])[Identity("ps", "ps-0")]
    env = {"PSHARD_TLS_CERT": str(files.cert), "PSHARD_TLS_KEY": str(files.key),
           "PSHARD_TLS_CA": str(files.ca)}
    config = security_from_args(_parser().parse_args([]), env)
    assert config.tls and config.own_identity() == Identity("ps", "ps-0")
    with pytest.raises(ClusterConfigError, match="--tls-key, --tls-ca missing"):
        security_from_args(_parser().parse_args(["--tls-cert", str(files.cert)]), {})
    with pytest.raises(ClusterConfigError, match="cannot be combined"):
        security_from_args(_parser().parse_args(["--insecure"]), env)
    with pytest.raises(ClusterConfigError, match="--tls-ca: cannot read"):
        security_from_args(_parser().parse_args([]), {**env, "PSHARD_TLS_CA": str(tmp_path / "missing")})
    plain = security_from_args(_parser().parse_args([]), {})
    assert not plain.enabled and not plain.insecure


def test_services_bind_the_tf_config_host_when_it_is_an_address_of_this_machine(tmp_path: Path) -> None:
    """Issue 24: on a bare host too, the address peers reach the task by, not loopback."""
    nowhere = str(tmp_path / "no-dockerenv")
    assert default_bind("0.0.0.0:7100", "127.0.0.2:7100", {}, dockerenv=nowhere) == "127.0.0.2:7100"
    assert default_bind("0.0.0.0:7100", "localhost:7100", {}, dockerenv=nowhere) == "127.0.0.1:7100"
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert default_bind("0.0.0.0:7100", "localhost:7100", pod, dockerenv=nowhere) == "127.0.0.1:7100"


def test_a_tf_config_host_that_is_not_ours_binds_every_interface_saying_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nowhere = str(tmp_path / "no-dockerenv")
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    with caplog.at_level(logging.WARNING, logger="pshard.bind"):
        # A name that is not an address of this machine (a ClusterIP service, a NAT'd name): every interface.
        assert default_bind("0.0.0.0:7100", "no-such.invalid:7100", pod, dockerenv=nowhere) == "0.0.0.0:7100"
        assert default_bind("0.0.0.0:7100", "ps-0.invalid:7100", {}, dockerenv=nowhere) == "0.0.0.0:7100"
        assert default_bind("[::]:7100", "[fd00::1]:7100", {}, dockerenv=nowhere) == "[::]:7100"
    assert any("ps-0.invalid (this task's TF_CONFIG host) is not an address of this machine" in r.getMessage()
               and "--bind" in r.getMessage() for r in caplog.records)


def test_without_tf_config_services_bind_loopback_outside_a_container(tmp_path: Path) -> None:
    nowhere = str(tmp_path / "no-dockerenv")
    assert default_bind("0.0.0.0:7100", None, {}, dockerenv=nowhere) == "127.0.0.1:7100"
    assert default_bind("[::]:7100", None, {}, dockerenv=nowhere) == "[::1]:7100"
    pod = {"KUBERNETES_SERVICE_HOST": "x"}
    assert default_bind("0.0.0.0:7100", None, pod, dockerenv=nowhere) == "0.0.0.0:7100"


def test_pshard_certs_is_idempotent_and_names_roles_in_a_uri(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dir", str(tmp_path), "worker/worker-1", "admin"]) == 0
    assert "spiffe://pshard/worker/worker-1" in capsys.readouterr().out
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.pem")}
    main(["--dir", str(tmp_path), "worker/worker-1", "admin"])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pem")} == before
    assert identity_from_pem((tmp_path / "worker-1.pem").read_bytes()) == Identity("worker", "worker-1")

    # A host not in the certificate yet: that certificate is made again, signed by the same CA.
    main(["--dir", str(tmp_path), "--host", "ps.example", "worker/worker-1"])
    cert = x509.load_pem_x509_certificate((tmp_path / "worker-1.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ps.example" in sans.get_values_for_type(x509.DNSName)
    assert (tmp_path / "ca.pem").read_bytes() == before["ca.pem"]
    assert (tmp_path / "admin.pem").read_bytes() == before["admin.pem"]
