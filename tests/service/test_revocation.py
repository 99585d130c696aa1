"""Issue 11: a revoked certificate is refused, on gRPC and on the raw TCP fast path, and the stored
weights stay byte-for-byte unchanged. The CRL is `pshard certs --revoke`'s, in a temporary directory;
the servers pick each update up without a restart, and certificates not revoked keep working.

gRPC Python completes the handshake of a revoked certificate (it cannot load a CRL), so there the
refusal is the interceptor's UNAUTHENTICATED, counted; on the TCP path OpenSSL refuses the handshake.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import ClusterConfigError, UnauthenticatedError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.security.ca import CertFiles, ensure, revoke
from pshard.common.security.credentials import SecurityConfig
from pshard.common.security.identity import Identity
from pshard.common.wire import fastwire
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.certs import main

from .conftest import WAIT_S, Wire

MODEL = {"w": np.arange(8, dtype=np.float32)}
JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.5), job_id="revocation")
NODES = [Identity("ps", "ps-0"), Identity("chief", "chief-0"), Identity("worker", "worker-0"),
         Identity("worker", "worker-1")]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return {i.node_id: files for i, files in ensure(tmp_path, NODES).items()}


@pytest.fixture
def server(pki: dict[str, CertFiles]) -> Iterator[ServerThread]:
    assert pki["ps-0"].crl is not None  # `pshard certs` keeps a CRL beside the CA: servers check it
    running = start_server_thread(ServerSettings(transport="tcp"),
                                  security=pki["ps-0"].security("ps", "ps-0"))
    chief = PSClient([running.address], "chief-0", security=pki["chief-0"].security("chief", "chief-0"),
                     timeout_s=WAIT_S, transport="grpc")
    chief.declare(MODEL, JOB)
    chief.close()
    yield running
    running.stop(grace_s=0.2)


def stub(server: ServerThread, files: CertFiles) -> pb_grpc.ParameterServerServiceStub:
    return pb_grpc.ParameterServerServiceStub(files.security().channel(server.address))


def weights(server: ServerThread, pki: dict[str, CertFiles]) -> bytes:
    reply = stub(server, pki["chief-0"]).Pull(pb.PullRequest(stamp=Wire.stamp("chief-0", 0),
                                                             slices=[Wire.slice_id("w")]), timeout=WAIT_S)
    return bytes(reply.slices[0].tensor.data)


def push(node: pb_grpc.ParameterServerServiceStub, worker: str, clock: int) -> None:
    node.Push(Wire.push_request(worker, clock, {"w": np.ones(8, np.float32)}), timeout=WAIT_S)


def refusals(server: ServerThread) -> int:
    assert server.running.refusals is not None
    return server.running.refusals.total("UNAUTHENTICATED")


def test_a_revoked_certificate_is_refused_on_grpc_at_once_and_the_others_keep_working(
        server: ServerThread, pki: dict[str, CertFiles], tmp_path: Path) -> None:
    worker1 = stub(server, pki["worker-1"])
    push(worker1, "worker-1", 0)  # accepted before the revocation, on this same connection
    before = weights(server, pki)
    assert before != MODEL["w"].tobytes()

    revoke(tmp_path, ["worker-1"])  # the server is not restarted: the CRL file changed under it

    with pytest.raises(grpc.RpcError) as refused:
        push(worker1, "worker-1", 1)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in (refused.value.details() or "")
    assert weights(server, pki) == before and refusals(server) == 1

    push(stub(server, pki["worker-0"]), "worker-0", 0)  # a certificate not revoked still works
    assert weights(server, pki) != before and refusals(server) == 1

    # Naming the node again gives it a new certificate (a new serial), which is not revoked.
    renewed = ensure(tmp_path, [Identity("worker", "worker-1")])[Identity("worker", "worker-1")]
    push(stub(server, renewed), "worker-1", 1)
    assert refusals(server) == 1


def _session(server: ServerThread, pki: dict[str, CertFiles], worker: str) -> pb.OpenTransportResponse:
    return stub(server, pki[worker]).OpenTransport(pb.OpenTransportRequest(
        worker_id=worker, kind=pb.TRANSPORT_KIND_TCP, request_bytes=4096, reply_bytes=4096), timeout=WAIT_S)


def _tcp_push(server: ServerThread, files: CertFiles, session: pb.OpenTransportResponse, worker: str,
              clock: int = 0) -> bool:
    """One push over the raw TCP path as `files`' holder: whether the server answered it."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    assert server.running.fast is not None
    try:
        with (socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as raw,
              context.wrap_socket(raw, server_hostname="127.0.0.1") as sock):
            hello = pb.TransportHello(session=session.session, secret=session.secret).SerializeToString()
            fastwire.send_frame(sock, fastwire.HELLO, hello)
            header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=Wire.stamp(worker, clock))
            header.push.append(Wire.meta("w", "float32", [8]))
            fastwire.send_frame(sock, fastwire.REQUEST, header.SerializeToString(), [np.ones(8, np.float32)])
            kind, meta, _ = fastwire.Inbox(sock).frame_head()
    except (ssl.SSLError, ConnectionError, fastwire.TransportBroken):  # TLS 1.3: refused after our Finished
        return False
    reply = pb.TransportReply.FromString(meta)
    assert kind == fastwire.REPLY and not reply.error_type, reply
    return True


