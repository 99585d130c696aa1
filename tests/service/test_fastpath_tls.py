"""The consistency contract of test_transports.py again, with TLS on (certificates made by
`pshard certs` in a temporary directory): the raw TCP path runs over mutually authenticated TLS,
shared memory runs beside it on the session secret, and every promise holds as it does in clear.
Then what TLS adds: a peer that speaks in clear, or with another CA's certificate, does not get on
the TCP path even with the session's secret."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.options import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from pshard.common.security.ca import ensure, issue, make_ca
from pshard.common.security.credentials import SecurityConfig
from pshard.common.security.identity import Identity
from pshard.common.wire import fastwire
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

from .conftest import WAIT_S, Wire
from .test_transports import (  # noqa: F401  (the contract's tests and fixtures, collected here again)
    client,
    serve,
    shm_dir,
    test_a_duplicate_push_is_dropped_and_changes_nothing,
    test_a_pull_past_its_deadline_names_the_missing_workers,
    test_async_loses_no_update_from_concurrent_workers,
    test_bad_input_gets_the_same_error_as_over_grpc_and_changes_nothing,
    test_pulls_racing_updates_each_see_exactly_one_version,
    test_ssp_pull_waits_for_the_slowest_worker_and_its_push_releases_it,
    test_sync_steps_average_every_workers_gradient_on_two_servers,
    test_sync_training_is_bit_identical_on_every_transport,
    transport,
)

ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pki")


def _security(pki: Path, role: str, node_id: str = "") -> SecurityConfig:
    identity = Identity(role, node_id)
    return ensure(pki, [identity])[identity].security(role, node_id)


# The fixtures every contract test builds on, with TLS on.

@pytest.fixture
def start_server(pki: Path) -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def start(settings: ServerSettings | None = None, *, bind: str = "127.0.0.1:0",
              max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ServerThread:
        server = start_server_thread(settings or ServerSettings(), bind, max_message_bytes,
                                     _security(pki, "ps", "ps-0"))
        servers.append(server)
        assert server.running.fast is not None and server.running.fast.tls
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0.2)


@pytest.fixture
def new_client(pki: Path) -> Iterator[Callable[..., PSClient]]:
    clients: list[PSClient] = []

    def make(servers: list[ServerThread | str], worker_id: str, **kwargs: object) -> PSClient:
        kwargs.setdefault("timeout_s", WAIT_S)
        kwargs.setdefault("retry_budget_s", WAIT_S)
        # The chief's role: the contract's workers also declare the job (only a chief may).
        kwargs.setdefault("security", _security(pki, "chief", worker_id))
        addresses = [s if isinstance(s, str) else s.address for s in servers]
        clients.append(PSClient(addresses, worker_id, **kwargs))  # type: ignore[arg-type]
        return clients[-1]

    yield make
    for c in clients:
        c.close()


class _TLSWire(Wire):
    """The contract's raw gRPC access, as one credential."""

    def __init__(self, security: SecurityConfig) -> None:
        super().__init__()
        self.security = security

    def channel(self, server: ServerThread | str) -> grpc.Channel:
        address = server if isinstance(server, str) else server.address
        if address not in self._channels:
            self._channels[address] = self.security.channel(address, options=channel_options())
        return self._channels[address]


@pytest.fixture
def wire(pki: Path) -> Iterator[_TLSWire]:
    helper = _TLSWire(_security(pki, "chief", "w0"))
    yield helper
    helper.close()


# ---- what TLS adds ----

def _session(wire: Wire, server: ServerThread) -> pb.OpenTransportResponse:
    return wire.stub(server).OpenTransport(pb.OpenTransportRequest(
        worker_id="w0", kind=pb.TRANSPORT_KIND_TCP, request_bytes=4096, reply_bytes=4096), timeout=WAIT_S)


def _hello(session: pb.OpenTransportResponse) -> bytes:
    return pb.TransportHello(session=session.session, secret=session.secret).SerializeToString()


