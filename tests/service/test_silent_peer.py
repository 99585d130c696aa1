"""A raw TCP fast-path call in flight to a host that is cut off (its link down, the process alive)
breaks within the liveness figure, not at the call's deadline (issue 24, "every transport notices a
dead peer"). Two network namespaces on a veth pair stand for the hosts: the kernel drops what the
dead link would, so nothing answers, not even a reset. Needs root (CI runs as root)."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pytest
from pshard.client.fast_session import FastPath
from pshard.common.wire.fastwire import REQUEST, PeerSilent, open_session, recv_frame_head
from pshard.common.wire.shm import Segment

from pshard.api.v1 import parameter_server_pb2 as pb

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000
_DEAD_AFTER_S = 2.0
_DEADLINE_S = 20.0  # the call's own: what a silent peer cost before keepalives

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2 (CI runs as root)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _in_netns(name: str, fn: Callable[[], T]) -> T:
    """fn() on a thread that entered network namespace `name`: the sockets it makes live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {name}")
        finally:
            os.close(fd)
        try:
            out.append(fn())
        except BaseException as err:  # handed to the caller
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(15)
    if errors:
        raise errors[0]
    return out[0]


@pytest.fixture
def hosts() -> Iterator[tuple[str, str, str]]:
    """Two namespaces ("server", "worker") joined by a veth pair: (server ns, worker ns, server IP)."""
    tag = f"pshard-sp{os.getpid()}"
    server, worker = f"{tag}-s", f"{tag}-w"
    subnet = 16 + os.getpid() % 200  # unique enough among concurrent runs, and private to the namespaces
    try:
        _ip("netns", "add", server)
        _ip("netns", "add", worker)
        _ip("link", "add", "psv-s", "netns", server, "type", "veth", "peer", "name", "psv-w", "netns", worker)
        for ns, dev, host in ((server, "psv-s", 1), (worker, "psv-w", 2)):
            _ip("-n", ns, "addr", "add", f"10.{subnet}.0.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield server, worker, f"10.{subnet}.0.1"
    finally:
        for ns in (server, worker):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_a_call_in_flight_to_a_cut_off_host_breaks_within_the_liveness_figure(
        hosts: tuple[str, str, str]) -> None:
    server_ns, worker_ns, server_ip = hosts
    listener = _in_netns(server_ns, lambda: socket.create_server((server_ip, 0)))
    port = listener.getsockname()[1]
    sock = _in_netns(worker_ns, lambda: open_session(f"{server_ip}:1", port, b"hello", 5.0, None,
                                                     dead_after_s=_DEAD_AFTER_S))
    peer, _ = listener.accept()
    path = FastPath("tcp", sock, None, Segment.private(0, 4096))
    try:
        peer.settimeout(5.0)
        recv_frame_head(peer)  # the hello
        # A request the server holds without answering, as a sync pull waits for the slowest worker.
        header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL)
        path.start(header, [np.zeros(16, np.float32)], _DEADLINE_S)
        assert recv_frame_head(peer)[0] == REQUEST
        _ip("-n", server_ns, "link", "set", "psv-s", "down")  # the server's host is cut off
        cut = time.monotonic()
        with pytest.raises(PeerSilent):
            path.finish(header, lambda i, raw: None, lambda i: None)
        waited = time.monotonic() - cut
        # At most twice the heartbeat timeout it stands for (the bar), not the deadline.
        assert waited <= 2 * _DEAD_AFTER_S, f"noticed after {waited:.1f} s"
    finally:
        path.close()
        peer.close()
        listener.close()
