"""Issue 11: who gets in, proven against real servers on 127.0.0.1:0 with certificates made by
`pshard certs` in a temporary directory, and with token files.

Every refused call leaves the stored weights byte-for-byte as they were, and the membership too.
"""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from pshard.client.ps_client import PSClient
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.security.ca import CertFiles, ensure, issue, make_ca
from pshard.common.security.credentials import SecurityConfig
from pshard.common.security.identity import Identity
from pshard.common.wire import codec
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.api.v1 import scheduler_pb2 as spb
from pshard.api.v1 import scheduler_pb2_grpc as spb_grpc

from .conftest import WAIT_S, Wire

MODEL = {"w": np.arange(8, dtype=np.float32)}
JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.5), job_id="secure")
NODES = [Identity("scheduler", "scheduler-0"), Identity("ps", "ps-0"), Identity("chief", "chief-0"),
         Identity("worker", "worker-0"), Identity("worker", "worker-1"), Identity("evaluator", "evaluator-0"),
         Identity("admin")]
TOKENS = {"chief": "chief-secret-0123456789", "worker": "worker-secret-0123456789",
          "admin": "admin-secret-0123456789"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    """Certificates of every role, one signed by a stranger's CA, one expired, one naming no role."""
    root = tmp_path_factory.mktemp("pki")
    made = {str(i): files for i, files in ensure(root / "job", NODES).items()}
    make_ca(root / "other")
    made["other-ca"] = issue(root / "other", Identity("worker", "worker-0"))
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=10)
    made["expired"] = issue(root / "job", Identity("worker", "worker-0"), not_before=past,
                            not_after=past + dt.timedelta(days=1), name="expired")
    made["no-role"] = _cert_without_role(root / "job")
    return made


def _cert_without_role(directory: Path) -> CertFiles:
    """Signed by the job's CA, but with no spiffe://pshard/ URI: it names nobody."""
    files = issue(directory, Identity("worker", "x"), name="no-role")
    # Re-issue with only DNS names by building on the same helper: strip the URI SAN.
    from cryptography.hazmat.primitives import hashes, serialization

    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    old = x509.load_pem_x509_certificate(files.cert.read_bytes())
    builder = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(ca.subject)
               .public_key(old.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(old.not_valid_before_utc).not_valid_after(old.not_valid_after_utc)
               .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False))
    files.cert.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))  # type: ignore[arg-type]
    return files


def sec(pki: dict[str, CertFiles], name: str, role: str = "", node_id: str = "") -> SecurityConfig:
    return pki[name].security(role, node_id)


@pytest.fixture
def servers(pki: dict[str, CertFiles]) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(security: SecurityConfig, settings: ServerSettings | None = None) -> ServerThread:
        server = start_server_thread(settings or ServerSettings(), security=security)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace_s=0.2)


@pytest.fixture
def scheduler(pki: dict[str, CertFiles]) -> Iterator[SchedulerHandle]:
    handle = start_scheduler_thread(security=sec(pki, "scheduler/scheduler-0"))
    yield handle
    handle.stop(grace_s=0.2)


def ps_stub(server: ServerThread, security: SecurityConfig) -> pb_grpc.ParameterServerServiceStub:
    return pb_grpc.ParameterServerServiceStub(security.channel(server.address))


def weights(server: ServerThread, chief: SecurityConfig) -> bytes:
    reply = ps_stub(server, chief).Pull(pb.PullRequest(stamp=Wire.stamp("chief-0", 0),
                                                       slices=[Wire.slice_id("w")]), timeout=WAIT_S)
    return bytes(reply.slices[0].tensor.data)


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()  # type: ignore[no-any-return, attr-defined]


@pytest.fixture
def trained(pki: dict[str, CertFiles], servers: Callable[..., ServerThread]) -> ServerThread:
    """A TLS parameter server the chief configured and a worker pushed to."""
    server = servers(sec(pki, "ps/ps-0"))
    chief = PSClient([server.address], "chief-0", security=sec(pki, "chief/chief-0"), timeout_s=WAIT_S)
    chief.declare(MODEL, JOB)
    worker = PSClient([server.address], "worker-0", security=sec(pki, "worker/worker-0"), timeout_s=WAIT_S)
    worker.declare(MODEL, JOB)
    worker.push({"w": np.ones(8, np.float32)}, clock=0).result(WAIT_S)
    np.testing.assert_array_equal(worker.pull(1)["w"], MODEL["w"] - 0.5)
    chief.close()
    worker.close()
    return server


def test_training_over_mutual_tls_works(trained: ServerThread, pki: dict[str, CertFiles]) -> None:
    data = weights(trained, sec(pki, "chief/chief-0"))
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), MODEL["w"] - 0.5)
    assert trained.running.refusals is not None and trained.running.refusals.total() == 0


