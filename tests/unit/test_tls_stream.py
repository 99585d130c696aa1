"""The worker's TLS stream (common/wire/tls_stream.py) against a real OpenSSL server socket made from the
job's certificates: it authenticates both ways as an SSLSocket does, refuses what an SSLSocket refuses,
carries frames whole in both directions at once (a sender thread while the caller reads), and keeps a
non-blocking socket's deadline."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pshard.common.security.ca import CertFiles, ensure, issue, make_ca
from pshard.common.security.identity import Identity
from pshard.common.wire.fastwire import REPLY, REQUEST, Inbox, TransportBroken, open_session, send_frame
from pshard.common.wire.tls_stream import BATCH_BYTES, TlsStream

WAIT_S = 30.0
SERVER, WORKER = Identity("ps", "ps-0"), Identity("worker", "worker-0")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[Identity, CertFiles]:
    return ensure(tmp_path_factory.mktemp("pki"), [SERVER, WORKER])


def _context(files: CertFiles, role: str, node_id: str, server: bool) -> ssl.SSLContext:
    security = files.security(role, node_id)
    return security.server_ssl_context() if server else security.client_ssl_context()


class EchoServer:
    """One TLS connection on 127.0.0.1, served by an SSLSocket in a thread: each frame's data is sent
    back as it is read, after a REPLY header with its metadata (so the client must read while it still
    sends). How the connection ended is kept in `ended`."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._context = context
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.ended: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        raw, _ = self._listener.accept()
        raw.settimeout(WAIT_S)
        try:
            with self._context.wrap_socket(raw, server_side=True) as sock:
                inbox = Inbox(sock)
                while True:
                    _, meta, size = inbox.frame_head()
                    send_frame(sock, REPLY, meta)  # its header; the data follows as it comes
                    chunk = np.empty(BATCH_BYTES, np.uint8)
                    for start in range(0, size, BATCH_BYTES):
                        part = chunk[:min(BATCH_BYTES, size - start)]
                        inbox.read_into(part)
                        sock.sendall(part.data)
        except (OSError, TransportBroken) as err:  # the client went, or was refused
            self.ended.append(err)
        finally:
            raw.close()

    def close(self) -> None:
        self._listener.close()
        self._thread.join(WAIT_S)


@pytest.fixture
def echo(pki: dict[Identity, CertFiles]) -> Iterator[EchoServer]:
    server = EchoServer(_context(pki[SERVER], "ps", "ps-0", server=True))
    yield server
    server.close()


def _connect(port: int, context: ssl.SSLContext, host: str = "127.0.0.1") -> TlsStream:
    raw = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    try:
        return TlsStream.connect(raw, context, host)
    except BaseException:
        raw.close()
        raise


def test_a_large_frame_goes_out_while_its_echo_is_read_on_another_thread(pki, echo) -> None:
    stream = _connect(echo.port, _context(pki[WORKER], "worker", "worker-0", server=False))
    stream.settimeout(0.0)  # as a worker's session: deadlines kept by fastwire
    deadline = time.monotonic() + WAIT_S
    # More than the sockets' buffers hold both ways: the echo comes back while the request is still
    # being sent, and neither side could finish if reads and writes of the one TLS connection waited
    # for each other.
    data = np.random.default_rng(0).integers(0, 256, 32 * BATCH_BYTES + 12345, dtype=np.uint8)
    sender = threading.Thread(target=send_frame, args=(stream, REQUEST, b"meta", [data], deadline))
    sender.start()
    inbox = Inbox(stream)
    inbox.deadline = deadline
    kind, meta, size = inbox.frame_head()
    got = np.empty(data.nbytes, np.uint8)
    inbox.read_into(got)
    sender.join(WAIT_S)
    assert (kind, meta, size) == (REPLY, b"meta", 0)
    np.testing.assert_array_equal(got, data)
    assert stream.version() == "TLSv1.3" and stream.getpeercert()
    stream.close()


def test_open_session_runs_tls_over_a_stream_that_authenticates_the_server(pki, echo) -> None:
    context = _context(pki[WORKER], "worker", "worker-0", server=False)
    stream = open_session(f"127.0.0.1:{echo.port}", echo.port, b"hello", WAIT_S, context)
    assert isinstance(stream, TlsStream)
    assert Inbox(stream).frame_head() == (REPLY, b"hello", 0)  # the echo of its hello frame
    stream.close()


def test_a_server_certificate_that_does_not_name_the_host_is_refused(pki, echo) -> None:
    context = _context(pki[WORKER], "worker", "worker-0", server=False)
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        _connect(echo.port, context, host="10.255.1.2")
    echo.close()
    assert echo.ended and isinstance(echo.ended[0], ssl.SSLError), echo.ended  # the client's alert


