"""The TLS relay's hand-offs (ps_server/transport/tls_relay.py): the decrypting thread lends the TCP socket
to the event loop between bursts and takes it back for bulk or when the pair is full; whichever reads,
every byte reaches the pair once and in order, and a small reply sent from the loop keeps its place."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from pshard.common.security.ca import CertFiles, ensure
from pshard.common.security.identity import Identity
from pshard.common.wire.tls_stream import TlsStream
from pshard.ps_server.transport.tls_relay import TlsRelay

WAIT_S = 30.0
SERVER, WORKER = Identity("ps", "ps-0"), Identity("worker", "worker-0")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[Identity, CertFiles]:
    return ensure(tmp_path_factory.mktemp("pki"), [SERVER, WORKER])


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(WAIT_S)
    loop.close()


def _relayed(pki: dict[Identity, CertFiles], loop: asyncio.AbstractEventLoop
             ) -> tuple[TlsStream, socket.socket, TlsRelay]:
    """A worker's TlsStream, the pair's end the server would serve (nobody reads it yet), the relay."""
    listener = socket.create_server(("127.0.0.1", 0))
    server_context = pki[SERVER].security("ps", "ps-0").server_ssl_context()
    ready: list[tuple[socket.socket, TlsRelay]] = []
    got_end = threading.Event()

    def on_ready(end: socket.socket, peer: object, relay: TlsRelay) -> None:
        ready.append((end, relay))
        got_end.set()

    def accept() -> None:
        sock, peer = listener.accept()
        sock.setblocking(True)
        TlsRelay(sock, peer, server_context, WAIT_S, 60.0, on_ready, lambda: None, loop).start()

    thread = threading.Thread(target=accept)
    thread.start()
    raw = socket.create_connection(listener.getsockname(), timeout=WAIT_S)
    client_context = pki[WORKER].security("worker", "worker-0").client_ssl_context()
    stream = TlsStream.connect(raw, client_context, "127.0.0.1")
    thread.join(WAIT_S)
    listener.close()
    assert got_end.wait(WAIT_S)
    end, relay = ready[0]
    end.settimeout(WAIT_S)
    return stream, end, relay


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(min(1 << 20, n - len(got)))
        assert chunk, f"EOF after {len(got)} of {n} bytes"
        got += chunk
    return bytes(got)


def test_small_writes_then_bulk_with_nobody_reading_reach_the_pair_once_and_in_order(pki, loop) -> None:
    stream, end, relay = _relayed(pki, loop)
    rng = np.random.default_rng(7)
    # Small records (read by the loop while it is lent the socket, or by the thread), more of them than the
    # pair takes while nobody reads it, then bulk (a read that fills 64 KiB gives the socket back), then
    # small again: whichever side reads when, the pair gets every byte once, in order.
    parts = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
             for n in [*rng.integers(1, 3000, 200), 5 << 20, *rng.integers(1, 3000, 50)]]
    small_sent = threading.Event()

    def send() -> None:
        for i, part in enumerate(parts):
            if i == 200:
                small_sent.set()
            stream.send_all([memoryview(part)])

    sender = threading.Thread(target=send)
    sender.start()
    # The small records alone (about 300 kB) are more than the pair takes: read nothing until they are sent.
    assert small_sent.wait(WAIT_S)
    expected = b"".join(parts)
    assert _read_exactly(end, len(expected)) == expected
    sender.join(WAIT_S)
    # A small reply from the loop, after a large one through the pair: it waits for the pair's bytes.
    large = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    end.sendall(large)
    taken = asyncio.run_coroutine_threadsafe(_send_direct(relay, b"tail", len(large)), loop).result(WAIT_S)
    if not taken:  # the thread had not encrypted all of it yet: the tail goes through the pair, after it
        end.sendall(b"tail")
    stream.settimeout(WAIT_S)
    got = bytearray()
    buf = memoryview(bytearray(1 << 20))
    while len(got) < len(large) + 4:
        n = stream.recv_into(buf)
        assert n, "EOF"
        got += buf[:n]
    assert bytes(got) == large + b"tail"
    end.close()  # the server's close ends the connection: the worker sees EOF
    assert stream.recv_into(buf) == 0
    stream.close()


async def _send_direct(relay: TlsRelay, frame: bytes, written: int) -> bool:
    return relay.send_direct(frame, written)


def test_a_reply_sent_from_the_loop_is_refused_while_the_pair_has_bytes_not_yet_encrypted(pki, loop) -> None:
    stream, end, relay = _relayed(pki, loop)
    future = asyncio.run_coroutine_threadsafe(_send_direct(relay, b"early", 10), loop)
    assert future.result(WAIT_S) is False  # 10 bytes were said to be in the pair: none encrypted yet
    future = asyncio.run_coroutine_threadsafe(_send_direct(relay, b"hello", 0), loop)
    assert future.result(WAIT_S) is True
    stream.settimeout(WAIT_S)
    buf = memoryview(bytearray(64))
    assert bytes(buf[:stream.recv_into(buf)]) == b"hello"
    end.close()
    stream.close()
