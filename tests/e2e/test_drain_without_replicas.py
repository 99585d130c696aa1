"""`pshard drain` of a server in a job WITHOUT replicas (issue 20): nothing holds a copy of what it serves,
so the scheduler first has it copy its slices to the servers `plan_drain` spreads them over (a targeted
catch-up copy: their states, then every step), switches them all under one layout version once every
target holds its copy, and only then lets the server leave; it exits 0, and a sync job ends bit-identical
to an undisturbed run with the same seed.

Real processes: a scheduler, three servers without replicas, two workers training a sync MLP on digits.
The workers are paused while the operator's drain starts (so that it lands mid-training however fast the
machine is). The targets hold the copy's first batch at a failpoint while the workers go on: no switch may
happen then (a drain that skipped the catch-up switches to targets holding nothing, and the workers'
steps fail there), and no step may wait for a target still catching up. Once the copies go on, the drain
switches, and the steps that reach ps-1 after the switch are refused there and re-routed.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch
from pshard.common.failpoints import ENV as FAILPOINTS

from tests.e2e.harness import SYNC, TIMEOUTS, LocalCluster, Procs, wait_healthy, wait_until
from tests.e2e.test_drain import (
    DENSE_CLOCKS,
    DENSE_DRAIN_AT,
    DENSE_RUN,
    RUN_TIMEOUT_S,
    _start_dense,
    _trained,
)
from tests.e2e.test_join import PAUSED_COPY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # each wait bounded by RUN_TIMEOUT_S
STEPS_WHILE_COPYING = 3  # worker 0's steps logged while the targets hold their copies back


def test_a_dense_sync_job_without_replicas_drained_mid_training_ends_bit_identical(procs: Procs) -> None:
    reference, reference_started = _start_dense(procs, "reference", 1)
    cluster = LocalCluster(procs, num_ps=3, workdir=procs.tmp_path / "drained", prefix="drained-",
                           heartbeat_timeout_ms=60_000)
    held = {FAILPOINTS: "ps.before_replica_apply=pause-once"}  # the targets: only a drain copies to them
    started = [cluster.start_scheduler(),
               *(cluster.start_ps(i, env=None if i == 1 else held) for i in range(3))]
    for c, procs_of in ((reference, reference_started), (cluster, started)):
        for task, proc in zip(c.plan.servers, procs_of, strict=True):
            wait_healthy(task.address, proc=proc)
    reference_workers = [reference.start_worker(i, *SYNC, *DENSE_RUN, *TIMEOUTS) for i in (0, 1)]
    workers = [cluster.start_worker(i, *SYNC, *DENSE_RUN, *TIMEOUTS) for i in (0, 1)]
    scheduler, ps1, targets = started[0], started[2], (started[1], started[3])
    wait_until(lambda: cluster.steps_logged("worker-0") >= DENSE_DRAIN_AT, RUN_TIMEOUT_S,
               f"worker-0 to log {DENSE_DRAIN_AT} steps")
    for w in workers:
        w.signal_group(signal.SIGSTOP)
    try:
        paused_at = cluster.steps_logged("worker-0")
        assert paused_at < DENSE_CLOCKS - 2 * STEPS_WHILE_COPYING, f"nearly over:\n{workers[0].output()}"
        sched = cluster.task("scheduler").address
        operator = procs.python("drain", "-m", "pshard", "drain", "--scheduler", sched, "ps-1", "--insecure",
                                "--timeout-s", "60")
        wait_until(lambda: any(re.search(PAUSED_COPY, line) for p in targets for line in p.lines),
                   RUN_TIMEOUT_S, "a target to hold the drain's copy back")
    finally:
        for w in workers:
            w.signal_group(signal.SIGCONT)
    wait_until(lambda: cluster.steps_logged("worker-0") >= paused_at + STEPS_WHILE_COPYING, RUN_TIMEOUT_S,
               "the workers to step on while the copy is held (a target catching up stalls no step)")
    assert not any("DRAIN: server 1" in line for line in scheduler.lines), scheduler.output()  # it waits
    assert operator.alive()
    for target in targets:
        target.signal_group(signal.SIGUSR1)  # the copies go on
    assert operator.wait(RUN_TIMEOUT_S) == 0, operator.output()
    assert ps1.wait(RUN_TIMEOUT_S) == 0, ps1.output()
    got = _trained(cluster, workers)
    lines = scheduler.lines
    assert any("DRAIN: server 1" in line and "switched" in line for line in lines), scheduler.output()
    assert not any("ROLLED BACK" in line or "FAILOVER" in line for line in lines), scheduler.output()
    expected = _trained(reference, reference_workers)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key}: the drained run differs from the undisturbed one"
