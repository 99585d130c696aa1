"""A fast-path TCP socket notices a silent peer (common.wire.liveness), and a connect that nobody
answers fails within seconds as FastPortSilent (issue 24: a firewall that drops the fast-path port)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.wire.fastwire import HELLO, FastPortSilent, open_session, recv_frame_head
from pshard.common.wire.liveness import KeepAlive, figures, keep_alive


@pytest.mark.parametrize("dead_after_s", [0.2, 1.0, 2.0, 5.0, 7.5, 30.0])
def test_a_silent_peer_is_noticed_within_the_figure_and_at_most_twice_it(dead_after_s: float) -> None:
    ka = figures(dead_after_s)
    assert ka.idle_s >= 1 and ka.interval_s >= 1 and ka.count >= 1  # the kernel's whole seconds
    assert ka.user_timeout_ms == round(dead_after_s * 1000)
    assert ka.detection_s <= max(2 * dead_after_s, ka.idle_s + ka.interval_s * ka.count)
    assert ka.detection_s <= 2 * dead_after_s or dead_after_s < 2  # below 2 s the kernel's 1 s ticks rule


def test_the_default_heartbeat_timeout_gives_five_seconds() -> None:
    assert figures(5.0) == KeepAlive(idle_s=2, interval_s=1, count=3, user_timeout_ms=5000)
    assert figures(5.0).detection_s == 5.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_figure_is_refused_naming_it(bad: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"dead_after_s: got"):
        figures(bad)


def _options(sock: socket.socket) -> tuple[int, int, int, int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0), backlog=0)
    yield sock
    sock.close()


def test_a_session_socket_is_kept_alive_by_the_given_figure(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    sock = open_session(f"127.0.0.1:{port}", port, b"hello", 5.0, None, dead_after_s=7.5)
    try:
        peer, _ = listener.accept()
        with peer:
            peer.settimeout(5.0)
            assert recv_frame_head(peer)[:2] == (HELLO, b"hello")
        ka = figures(7.5)
        assert _options(sock) == (1, ka.idle_s, ka.interval_s, ka.count, ka.user_timeout_ms)
    finally:
        sock.close()


def test_keep_alive_leaves_a_unix_socket_alone() -> None:
    a, b = socket.socketpair()
    with a, b:
        keep_alive(a, 1.0)  # no TCP options on AF_UNIX: must not raise
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


def test_a_port_that_answers_nothing_fails_fast_naming_it_and_the_fix(listener: socket.socket) -> None:
    # A listener nobody accepts from, its queue full: the kernel drops further SYNs without a word,
    # as a dropping firewall does.
    port = listener.getsockname()[1]
    held = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    try:
        start = time.monotonic()
        with pytest.raises(FastPortSilent) as caught:
            open_session(f"127.0.0.1:{port}", port, b"hello", 1.0, None)
        assert time.monotonic() - start < 3.0  # the connect's own timeout, not the call's minutes
        assert f"port {port} on 127.0.0.1" in str(caught.value)
        assert "--fast-port" in str(caught.value)
    finally:
        held.close()


def test_a_refused_port_is_an_ordinary_os_error_not_silent() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: the kernel answers with a reset
    with pytest.raises(ConnectionRefusedError):
        open_session(f"127.0.0.1:{port}", port, b"hello", 1.0, None)