def test_a_peer_in_clear_does_not_get_on_the_tls_path_even_with_the_secret(start_server, new_client, wire):
    server = start_server(ServerSettings())
    c = new_client([server], "w0", transport="tcp")
    c.declare({"a": np.zeros(8, np.float32)}, ASYNC)
    before = wire.read(server, ["a"])
    session = _session(wire, server)
    with socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as sock:
        fastwire.send_frame(sock, fastwire.HELLO, _hello(session))
        header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp("w0", 0))
        header.push.append(wire.meta("a", "float32", [8]))
        fastwire.send_frame(sock, fastwire.REQUEST, header.SerializeToString(), [np.ones(8, np.float32)])
        try:
            answer = sock.recv(1)
        except ConnectionResetError:
            answer = b""
        assert answer in (b"", b"\x15")  # closed, or a TLS alert: never a frame
    assert wire.read(server, ["a"]) == before and not wire.stats(server).worker_transports


def test_a_certificate_of_another_ca_is_refused_at_the_handshake(start_server, new_client, wire, pki,
                                                                 tmp_path):
    server = start_server(ServerSettings())
    new_client([server], "w0", transport="grpc").declare({"a": np.zeros(8, np.float32)}, ASYNC)
    before = wire.read(server, ["a"])
    session = _session(wire, server)
    make_ca(tmp_path / "other")
    stranger = issue(tmp_path / "other", Identity("worker", "w0"))
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki / "ca.pem"))
    context.load_cert_chain(str(stranger.cert), str(stranger.key))
    with (socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as raw,
          pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)),
          context.wrap_socket(raw, server_hostname="127.0.0.1") as sock):
        fastwire.send_frame(sock, fastwire.HELLO, _hello(session))
        if sock.recv(1) == b"":  # TLS 1.3: the refusal arrives after the client's handshake
            raise ConnectionResetError("closed")
    assert wire.read(server, ["a"]) == before and not wire.stats(server).worker_transports


# ---- a session acts for its own worker only ----

def test_a_credential_opens_sessions_for_its_own_worker_and_a_session_pushes_only_as_it(
        start_server, new_client, wire):
    server = start_server(ServerSettings())
    new_client([server], "w0", transport="grpc").declare({"a": np.zeros(8, np.float32)}, ASYNC)
    before = wire.read(server, ["a"])
    with pytest.raises(grpc.RpcError) as refused:  # w0's credential, w1's session
        wire.stub(server).OpenTransport(pb.OpenTransportRequest(
            worker_id="w1", kind=pb.TRANSPORT_KIND_TCP, request_bytes=4096, reply_bytes=4096), timeout=WAIT_S)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    session = _session(wire, server)  # w0's own
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(wire.security.ca))
    context.load_cert_chain(str(wire.security.cert), str(wire.security.key))
    with (socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as raw,
          context.wrap_socket(raw, server_hostname="127.0.0.1") as sock):
        fastwire.send_frame(sock, fastwire.HELLO, _hello(session))
        header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp("w1", 0))
        header.push.append(wire.meta("a", "float32", [8]))
        fastwire.send_frame(sock, fastwire.REQUEST, header.SerializeToString(), [np.ones(8, np.float32)])
        kind, meta, _ = fastwire.Inbox(sock).frame_head()
    reply = pb.TransportReply.FromString(meta)
    assert kind == fastwire.REPLY and reply.error_type == "PermissionDeniedError", reply
    assert wire.read(server, ["a"]) == before


def test_sparse_table_requests_ride_the_tls_fast_path_too(start_server, new_client):
    from pshard.common.sparse import TableConfig

    server = start_server(ServerSettings())
    c = new_client([server], "w0", transport="tcp")
    c.declare_table(TableConfig("emb", 4, initializer="zeros", optimizer="sgd", lr=1.0))
    ids = np.array([3, 7, 2**40], np.int64)
    c.pull_rows("emb", ids, clock=0)
    c.push_rows("emb", ids, np.ones((3, 4), np.float32), clock=0)
    np.testing.assert_array_equal(c.pull_rows("emb", ids, clock=1), np.full((3, 4), -1.0, np.float32))
    assert c.tables.transports == ["tcp"]  # the fast-path session, not gRPC: its TLS handshake succeeded


