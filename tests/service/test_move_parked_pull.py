"""A sync pull parked on a server, waiting for its clock, when a new layout moves its slices to another
server (a join, issue 20; a drain; a failover) is refused with the re-route error at the switch, not
left to wait out its deadline: its clock now completes on the new primary, and the worker re-routes
there at once (a run under load waited 30 s here before). Two real replicated servers."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.replicas import fail_over
from pshard.common.errors import UnknownKeyError
from pshard.common.rpc.serving import ServerThread

from tests.service.conftest import Wire
from tests.service.test_replication import ADAM, _grads, _initial, _layout, _replicated

TIMEOUT_S = 60.0  # the pull's deadline: what the parked pull would wait without the fix


def test_a_pull_parked_on_a_slice_that_moves_away_is_refused_at_the_switch(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient], wire: Wire) -> None:
    servers = _replicated(start_server, 2)
    layout = _layout([s.address for s in servers], 1)
    client = new_client(servers, "w0", layout=layout, timeout_s=TIMEOUT_S, transport="grpc")
    client.declare(_initial(), ADAM)
    # w1 never pushes clock 0: w0's pull of its next weights parks on both servers.
    future = client.push(_grads("w0", 0), 0)
    future.result(timeout=TIMEOUT_S)
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(client.pull, 1)
        for server in servers:
            wire.wait_stats(server, lambda s: s.pulls_waiting >= 1, f"w0's pull parked on {server.address}")
        moved, _ = fail_over(layout, 0, {1})
        moved = dataclasses.replace(moved, version=layout.version + 1)
        started = time.monotonic()
        servers[0].call(lambda: servers[0].running.handlers.set_ownership(moved.version, frozenset()))
        with pytest.raises(UnknownKeyError, match="moved: layout version"):
            parked.result(timeout=TIMEOUT_S)
        assert time.monotonic() - started < TIMEOUT_S / 4, "the parked pull waited for its deadline"
        # Server 1's part of the pull is still parked (w1 never pushes): cut it short.
        client.close()
