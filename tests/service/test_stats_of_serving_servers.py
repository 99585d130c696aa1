"""A chief's last wait for its peers reads their clocks from the servers' stats; after a drain (issue 20)
or a failover one server of the layout serves nothing and is gone, and asking it too cost that wait its
whole deadline (30 s in the e2e drain test). `PSClient.stats(serving_only=True)` asks only the servers
the layout gives slices or row partitions. Two real servers; the second is stopped after its slices
went to the first."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.job import JobConfig
from pshard.common.rpc.serving import ServerThread
from pshard.common.sparse import TableConfig
from pshard.ps_server.settings import ServerSettings

from bench.common import ServerProcess, start_ps_servers, stop_processes

T = TypeVar("T")

TIMEOUT_S = 20.0  # without serving_only the call waits this long for the stopped server, then fails


def test_the_stats_of_serving_servers_skip_one_that_serves_nothing_and_is_gone(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    servers = [start_server(ServerSettings(static_quorum={"w0": 0})) for _ in range(2)]
    specs = [ParamSpec("a", "float32", (256,)), ParamSpec("b", "float32", (256,))]
    layout = plan_layout(specs, [s.address for s in servers], slice_bytes=1024, replicas=1)
    moved, _ = fail_over(layout, 1, {0})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    assert layout.slices_on(1) and not moved.slices_on(1) and not moved.partitions_on(1)
    client = new_client(servers, "w0", layout=moved, timeout_s=TIMEOUT_S, transport="grpc")
    client.declare({s.key: np.zeros(s.shape, np.float32) for s in specs}, JobConfig(mode="sync"))
    client.push_pull({s.key: np.ones(s.shape, np.float32) for s in specs}, 0)
    servers[1].stop()
    stats = client.stats(serving_only=True)
    assert len(stats) == 1 and stats[0].worker_clocks["w0"] == 0
    assert stats[0].slices == len(moved.slices)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    """Two real server processes, each with its own checkpoint directory."""
    procs: list[ServerProcess] = []
    try:
        for i in range(2):
            (tmp_path / str(i)).mkdir()
            procs += start_ps_servers(1, ["w0"], extra=["--checkpoint-dir", str(tmp_path / str(i))])
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, signal.SIGCONT)
        stop_processes([p.proc for p in procs])


def test_a_serving_server_that_falls_silent_is_asked_no_longer_than_the_dead_peer_time(
        servers: list[ServerProcess], new_client: Callable[..., PSClient]) -> None:
    """Issue 24, seen on the multi-host bed: a server's host was cut off right after the job's last step,
    so the chief, whose steps never failed, still routed by the layout that gave that server slices; its
    wait for its peers asked the silent server for its stats and waited out the step timeout (45 s on the
    bed) before its final pull. A silent server (a real one, SIGSTOPped: its kernel still takes the bytes,
    like a peer behind a cut link takes none, and nothing answers) counts as gone after the dead-peer
    time, and the question goes to the failed-over layout. The same for every admin call that went to
    all servers with the client's layout: a checkpoint (it asked each with wait_for_ready), a table's
    stats, export or checkpoint. Each is asked by the stale layout again."""
    addresses = [p.address for p in servers]
    specs = [ParamSpec("a", "float32", (256,)), ParamSpec("b", "float32", (256,))]
    layout = plan_layout(specs, addresses, slice_bytes=1024, replicas=1)
    moved, _ = fail_over(layout, 1, {0})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    published: list[Layout] = []

    def relayout(current: Layout, timeout_s: float) -> Layout | None:  # the scheduler's failover
        published.append(moved)
        return moved if moved.version > current.version else None

    client = new_client(addresses, "w0", layout=layout, relayout=relayout, timeout_s=TIMEOUT_S,
                        transport="grpc", dead_after_s=1.0)
    client.declare({s.key: np.zeros(s.shape, np.float32) for s in specs}, JobConfig(mode="sync"))
    client.declare_table(TableConfig("t", dim=4))
    client.push_pull({s.key: np.ones(s.shape, np.float32) for s in specs}, 0)
    os.kill(servers[1].proc.pid, signal.SIGSTOP)

    def quickly(call: Callable[[], T]) -> T:
        client.layout = layout  # the chief's steps all went through: it never saw the failover
        published.clear()
        started = time.monotonic()
        result = call()
        took = time.monotonic() - started
        assert took < TIMEOUT_S / 2, f"{call} waited {took:.1f} s for the silent server"
        assert published and client.layout is not None and client.layout.version == moved.version
        return result

    stats = quickly(lambda: client.stats(serving_only=True))
    assert len(stats) == 1 and stats[0].worker_clocks["w0"] == 0
    paths = quickly(client.checkpoint)  # the first server holds every slice now
    assert len(paths) == 1 and Path(paths[0]).exists()
    assert len(quickly(lambda: client.tables.stats("t"))) == 1
