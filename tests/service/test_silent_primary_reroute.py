"""A step in flight over raw TCP to a primary that went silent (its host cut off: its replies never come)
is re-routed to the promoted backup within the liveness figure once the failover is published, not after
the call's deadline and a resend to the same address (issue 24, "re-routed within seconds, as gRPC's
keepalive does"). Three real replicated servers; the silence is the kernel's: a socket filter on each
worker's session to the primary drops every packet from it, so nothing answers, not even the probes."""

from __future__ import annotations

import ctypes
import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.rpc.serving import ServerThread
from pshard.ps_server.settings import ServerSettings

from tests.service.test_replication import ADAM, WORKERS, _initial, _layout, _replicated, _train

DEAD_AFTER_S = 1.0
STEP_TIMEOUT_S = 30.0  # what a silent call cost before: its deadline, then a resend
_SO_ATTACH_FILTER = 26  # linux/filter.h


def _deaf(sock: socket.socket) -> None:
    """Drop every packet that arrives for `sock` (classic BPF, "return 0"): its peer seems gone."""
    program = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, struct.pack("HL", 1, ctypes.addressof(program)))


@pytest.fixture
def undisturbed(start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]
                ) -> dict[str, np.ndarray]:
    """Eight sync steps on three servers without replication (test_replication's reference)."""
    servers = [start_server(ServerSettings(static_quorum=dict.fromkeys(WORKERS, 0))) for _ in range(3)]
    layout = _layout([s.address for s in servers], 0)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    return _train(clients, range(8), ADAM, _initial())["w0"]


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "still-serving-grpc"])
def test_a_silent_primary_is_re_routed_within_the_liveness_figure(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient],
        undisturbed: dict[str, np.ndarray], fenced: bool) -> None:
    """`fenced`: the old primary refuses its former slices (as after a failover), so even a resend to it
    over gRPC would re-route; unfenced, only the client's own decision (a silent peer is not resent to
    the same address) takes the step to the new primary."""
    servers = _replicated(start_server, 3)
    layout = _layout([s.address for s in servers], 1)
    moved, _ = fail_over(layout, 1, {0, 2})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    published = threading.Event()  # the scheduler's failover layout

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return moved if published.wait(timeout_s) and moved.version > current.version else None

    clients = {w: new_client(servers, w, layout=layout, relayout=relayout, reroute_wait_s=STEP_TIMEOUT_S,
                             transport="tcp", timeout_s=STEP_TIMEOUT_S, dead_after_s=DEAD_AFTER_S)
               for w in WORKERS}
    _train(clients, range(4), ADAM, _initial())
    assert all(c.transports == ["tcp"] * 3 for c in clients.values())
    # Server 1's host is cut off: the workers hear nothing more from it, and the scheduler fails it over
    # (it is fenced out of its old slices, as a primary declared dead is).
    for client in clients.values():
        _deaf(client.connections.sessions()[1]._sock)  # type: ignore[union-attr]  # the session's own socket
    if fenced:
        servers[1].call(lambda: servers[1].running.handlers.set_ownership(moved.version, frozenset()))
    published.set()
    started = time.monotonic()
    result = _train(clients, range(4, 8), ADAM)
    took = time.monotonic() - started
    assert took < 4 * DEAD_AFTER_S + 5, f"4 steps took {took:.1f} s: the silent call waited for its deadline"
    for worker in WORKERS:
        assert clients[worker].reroutes == 1
        for key, expected in undisturbed.items():
            assert result[worker][key].tobytes() == expected.tobytes(), (worker, key)
