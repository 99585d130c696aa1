"""A `pshard ps` started for a running job joins it (issue 20, item 1): it registers with the job's
scheduler, becomes the backup of the server before it in ring order and catches up with it through the
replication path (a state copy, then every acknowledged step), and once that server reports it in sync
the scheduler moves the slices plan_join picks onto it under a new layout version (logged JOIN); workers
re-route as after a failover, and connect to the server they had never heard of; the moved slices get a
backup again (server 0, after the new one in ring order).

A dense sync job grown 2 -> 3 servers mid-training ends bit-identical to an undisturbed run with the same
seed (one server: see tests/e2e/test_drain.py for why). As there, the workers are paused (SIGSTOP) once
worker 0 logged JOIN_AT steps, so that the join happens mid-training however fast or slow the machine is,
and go on (SIGCONT) once the layout switched; heartbeats of 60 s outlast the pause.
"""

from __future__ import annotations

import signal

import pytest
import torch

from pshard.status import fetch
from tests.e2e.harness import SYNC, TIMEOUTS, LocalCluster, Proc, Procs, free_port, wait_healthy, wait_until
from tests.e2e.test_drain import DENSE_CLOCKS, DENSE_RUN, RUN_TIMEOUT_S, _start_dense, _trained

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # each wait bounded by RUN_TIMEOUT_S

JOIN_AT = 8  # worker 0's steps logged when the workers are paused and the third server started


def start_jobs(procs: Procs) -> tuple[LocalCluster, list[Proc], list[Proc], LocalCluster, list[Proc]]:
    """The undisturbed reference (one server) and the job to grow (two, replicated), training; the grown
    job's workers paused once worker 0 logged JOIN_AT steps. Returns the reference's workers too."""
    reference, reference_started = _start_dense(procs, "reference", 1)
    cluster, started = _start_dense(procs, "grown", 2, "--replicas", "1")
    for c, procs_of in ((reference, reference_started), (cluster, started)):
        for task, proc in zip(c.plan.servers, procs_of, strict=True):
            wait_healthy(task.address, proc=proc)
    reference_workers = [reference.start_worker(i, *SYNC, *DENSE_RUN, *TIMEOUTS) for i in (0, 1)]
    workers = [cluster.start_worker(i, *SYNC, *DENSE_RUN, *TIMEOUTS, "--replicas", "1") for i in (0, 1)]
    wait_until(lambda: cluster.steps_logged("worker-0") >= JOIN_AT, RUN_TIMEOUT_S,
               f"worker-0 to log {JOIN_AT} steps")
    for w in workers:
        w.signal_group(signal.SIGSTOP)
    assert cluster.steps_logged("worker-0") < DENSE_CLOCKS - 5, workers[0].output()  # not nearly over
    return reference, reference_workers, started, cluster, workers


def test_a_dense_sync_job_grown_mid_training_ends_bit_identical_to_an_undisturbed_one(procs) -> None:
    reference, reference_workers, started, cluster, workers = start_jobs(procs)
    scheduler = started[0]
    scheduler_address = cluster.task("scheduler").address
    address = f"127.0.0.1:{free_port()}"
    try:
        joiner = procs.python("grown-ps-2", "-m", "pshard.ps_server", "--task-type", "ps",
                              "--task-index", "2", "--ps", ",".join([*cluster.plan.ps, address]),
                              "--bind", address, "--scheduler", scheduler_address, "--replicas", "1")
        joined = f"JOIN: server 2 ({address}) took"
        wait_until(lambda: not joiner.alive() or any(joined in line for line in scheduler.lines),
                   RUN_TIMEOUT_S, "the scheduler moving slices onto the new server")
        assert joiner.alive(), joiner.output()
    finally:
        for w in workers:
            w.signal_group(signal.SIGCONT)
    (join,) = fetch(scheduler_address, 10.0).joins  # what `pshard status` shows
    assert (join.address, join.donor, join.done) == (address, cluster.plan.ps[1], True)
    assert join.slices > 0 and join.nbytes > 0 and join.seconds > 0
    got = _trained(cluster, workers)
    assert joiner.alive(), joiner.output()
    assert not any("FAILOVER: server" in line for line in scheduler.lines), scheduler.output()
    expected = _trained(reference, reference_workers)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), (
            f"{key}: the grown run differs from the undisturbed one by {(got[key] - value).abs().max()}")
    assert any(f"server {address} joined the layout" in line for line in workers[0].lines), (
        workers[0].output())
    # The moved slices have a backup again: the server after the new one in ring order holds them in sync.
    backup_line = f"{cluster.plan.ps[0]} is an in-sync backup of {address}"
    wait_until(lambda: any(backup_line in line for line in scheduler.lines), RUN_TIMEOUT_S,
               "the new server's slices counted in sync on its backup")
