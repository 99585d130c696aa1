"""A chief's last wait for its peers reads their clocks from the servers' stats; after a drain (issue 20)
or a failover one server of the layout serves nothing and is gone, and asking it too cost that wait its
whole deadline (30 s in the e2e drain test). `PSClient.stats(serving_only=True)` asks only the servers
the layout gives slices or row partitions. Two real servers; the second is stopped after its slices
went to the first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.job import JobConfig
from pshard.common.rpc.serving import ServerThread
from pshard.ps_server.settings import ServerSettings

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