def test_a_revoked_certificate_does_not_get_on_the_tcp_fast_path(
        server: ServerThread, pki: dict[str, CertFiles], tmp_path: Path) -> None:
    # The session is opened over gRPC before the revocation: only the TCP handshake stands in the way.
    session = _session(server, pki, "worker-1")
    revoke(tmp_path, ["worker-1"])
    before = weights(server, pki)
    assert not _tcp_push(server, pki["worker-1"], session, "worker-1")
    assert weights(server, pki) == before

    # An unrevoked certificate gets on, through the same listener (no restart), and its push lands.
    assert _tcp_push(server, pki["worker-0"], _session(server, pki, "worker-0"), "worker-0")
    assert weights(server, pki) != before


def test_a_crl_update_reaches_the_tcp_path_without_a_restart(
        server: ServerThread, pki: dict[str, CertFiles], tmp_path: Path) -> None:
    assert _tcp_push(server, pki["worker-1"], _session(server, pki, "worker-1"), "worker-1")
    session = _session(server, pki, "worker-1")
    revoke(tmp_path, ["worker-1"])
    before = weights(server, pki)
    assert not _tcp_push(server, pki["worker-1"], session, "worker-1", clock=1)
    assert weights(server, pki) == before


def test_a_worker_with_a_revoked_certificate_cannot_train(server: ServerThread, pki: dict[str, CertFiles],
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dir", str(tmp_path), "--revoke", "worker-1"]) == 0
    assert "revoked worker-1" in capsys.readouterr().out
    before = weights(server, pki)
    client = PSClient([server.address], "worker-1", security=pki["worker-1"].security("worker", "worker-1"),
                      timeout_s=2.0, retry_budget_s=2.0, transport="auto")
    try:
        with pytest.raises(UnauthenticatedError, match="revoked"):
            client.declare(MODEL, JOB)
            client.push({"w": np.ones(8, np.float32)}, clock=0).result(WAIT_S)
    finally:
        client.close()
    assert weights(server, pki) == before and refusals(server) >= 1


def test_a_crl_that_the_ca_did_not_sign_is_refused_at_start_up(pki: dict[str, CertFiles],
                                                                 tmp_path: Path) -> None:
    from pshard.common.security.ca import make_ca, write_crl

    make_ca(tmp_path / "other")
    forged = write_crl(tmp_path / "other", {})
    files = pki["ps-0"]
    with pytest.raises(ClusterConfigError, match="--tls-crl"):
        SecurityConfig(files.cert, files.key, files.ca, crl=forged)


def test_the_scheduler_refuses_a_revoked_node_and_its_membership_stays(pki: dict[str, CertFiles],
                                                                       tmp_path: Path) -> None:
    from pshard.scheduler.service import start_scheduler_thread

    from pshard.api.v1 import scheduler_pb2 as spb
    from pshard.api.v1 import scheduler_pb2_grpc as spb_grpc

    made = ensure(tmp_path, [Identity("scheduler", "scheduler-0")])[Identity("scheduler", "scheduler-0")]
    handle = start_scheduler_thread(security=made.security("scheduler", "scheduler-0"))
    try:
        revoke(tmp_path, ["worker-1"])
        stub = spb_grpc.SchedulerServiceStub(pki["worker-1"].security().channel(handle.address))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(spb.RegisterRequest(role=spb.ROLE_WORKER, address="w1:1", node_id="worker-1"),
                          timeout=WAIT_S)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        view = handle.call(handle.running.servicer.membership.view)
        assert [n.node_id for n in view.nodes] == []
        ok = spb_grpc.SchedulerServiceStub(pki["worker-0"].security().channel(handle.address))
        ok.Register(spb.RegisterRequest(role=spb.ROLE_WORKER, address="w0:1", node_id="worker-0"),
                    timeout=WAIT_S)
        view = handle.call(handle.running.servicer.membership.view)
        assert [n.node_id for n in view.nodes] == ["worker-0"]
    finally:
        handle.stop(grace_s=0.2)