@pytest.mark.parametrize("who", ["plain", "no-client-cert", "other-ca", "expired"])
def test_a_client_without_a_valid_certificate_never_reaches_a_handler(
        who: str, trained: ServerThread, pki: dict[str, CertFiles]) -> None:
    before = weights(trained, sec(pki, "chief/chief-0"))
    if who == "plain":
        channel = grpc.insecure_channel(trained.address)
    elif who == "no-client-cert":
        only_ca = grpc.ssl_channel_credentials(pki["admin"].ca.read_bytes())
        channel = grpc.secure_channel(trained.address, only_ca)
    else:
        channel = sec(pki, who, "worker", "worker-0").channel(trained.address)
    push = pb_grpc.ParameterServerServiceStub(channel).Push
    request = Wire.push_request("worker-0", 1, {"w": np.full(8, 100.0, np.float32)})

    # The TLS handshake fails: the client sees UNAVAILABLE (no handler ran, nothing to count).
    assert code_of(lambda: push(request, timeout=WAIT_S)) == grpc.StatusCode.UNAVAILABLE
    assert weights(trained, sec(pki, "chief/chief-0")) == before


def test_a_certificate_that_names_no_role_is_unauthenticated(trained: ServerThread,
                                                             pki: dict[str, CertFiles]) -> None:
    before = weights(trained, sec(pki, "chief/chief-0"))
    stub = ps_stub(trained, sec(pki, "no-role"))
    request = Wire.push_request("worker-0", 1, {"w": np.full(8, 100.0, np.float32)})
    assert code_of(lambda: stub.Push(request, timeout=WAIT_S)) == grpc.StatusCode.UNAUTHENTICATED
    assert weights(trained, sec(pki, "chief/chief-0")) == before
    assert trained.running.refusals is not None
    assert trained.running.refusals.total("UNAUTHENTICATED") == 1


@pytest.mark.parametrize(("who", "call"), [
    ("evaluator/evaluator-0", "push"), ("worker/worker-0", "checkpoint"), ("ps/ps-0", "push"),
    ("worker/worker-1", "push-as-worker-0"), ("worker/worker-0", "declare-tables-export")])
def test_the_wrong_role_or_identity_is_permission_denied(who: str, call: str, trained: ServerThread,
                                                         pki: dict[str, CertFiles]) -> None:
    before = weights(trained, sec(pki, "chief/chief-0"))
    stub = ps_stub(trained, sec(pki, who))
    own = who.split("/")[1]
    moves: dict[str, Callable[[], object]] = {
        "push": lambda: stub.Push(
            Wire.push_request(own, 1, {"w": np.full(8, 9.0, np.float32)}), timeout=WAIT_S),
        "push-as-worker-0": lambda: stub.Push(
            Wire.push_request("worker-0", 1, {"w": np.full(8, 9.0, np.float32)}), timeout=WAIT_S),
        "checkpoint": lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=WAIT_S),
        "declare-tables-export": lambda: trained_channel_call(trained, sec(pki, who)),
    }
    assert code_of(moves[call]) == grpc.StatusCode.PERMISSION_DENIED
    assert weights(trained, sec(pki, "chief/chief-0")) == before
    assert trained.running.refusals is not None
    assert trained.running.refusals.total("PERMISSION_DENIED") == 1


def trained_channel_call(server: ServerThread, security: SecurityConfig) -> object:
    from pshard.api.v1 import sparse_pb2, sparse_pb2_grpc

    stub = sparse_pb2_grpc.SparseTablesServiceStub(security.channel(server.address))
    return stub.ExportTable(sparse_pb2.ExportTableRequest(), timeout=WAIT_S)


def test_a_worker_cannot_set_the_job_configuration(pki: dict[str, CertFiles],
                                                    servers: Callable[..., ServerThread]) -> None:
    server = servers(sec(pki, "ps/ps-0"))
    stub = ps_stub(server, sec(pki, "worker/worker-1"))
    request = pb.DeclareRequest(slices=[Wire.tensor("w", MODEL["w"])])
    request.config.CopyFrom(codec.job_to_proto(JOB))
    # It waits for the chief's configuration until its deadline, then is refused.
    assert code_of(lambda: stub.Declare(request, timeout=1.0)) in (grpc.StatusCode.PERMISSION_DENIED,
                                                                 grpc.StatusCode.DEADLINE_EXCEEDED)
    assert ps_stub(server, sec(pki, "admin")).GetStats(pb.GetStatsRequest(), timeout=WAIT_S).slices == 0
    # Once the chief has declared, the worker's matching Declare goes through.
    chief = PSClient([server.address], "chief-0", security=sec(pki, "chief/chief-0"), timeout_s=WAIT_S)
    chief.declare(MODEL, JOB)
    chief.close()
    worker = PSClient([server.address], "worker-0", security=sec(pki, "worker/worker-0"), timeout_s=WAIT_S)
    worker.declare(MODEL, JOB)
    worker.close()


