"""Fast-path frames over non-blocking sockets (the worker's side): deadlines kept by fastwire itself,
a spinning wait for a near reply, and big frames that only fit as the peer reads them."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from pshard.common.wire.fastwire import REPLY, REQUEST, Inbox, recv_into, send_frame, tune


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(0.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
def test_a_frame_sent_later_is_read_whether_spinning_or_sleeping(pair: tuple[socket.socket, socket.socket],
                                                                 spin_s: float) -> None:
    ours, theirs = pair
    inbox = Inbox(ours)
    inbox.deadline = time.monotonic() + 5
    data = np.arange(1000, dtype=np.float32)
    sender = threading.Timer(0.02, send_frame, (theirs, REPLY, b"meta", [data]))
    sender.start()
    try:
        kind, meta, data_len = inbox.frame_head(spin_s)
        got = np.empty_like(data)
        inbox.read_into(got)
    finally:
        sender.join(5)
    assert (kind, meta, data_len) == (REPLY, b"meta", data.nbytes)
    assert np.array_equal(got, data)


def test_nothing_before_the_deadline_is_a_timeout(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    inbox = Inbox(ours)
    inbox.deadline = time.monotonic() + 0.05
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        inbox.frame_head(0.01)
    assert 0.04 <= time.monotonic() - started < 5
    with pytest.raises(TimeoutError):
        recv_into(ours, np.empty(10, np.uint8), time.monotonic() + 0.01)


def test_a_frame_larger_than_the_socket_buffers_is_sent_as_the_peer_reads(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    data = np.random.default_rng(0).integers(0, 255, 32 * 2**20, dtype=np.uint8)
    got = np.empty_like(data)

    def read() -> None:
        peer = Inbox(theirs)
        assert peer.frame_head() == (REQUEST, b"big", data.nbytes)
        peer.read_into(got)

    reader = threading.Thread(target=read)
    reader.start()
    send_frame(ours, REQUEST, b"big", [data], time.monotonic() + 30)
    reader.join(30)
    assert not reader.is_alive() and np.array_equal(got, data)


def test_tune_leaves_a_tcp_sockets_buffers_to_the_kernels_autotuning() -> None:
    """Setting SO_SNDBUF/SO_RCVBUF locks a TCP socket's buffers: a locked 8 MiB stalled 1 Gbit/s flows
    whenever a busy machine kept the reader off the CPU for tens of milliseconds (issue 19). Nagle stays off;
    a unix socket (the shm doorbell) still gets its big buffers."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()):
        theirs, _ = listener.accept()
        with theirs:
            kernels = [theirs.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
            tune(theirs)
            assert [theirs.getsockopt(socket.SOL_SOCKET, o)
                    for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)] == kernels
            assert theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    a, b = socket.socketpair()
    with a, b:
        tune(a)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 4 * 2**20