def _refused_by_the_server(echo: EchoServer, context: ssl.SSLContext) -> None:
    """The server refuses the client: at the handshake, or (TLS 1.3) at the client's first read."""
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        stream = _connect(echo.port, context)
        try:
            send_frame(stream, REQUEST, b"x")
            if Inbox(stream).frame_head():
                pass
        finally:
            stream.close()
    echo.close()  # its connection is over
    assert echo.ended and isinstance(echo.ended[0], ssl.SSLError), echo.ended


def test_a_client_without_a_certificate_is_refused(pki, echo) -> None:
    context = ssl.create_default_context(cafile=str(pki[WORKER].ca))
    _refused_by_the_server(echo, context)


def test_a_client_certificate_of_another_ca_is_refused(pki, echo, tmp_path: Path) -> None:
    make_ca(tmp_path)
    stranger = issue(tmp_path, WORKER)
    context = ssl.create_default_context(cafile=str(pki[WORKER].ca))
    context.load_cert_chain(str(stranger.cert), str(stranger.key))
    _refused_by_the_server(echo, context)


def test_a_send_that_finds_no_room_gives_up_at_its_deadline(pki) -> None:
    context = _context(pki[SERVER], "ps", "ps-0", server=True)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[ssl.SSLSocket] = []

    def accept() -> None:  # handshake, then never read
        raw, _ = listener.accept()
        raw.settimeout(WAIT_S)
        accepted.append(context.wrap_socket(raw, server_side=True))

    thread = threading.Thread(target=accept)
    thread.start()
    stream = _connect(listener.getsockname()[1], _context(pki[WORKER], "worker", "worker-0", server=False))
    thread.join(WAIT_S)
    stream.settimeout(0.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        send_frame(stream, REQUEST, b"", [np.zeros(64 * 2**20, np.uint8)], start + 0.5)
    assert 0.5 <= time.monotonic() - start < 0.5 + WAIT_S / 2
    stream.close()
    for sock in accepted:
        sock.close()
    listener.close()


def _pair(pki: dict[Identity, CertFiles]) -> tuple[TlsStream, ssl.SSLSocket, socket.socket]:
    """A TlsStream (the worker's side) and the SSLSocket it talks to; the listener, to close."""
    context = _context(pki[SERVER], "ps", "ps-0", server=True)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[ssl.SSLSocket] = []

    def accept() -> None:
        raw, _ = listener.accept()
        raw.settimeout(WAIT_S)
        accepted.append(context.wrap_socket(raw, server_side=True))

    thread = threading.Thread(target=accept)
    thread.start()
    stream = _connect(listener.getsockname()[1], _context(pki[WORKER], "worker", "worker-0", server=False))
    thread.join(WAIT_S)
    stream.settimeout(None)  # blocking, as the server's relay keeps it: the nowait calls must not wait
    return stream, accepted[0], listener


def test_sends_that_must_not_wait_keep_what_the_socket_refuses_in_order_for_flush(pki) -> None:
    stream, peer, listener = _pair(pki)
    frames = [np.full(16384, i % 251, np.uint8).tobytes() for i in range(2000)]  # 32 MiB: more than fits
    results = []
    for frame in frames:
        start = time.monotonic()
        results.append(stream.send_nowait(frame))
        assert time.monotonic() - start < WAIT_S / 4  # never waits for room
        if results[-1] is False:
            break
    assert results[-1] is False and all(results[:-1]) and stream.queued
    sent = b"".join(frames[:len(results)])
    flusher = threading.Thread(target=stream.flush)
    flusher.start()
    got = bytearray()
    while len(got) < len(sent):
        got += peer.recv(1 << 20)
    flusher.join(WAIT_S)
    assert bytes(got) == sent and not stream.queued
    stream.close()
    peer.close()
    listener.close()


def test_a_read_that_must_not_wait_decrypts_what_came_or_says_nothing_did(pki) -> None:
    stream, peer, listener = _pair(pki)
    buf = memoryview(bytearray(65536))
    # TLS 1.3: the server's session tickets, sent with its handshake (in the kernel once it returned),
    # are read and decrypt to nothing for the caller; then nothing is there.
    assert stream.recv_nowait(buf, 65536)[0] == 0
    with pytest.raises(BlockingIOError):
        stream.recv_nowait(buf, 65536)
    peer.sendall(b"x" * 5000)
    got = bytearray()
    while len(got) < 5000:
        assert select.select([stream], [], [], WAIT_S)[0], f"{len(got)} of 5000 bytes came"
        with contextlib.suppress(BlockingIOError):
            n, read = stream.recv_nowait(buf, 65536)
            assert read >= n
            got += buf[:n]
    assert bytes(got) == b"x" * 5000
    peer.close()
    while True:  # the peer's close_notify (nothing decrypted), then the EOF
        assert select.select([stream], [], [], WAIT_S)[0], "no EOF"
        with contextlib.suppress(BlockingIOError):
            if stream.recv_nowait(buf, 65536) == (0, 0):
                break
    stream.close()
    listener.close()
