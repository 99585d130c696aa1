"""A coordinator's call re-dispatched after its primary was SIGKILLed counts once (issue 21,
docs/architecture.md 15 Coordinator).

Real processes: a scheduler and three servers with `--replicas 1`. Worker 0 runs a scheduled call whose
push (integer gradients, SGD at lr 1) is acknowledged, so every backup holds it; then the server holding
some of the slices is SIGKILLed before the call's result reached the coordinator, which runs it again on
worker 1 with the same schedule id. The backup promoted in its place must drop the repeat as the primary
would, so the weights are the initial ones minus the gradients once, exactly.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.job import JobConfig, OptimizerConfig

from tests.e2e.harness import LocalCluster, Procs, wait_until
from tests.e2e.test_replication_async import _newer_layout

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SHAPES = {"a": (2000,), "b": (700,), "c": (50,)}
JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
CALL = ((1 << 32) + 5, 0, 1 << 32)  # (schedule id, push number, floor), as the serving worker stamps them


def test_a_scheduled_call_re_dispatched_after_its_primary_was_sigkilled_counts_once(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=3, num_workers=2)
    started = cluster.start_servers("--replicas", "1")
    ps = [cluster.task(f"ps-{i}").address for i in range(3)]
    scheds = [SchedulerClient(cluster.plan.scheduler, "worker", node_id=f"worker-{i}", rank_hint=i,
                              own_address=cluster.task(f"worker-{i}").address, connect_timeout_s=30.0)
              for i in range(2)]
    for s in scheds:
        s.register()
    layout = scheds[0].propose_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()],
                                      slice_bytes=1024, servers=ps, replicas=1)
    assert layout.replicas == 1 and layout.slices_on(1)
    clients = [PSClient(ps, f"worker-{i}", layout=layout, generation=lambda s=scheds[i]: s.generation,
                        timeout_s=60.0, relayout=_newer_layout(scheds[i]), reroute_wait_s=10.0)
               for i in range(2)]
    try:
        initial = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        for c in clients:
            c.declare(initial, JOB, slice_bytes=1024)
        grads = {k: np.random.default_rng(3).integers(-3, 4, size=s).astype(np.float32)
                 for k, s in SHAPES.items()}
        clients[0].scheduled = CALL
        first = clients[0].wait(clients[0].push(grads, 0))  # acknowledged: its backups hold it
        assert (first.applied, first.dropped) == (len(layout.slices), 0)
        # Worker 1 has reached every server before (as a serving worker has): its first call after the kill
        # would negotiate a fast path with the dead server, and wait out that call's deadline (20 s).
        clients[1].pull(0)
        # Only a copy the scheduler counts in sync is promoted (a kill before that tests the refusal).
        in_sync = f"is an in-sync backup of {layout.servers[1]}"
        wait_until(lambda: any(in_sync in line for line in started[0].lines), 60.0,
                   f"the scheduler counting a backup of ps-1 ({layout.servers[1]}) in sync")
        os.kill(started[2].pid, signal.SIGKILL)  # started: scheduler, ps-0, ps-1, ps-2
        clients[1].scheduled = CALL
        again = clients[1].wait(clients[1].push(grads, 0))  # re-routed once the scheduler fails ps-1 over
        assert scheds[1].get_layout(timeout_s=5.0).version > layout.version, "no failover happened"
        assert (again.applied, again.dropped) == (0, len(layout.slices))
        final = clients[1].pull(0)
        for key, value in final.items():
            np.testing.assert_array_equal(value, initial[key] - grads[key], err_msg=key)
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
