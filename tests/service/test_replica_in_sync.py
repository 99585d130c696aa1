"""A primary's in-sync report (ps_server/replication/in_sync.py) through real servers and channels.

Two servers, replicas 1: server 0 forwards to server 1. The report names server 1, with its
incarnation, only once server 1 acknowledged a copy of every slice the layout gives server 0; a new
incarnation of server 1 at the same address (a restart) stops counting until it is copied again.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.replication.dense import Replicator
from pshard.ps_server.replication.in_sync import InSyncReporter
from pshard.ps_server.replication.link import grpc_sender
from pshard.ps_server.settings import ServerSettings

from tests.e2e.harness import wait_until

WAIT_S = 10.0
SGD = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
SHAPES = {"a": (300,), "b": (64, 8), "c": (5,)}


def _view(addresses: list[str], generations: tuple[int, int]) -> ClusterView:
    nodes = tuple(Node(f"ps-{i}", "ps", i, a, NodeState.LIVE, g) for i, (a, g) in
                  enumerate(zip(addresses, generations, strict=True)))
    return ClusterView(max(generations), nodes, 1)


def test_a_backup_counts_once_it_holds_every_slice_and_a_restart_starts_it_over(start_server, new_client):
    servers = [start_server(ServerSettings(replicas=1, static_quorum={"w0": 0})) for _ in range(2)]
    addresses = [s.address for s in servers]
    layout = plan_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()], addresses,
                         slice_bytes=512, replicas=1)
    layout = dataclasses.replace(layout, version=1)
    primary = servers[0]
    reports: list[tuple[dict[str, int], int]] = []
    holder: list[InSyncReporter] = []

    def wire() -> None:
        replicator = Replicator(primary.address, grpc_sender(), primary.loop)
        primary.running.handlers.enable_replication(replicator)
        replicator.set_backups([addresses[1]])
        reporter = InSyncReporter(replicator, primary.address, lambda c, v: reports.append((c, v)))
        reporter.on_view(_view(addresses, (1, 2)))
        reporter.on_layout(layout)
        holder.append(reporter)

    primary.call(wire)

    def report() -> tuple[dict[str, int], int]:
        def now() -> tuple[dict[str, int], int]:
            holder[0].report()
            return reports[-1]
        return primary.call(now)

    assert report() == ({}, 1)  # nothing declared: the layout's slices are nowhere yet
    client = new_client(servers, "w0", layout=layout)
    rng = np.random.default_rng(0)
    client.declare({k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}, SGD)
    client.push_pull({k: np.ones(s, np.float32) for k, s in SHAPES.items()}, 0)
    wait_until(lambda: report() == ({addresses[1]: 2}, 1), WAIT_S, "server 1 in sync")

    # Server 1 is a new process now: out of sync at once, and in sync again (as generation 5) once
    # every slice was copied to it again.
    def restart() -> tuple[dict[str, int], int]:
        holder[0].on_view(_view(addresses, (1, 5)))
        return reports[-1]

    assert primary.call(restart) == ({}, 1)
    wait_until(lambda: report() == ({addresses[1]: 5}, 1), WAIT_S, "the new server 1 in sync")
    weights = client.push_pull({k: np.ones(s, np.float32) for k, s in SHAPES.items()}, 1)
    assert set(weights) == set(SHAPES)
