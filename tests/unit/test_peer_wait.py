"""PeerWait (issue 10): a wait for peers says every few seconds whom it waits for and where, and ends
at once, naming the peer, when the peer is known gone or refuses connections past a grace. Real
sockets on 127.0.0.1; every wait bounded."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from pshard.common.errors import UnavailableError
from pshard.worker.waiting import Peer, PeerWait, refused

WAIT_S = 10.0


def closed_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_refused_tells_a_listening_address_from_an_empty_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert refused(f"127.0.0.1:{s.getsockname()[1]}") is None
    assert refused(closed_port_address()) == "connection refused"


def test_a_peer_refusing_past_the_grace_ends_the_wait_naming_it(caplog) -> None:
    address = closed_port_address()
    released = threading.Event()
    caplog.set_level(logging.WARNING, logger="pshard.worker")
    started = time.monotonic()

    peers = [Peer("the scheduler", address, listens=True)]
    with pytest.raises(UnavailableError) as caught, PeerWait("registering", lambda: peers, released.set,
                                                             log_every_s=0.5, refused_grace_s=1.5):
        if not released.wait(WAIT_S):  # the blocking wait, ended by abort
            raise AssertionError("never aborted")
        raise RuntimeError("cancelled")

    assert 1.5 <= time.monotonic() - started < WAIT_S
    message = str(caught.value)
    assert message.startswith(f"registering: the scheduler at {address}: connection refused for ")
    assert "nothing listens there" in message
    assert isinstance(caught.value.__cause__, RuntimeError)
    waiting = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert waiting and f"for the scheduler at {address} (connection refused for" in waiting[0], waiting


def test_a_peer_known_gone_ends_the_wait_at_once() -> None:
    released = threading.Event()
    peer = Peer("worker-1", "127.0.0.1:1", "already left the job", gone=True)
    started = time.monotonic()
    gone = r"the start barrier: worker-1 at 127.0.0.1:1 is gone \(already left the job\)"
    wait = PeerWait("the start barrier", lambda: [peer], released.set, refused_grace_s=60)
    with pytest.raises(UnavailableError, match=gone), wait:
        assert released.wait(WAIT_S)
        raise RuntimeError("cancelled")
    assert time.monotonic() - started < 2.0


def test_a_wait_that_ends_on_its_own_is_left_alone(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pshard.worker")
    aborted = threading.Event()
    with PeerWait("declaring", lambda: [Peer("ps-0", "127.0.0.1:1", "slow")], aborted.set,
                  log_every_s=0.2, refused_grace_s=60) as wait:
        time.sleep(0.8)  # the wait being observed: a peer that answers late, not a race being papered over
    assert wait.failure is None and not aborted.is_set()
    lines = [r.getMessage() for r in caplog.records]
    assert any("declaring: still waiting after" in m and "ps-0 at 127.0.0.1:1 (slow)" in m for m in lines)


def test_the_wait_line_names_the_peer_that_does_not_answer_not_every_peer(caplog) -> None:
    """Issue 24: of three servers, the one nobody reaches is named, the others only counted."""
    down = closed_port_address()
    released = threading.Event()
    caplog.set_level(logging.WARNING, logger="pshard.worker")
    with socket.socket() as up1, socket.socket() as up2:
        for s in (up1, up2):
            s.bind(("127.0.0.1", 0))
            s.listen()
        peers = [Peer(f"ps-{i}", a, listens=True) for i, a in enumerate(
            [f"127.0.0.1:{up1.getsockname()[1]}", down, f"127.0.0.1:{up2.getsockname()[1]}"])]
        with PeerWait("declaring", lambda: peers, released.set, log_every_s=0.5, refused_grace_s=WAIT_S):
            deadline = time.monotonic() + WAIT_S
            while not any("still waiting" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no wait line"
                time.sleep(0.05)
    line = next(r.getMessage() for r in caplog.records if "still waiting" in r.getMessage())
    assert f"for ps-1 at {down} (connection refused for " in line
    assert line.endswith("(2 others answer)"), line
    assert "ps-0" not in line and "ps-2" not in line


def test_a_peer_whose_port_answers_nothing_ends_the_wait_naming_a_firewall(caplog) -> None:
    """Issue 24: a port others cannot reach (dropped, not refused) is named with the port to open, not
    waited for until the start-up timeout."""
    released = threading.Event()
    with socket.create_server(("127.0.0.1", 0), backlog=0) as full:
        address = f"127.0.0.1:{full.getsockname()[1]}"
        # Nobody accepts and the queue is full: the kernel drops further SYNs unanswered, as a firewall does.
        held = socket.create_connection(full.getsockname(), timeout=5.0)
        try:
            peers = [Peer("ps-0", address, listens=True)]
            started = time.monotonic()
            with pytest.raises(UnavailableError) as caught, PeerWait("declaring", lambda: peers, released.set,
                                                                     refused_grace_s=1.5):
                if not released.wait(WAIT_S):
                    raise AssertionError("never aborted")
                raise RuntimeError("cancelled")
        finally:
            held.close()
    assert time.monotonic() - started < WAIT_S
    port = address.rsplit(":", 1)[1]
    assert f"ps-0 at {address}: no answer within 1 s for " in str(caught.value)
    assert f"a firewall drops port {port}, or the host is down: open TCP port {port} on 127.0.0.1" in str(
        caught.value)