def test_a_session_pushes_table_rows_only_as_its_own_worker(start_server, new_client, wire):
    from pshard.common.sparse import TableConfig

    server = start_server(ServerSettings())
    reader = new_client([server], "w0", transport="grpc")
    reader.declare_table(TableConfig("emb", 4, initializer="zeros", optimizer="sgd", lr=1.0))
    ids = np.array([3, 7], np.int64)
    # w0's session, with room for two page-aligned entries
    session = wire.stub(server).OpenTransport(pb.OpenTransportRequest(
        worker_id="w0", kind=pb.TRANSPORT_KIND_TCP, request_bytes=1 << 16, reply_bytes=1 << 16),
        timeout=WAIT_S)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(wire.security.ca))
    context.load_cert_chain(str(wire.security.cert), str(wire.security.key))
    replies = []
    with (socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as raw,
          context.wrap_socket(raw, server_hostname="127.0.0.1") as sock):
        fastwire.send_frame(sock, fastwire.HELLO, _hello(session))
        inbox = fastwire.Inbox(sock)
        for worker in ("w1", "w0"):
            header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_TABLE, stamp=wire.stamp(worker, 0),
                                       table=pb.TableRequest(table="emb", push=True))
            header.push.append(wire.meta("", "int64", [2]))
            header.push.append(wire.meta("", "float32", [2, 4]))
            fastwire.send_frame(sock, fastwire.REQUEST, header.SerializeToString(),
                                [ids, np.ones((2, 4), np.float32)])
            kind, meta, _ = inbox.frame_head()
            assert kind == fastwire.REPLY
            replies.append(pb.TransportReply.FromString(meta))
    assert replies[0].error_type == "PermissionDeniedError", replies[0]
    assert not replies[1].error_type and replies[1].summary.applied == 2, replies[1]
    np.testing.assert_array_equal(reader.pull_rows("emb", ids), np.full((2, 4), -1.0, np.float32))  # once


# ---- the TLS path runs off the event loop (ps_server/transport/tls_relay.py) ----

def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _relay_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("tls-relay-", "tls-out-"))]


def test_a_tls_connection_is_deciphered_in_threads_of_its_own_that_end_with_it(start_server, new_client):
    server = start_server(ServerSettings())
    before = _relay_threads()
    c = new_client([server], "w0", transport="tcp")
    weights = c.declare({"a": np.zeros(1 << 18, np.float32)}, ASYNC)
    c.push_pull({"a": np.ones(1 << 18, np.float32)}, 0, out=weights)
    assert c.transports == ["tcp"] and (weights["a"] == -1.0).all()
    # The worker's connection: its cipher runs in two threads named after its address, not on the loop.
    assert len(_relay_threads()) == len(before) + 2, _relay_threads()
    # The server cuts it: the worker's TLS socket is closed, the threads end, the worker connects again.
    assert server.running.fast.disconnect("w0") == 1
    _wait(lambda: _relay_threads() == before, f"relay threads outlived a cut connection: {_relay_threads()}")
    c.push_pull({"a": np.ones(1 << 18, np.float32)}, 1, out=weights)
    assert (weights["a"] == -2.0).all()
    c.push_pull({"a": np.ones(1 << 18, np.float32)}, 2, out=weights)
    assert (weights["a"] == -3.0).all()
    c.close()
    _wait(lambda: _relay_threads() == before, f"relay threads outlived their connection: {_relay_threads()}")
    _wait(lambda: not server.running.fast.transports(), "the session outlived its connection")