def test_get_stats_hides_worker_ids_from_other_roles(trained: ServerThread,
                                                     pki: dict[str, CertFiles]) -> None:
    seen = ps_stub(trained, sec(pki, "admin")).GetStats(pb.GetStatsRequest(), timeout=WAIT_S)
    evaluator = ps_stub(trained, sec(pki, "evaluator/evaluator-0"))
    hidden = evaluator.GetStats(pb.GetStatsRequest(), timeout=WAIT_S)
    assert "worker-0" in seen.worker_clocks
    assert not hidden.worker_clocks and not hidden.quorum and hidden.slices == seen.slices


# ---- the scheduler: a stranger's moves from the issue ----

def _members(handle: SchedulerHandle) -> list[tuple[str, str, str]]:
    view = handle.call(handle.running.servicer.membership.view)
    return [(n.node_id, n.role, n.state.value) for n in view.nodes]


def test_a_stranger_cannot_change_the_membership(scheduler: SchedulerHandle,
                                                 pki: dict[str, CertFiles]) -> None:
    worker = SchedulerClient(scheduler.address, "worker", node_id="worker-0",
                             security=sec(pki, "worker/worker-0"), connect_timeout_s=WAIT_S)
    reg = worker.register()
    before = _members(scheduler)

    def stub(who: str) -> spb_grpc.SchedulerServiceStub:
        return spb_grpc.SchedulerServiceStub(sec(pki, who).channel(scheduler.address))

    plain = spb_grpc.SchedulerServiceStub(grpc.insecure_channel(scheduler.address))
    refusals = {
        # No credential at all: the handshake fails.
        "register without a certificate": (lambda: plain.Register(
            spb.RegisterRequest(role=spb.ROLE_WORKER, address="evil:1"), timeout=WAIT_S),
            grpc.StatusCode.UNAVAILABLE),
        # A parameter server's certificate registering as a worker (joining the sync quorum).
        "ps registers as a worker": (lambda: stub("ps/ps-0").Register(
            spb.RegisterRequest(role=spb.ROLE_WORKER, address="evil:1"), timeout=WAIT_S),
            grpc.StatusCode.PERMISSION_DENIED),
        # Another worker's certificate taking worker-0's id.
        "worker-1 registers as worker-0": (lambda: stub("worker/worker-1").Register(
            spb.RegisterRequest(role=spb.ROLE_WORKER, address="evil:1", node_id="worker-0"), timeout=WAIT_S),
            grpc.StatusCode.PERMISSION_DENIED),
        "worker-1 makes worker-0 leave": (lambda: stub("worker/worker-1").Leave(
            spb.LeaveRequest(node_id="worker-0", generation=reg.generation), timeout=WAIT_S),
            grpc.StatusCode.PERMISSION_DENIED),
        "an evaluator proposes a layout": (lambda: stub("evaluator/evaluator-0").ProposeLayout(
            spb.ProposeLayoutRequest(), timeout=WAIT_S), grpc.StatusCode.PERMISSION_DENIED),
    }
    for what, (call, expected) in refusals.items():
        assert code_of(call) == expected, what
    assert _members(scheduler) == before
    assert scheduler.running.refusals.total("PERMISSION_DENIED") == 4
    worker.close()


# ---- tokens, the lighter alternative ----

@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("".join(f"{role} {secret}\n" for role, secret in TOKENS.items()))
    return path


def test_tokens_without_tls(token_file: Path, servers: Callable[..., ServerThread],
                            tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = servers(SecurityConfig(token_file=token_file, role="ps"))
    chief = SecurityConfig(token_file=token_file, role="chief")
    client = PSClient([server.address], "chief-0", security=chief, timeout_s=WAIT_S)
    client.declare(MODEL, JOB)
    client.close()
    before = weights(server, chief)
    bad = tmp_path / "bad"
    bad.write_text("worker not-the-worker-secret-000\n")
    grad = Wire.push_request("worker-0", 0, {"w": np.full(8, 9.0, np.float32)})
    plain = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(server.address))
    assert code_of(lambda: plain.Push(grad, timeout=WAIT_S)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: ps_stub(server, SecurityConfig(token_file=bad, role="worker")).Push(
        grad, timeout=WAIT_S)) == grpc.StatusCode.UNAUTHENTICATED
    worker = SecurityConfig(token_file=token_file, role="worker")
    assert code_of(lambda: ps_stub(server, worker).Checkpoint(
        pb.CheckpointRequest(), timeout=WAIT_S)) == grpc.StatusCode.PERMISSION_DENIED
    assert weights(server, chief) == before
    assert server.running.refusals is not None
    refusals = server.running.refusals
    assert (refusals.total("UNAUTHENTICATED"), refusals.total("PERMISSION_DENIED")) == (2, 1)
    caplog.set_level("WARNING", logger="pshard.security")
    worker.warn_if_open("test")
    assert "travels in clear" in caplog.text or "in clear" in caplog.text


