"""A scheduled push that a global checkpoint holds counts once through a failover after the restore (issue
21, docs/architecture.md 15 Coordinator).

Real processes. A first job (one server) applies push 0 of a scheduled call to dense slices and to table
rows, and takes a global checkpoint. A second job (three servers, `--replicas 1`) restores it; once the
scheduler counts ps-1's backup in sync, ps-1 is SIGKILLed and the call is re-dispatched from another
worker. Every server, the promoted backup included, must drop it: the restored records reached the
backups with the restored state. Integer gradients and SGD at lr 1 make a double apply exact to see.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.sparse import TableConfig
from pshard.worker import checkpoint_coordinator as checkpoints

from tests.e2e.harness import LocalCluster, Proc, Procs, wait_until
from tests.e2e.test_replication_async import _newer_layout
from tests.e2e.test_replication_scheduled import CALL, JOB, SHAPES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TABLE = TableConfig("emb", 4, initializer="zeros", lr=1.0)
IDS = np.arange(1, 61, dtype=np.int64)


def _job(procs: Procs, name: str, num_ps: int, root: Path, *flags: str
         ) -> tuple[list[Proc], list[SchedulerClient], list[PSClient], list[str]]:
    """A scheduler and `num_ps` servers started with `flags` (their processes, the scheduler first), and a
    connected client per worker."""
    cluster = LocalCluster(procs, num_ps=num_ps, num_workers=2, workdir=procs.tmp_path / name,
                           prefix=f"{name}-")
    started = cluster.start_servers("--global-checkpoint-dir", str(root), *flags)
    ps = [cluster.task(f"ps-{i}").address for i in range(num_ps)]
    scheds = [SchedulerClient(cluster.plan.scheduler, "worker", node_id=f"worker-{i}", rank_hint=i,
                              own_address=cluster.task(f"worker-{i}").address, connect_timeout_s=30.0)
              for i in range(2)]
    for s in scheds:
        s.register()
    replicas = 1 if "--replicas" in flags else 0
    layout = scheds[0].propose_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()],
                                      slice_bytes=1024, servers=ps, replicas=replicas)
    clients = [PSClient(ps, f"worker-{i}", layout=layout, generation=lambda s=scheds[i]: s.generation,
                        timeout_s=60.0, relayout=_newer_layout(scheds[i]), reroute_wait_s=10.0)
               for i in range(2)]
    return started, scheds, clients, ps


def _close(scheds: list[SchedulerClient], clients: list[PSClient]) -> None:
    for c in clients:
        c.close()
    for s in scheds:
        s.close()


def test_a_restored_scheduled_push_is_dropped_by_the_backup_promoted_after_the_restore(procs: Procs) -> None:
    root = procs.tmp_path / "global"
    root.mkdir()
    initial = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    grads = {k: np.random.default_rng(3).integers(-3, 4, size=s).astype(np.float32)
             for k, s in SHAPES.items()}
    rows = np.random.default_rng(4).integers(-3, 4, size=(len(IDS), TABLE.dim)).astype(np.float32)

    _, scheds, clients, _ = _job(procs, "first", 1, root)
    try:
        clients[0].declare(initial, JOB, slice_bytes=1024)
        tables = clients[0].tables
        tables.declare(TABLE)
        clients[0].scheduled = CALL
        clients[0].wait(clients[0].push(grads, 0))
        assert tables.push("emb", IDS, rows) == len(IDS)
        clients[0].scheduled = (0, 0, 0)
        checkpoints.save(clients[0], root, 1)  # the call still running: its record is in the checkpoint
    finally:
        _close(scheds, clients)

    started, scheds, clients, ps = _job(procs, "second", 3, root, "--replicas", "1")
    try:
        assert checkpoints.restore(clients[0], root, JOB) == 1
        for c in clients:
            c.declare(initial, JOB, slice_bytes=1024)  # the restored model stays
        tables = [c.tables for c in clients]
        for t in tables:
            t.declare(TABLE)
        layout = clients[0].layout
        assert layout is not None and layout.replicas == 1 and layout.slices_on(1)
        # Worker 1 has reached every server before (as a serving worker has): its first call after the kill
        # would negotiate a fast path with the dead server, and wait out that call's deadline.
        clients[1].pull(0)
        in_sync = f"is an in-sync backup of {ps[1]}"
        wait_until(lambda: any(in_sync in line for line in started[0].lines), 60.0,
                   f"the scheduler counting a backup of ps-1 ({ps[1]}) in sync")
        os.kill(started[2].pid, signal.SIGKILL)  # started: scheduler, ps-0, ps-1, ps-2
        clients[1].scheduled = CALL  # the call re-dispatched to worker 1
        again = clients[1].wait(clients[1].push(grads, 0))  # re-routed once the scheduler fails ps-1 over
        assert scheds[1].get_layout(timeout_s=5.0).version > layout.version, "no failover happened"
        assert (again.applied, again.dropped) == (0, len(layout.slices))
        assert tables[1].push("emb", IDS, rows) == 0
        clients[1].scheduled = (0, 0, 0)
        for key, value in clients[1].pull(0).items():
            np.testing.assert_array_equal(value, initial[key] - grads[key], err_msg=key)
        np.testing.assert_array_equal(tables[1].pull("emb", IDS), -rows)
    finally:
        _close(scheds, clients)