def test_a_refused_handshake_is_logged_with_the_peer_address_and_the_reason(start_server, pki, tmp_path,
                                                                             caplog):
    server = start_server(ServerSettings())
    make_ca(tmp_path / "other")
    stranger = issue(tmp_path / "other", Identity("worker", "w0"))
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(pki / "ca.pem"))
    context.load_cert_chain(str(stranger.cert), str(stranger.key))
    with caplog.at_level("WARNING", logger="pshard.ps.transport"):
        with socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as raw:
            host, port = raw.getsockname()[:2]
            peer = f"{host}:{port}"
            with contextlib.suppress(ssl.SSLError, ConnectionError), \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.recv(1)  # TLS 1.3: the server's refusal comes after our half of the handshake
        _wait(lambda: "handshake failed" in caplog.text, f"no handshake failure logged: {caplog.text!r}")
    line = next(r.getMessage() for r in caplog.records if "handshake failed" in r.getMessage())
    assert peer in line and "certificate verify failed" in line, line


def test_connections_in_their_handshake_count_against_the_cap_and_a_worker_still_gets_on(start_server,
                                                                                        new_client):
    """Each TLS connection holds a thread while it proves its certificate: past MAX_GREETING of them the
    newest are closed at once, so a crowd of strangers cannot make the server start threads without end."""
    from pshard.ps_server.transport.fastpath import MAX_GREETING

    server = start_server(ServerSettings())
    fast = server.running.fast
    extra = 4
    socks = [socket.create_connection(("127.0.0.1", fast.port), timeout=WAIT_S)
             for _ in range(MAX_GREETING + extra)]
    try:
        _wait(lambda: fast.refused_greetings == extra, f"refused {fast.refused_greetings}, expected {extra}")
        assert fast.greeting == MAX_GREETING and len(_relay_threads()) <= MAX_GREETING
    finally:
        for sock in socks:
            sock.close()
    # Gone before their handshake: their threads end and they count no more.
    _wait(lambda: fast.greeting == 0 and not _relay_threads(), f"{fast.greeting} still greeting")
    c = new_client([server], "w0", transport="tcp")
    weights = c.declare({"a": np.zeros(8, np.float32)}, ASYNC)
    c.push_pull({"a": np.ones(8, np.float32)}, 0, out=weights)
    assert c.transports == ["tcp"] and (weights["a"] == -1.0).all()


def _times_run(names: tuple[str, ...]) -> int:
    """How many times this process's threads named `names...` were put on a CPU (their wake-ups)."""
    runs = 0
    for t in threading.enumerate():
        if t.name.startswith(names) and t.native_id is not None:
            with contextlib.suppress(FileNotFoundError):  # ended meanwhile
                runs += int(Path(f"/proc/self/task/{t.native_id}/schedstat").read_text().split()[2])
    return runs


def test_small_calls_wake_no_relay_thread_and_a_large_one_still_goes_through_them(start_server, new_client):
    """A thread's wake-up costs tens of microseconds of a small call's few hundred: the event loop reads
    and answers small requests on the TLS socket itself, and the relay's threads take the bulk."""
    server = start_server(ServerSettings())
    c = new_client([server], "w0", transport="tcp")
    weights = c.declare({"a": np.zeros(1000, np.float32), "b": np.zeros(1 << 20, np.float32)}, ASYNC)
    small, large = {"a": np.ones(1000, np.float32)}, {"b": np.ones(1 << 20, np.float32)}
    c.push_pull(small, 0, out=weights)
    relay = ("tls-relay-", "tls-out-")
    before = _times_run(relay)
    calls = 200
    for clock in range(1, calls + 1):
        c.push_pull(small, clock, out=weights)
    woken = _times_run(relay) - before
    assert (weights["a"] == -(calls + 1.0)).all()
    # Through the relay each call woke both threads (2 x 200); a stray wake-up (a timer tick) may happen.
    assert woken < calls // 10, f"the relay threads ran {woken} times for {calls} small calls"
    # A 4 MiB push and pull: deciphered and enciphered by the threads, and small calls go on after it.
    c.push_pull(large, 0, out=weights)
    assert (weights["b"] == -1.0).all() and _times_run(relay) > before + woken
    c.push_pull(small, calls + 1, out=weights)
    assert (weights["a"] == -(calls + 2.0)).all() and c.transports == ["tcp"]