def test_tokens_over_tls(token_file: Path, pki: dict[str, CertFiles],
                         servers: Callable[..., ServerThread]) -> None:
    files = pki["ps/ps-0"]
    server = servers(SecurityConfig(files.cert, files.key, files.ca, token_file, role="ps"))
    # TLS without a client certificate, the token names the chief.
    creds = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(files.ca.read_bytes()),
        grpc.access_token_call_credentials(TOKENS["chief"]))
    stub = pb_grpc.ParameterServerServiceStub(grpc.secure_channel(server.address, creds))
    request = pb.DeclareRequest(slices=[Wire.tensor("w", MODEL["w"])])
    assert list(stub.Declare(request, timeout=WAIT_S).created) == [True]
    nobody = pb_grpc.ParameterServerServiceStub(grpc.secure_channel(
        server.address, grpc.ssl_channel_credentials(files.ca.read_bytes())))
    assert code_of(lambda: nobody.GetStats(pb.GetStatsRequest(), timeout=WAIT_S)) == \
        grpc.StatusCode.UNAUTHENTICATED


# ---- rotation ----

def _served_serial(address: str, client: SecurityConfig) -> int:
    ctx = client.client_ssl_context()
    ctx.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_rotated_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    made = ensure(tmp_path, [Identity("ps", "ps-0"), Identity("admin")])
    ps, admin = made[Identity("ps", "ps-0")], made[Identity("admin")]
    server = start_server_thread(ServerSettings(), security=ps.security())
    try:
        first = _served_serial(server.address, admin.security())
        # Half a rotation (a new key, the old certificate): the old pair is served on.
        new = issue(tmp_path, Identity("ps", "ps-0"), name="next")
        old_key = ps.key.read_bytes()
        ps.key.write_bytes(new.key.read_bytes())
        assert _served_serial(server.address, admin.security()) == first
        ps.key.write_bytes(old_key)
        issue(tmp_path, Identity("ps", "ps-0"))  # same files, a new certificate
        second = _served_serial(server.address, admin.security())
        assert first != second
        assert second == x509.load_pem_x509_certificate(ps.cert.read_bytes()).serial_number
        stub = ps_stub(server, admin.security())
        assert stub.GetStats(pb.GetStatsRequest(), timeout=WAIT_S).slices == 0
    finally:
        server.stop(grace_s=0.2)


# ---- the scheduler a chief hosts in-process (no scheduler task) ----

def test_the_scheduler_a_chief_hosts_speaks_mutual_tls(tmp_path: Path) -> None:
    from pshard.common.cluster.spec import ClusterSpec
    from pshard.worker.session import ClusterSession

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    made = ensure(tmp_path, [Identity("chief", "chief-0"), Identity("admin")])
    spec = ClusterSpec("chief", 0, ps=("127.0.0.1:1",), chief=(f"127.0.0.1:{port}",))
    session = ClusterSession(spec, startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S,
                             security=made[Identity("chief", "chief-0")].security())
    try:
        session.host_scheduler_if_needed()
        assert session.register().node_id == "chief-0"
        plain = spb_grpc.SchedulerServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        assert code_of(lambda: plain.GetLayout(spb.GetLayoutRequest(), timeout=WAIT_S)) == \
            grpc.StatusCode.UNAVAILABLE
        admin = spb_grpc.SchedulerServiceStub(made[Identity("admin")].security().channel(f"127.0.0.1:{port}"))
        assert code_of(lambda: admin.Register(spb.RegisterRequest(role=spb.ROLE_WORKER), timeout=WAIT_S)) == \
            grpc.StatusCode.PERMISSION_DENIED
    finally:
        session.leave()
        session.close()


def test_pshard_status_reads_a_secured_job_with_an_admin_certificate(scheduler: SchedulerHandle,
                                                                     pki: dict[str, CertFiles]) -> None:
    from pshard.status import fetch

    worker = SchedulerClient(scheduler.address, "worker", node_id="worker-0",
                             security=sec(pki, "worker/worker-0"), connect_timeout_s=WAIT_S)
    worker.register()
    try:
        status = fetch(scheduler.address, WAIT_S, sec(pki, "admin", "admin"))
        assert "worker-0" in status.to_json()
        with pytest.raises(grpc.RpcError):
            fetch(scheduler.address, 2.0)
    finally:
        worker.close()
