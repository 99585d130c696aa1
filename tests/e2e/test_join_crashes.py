"""A join interrupted by a crash (issue 20, item 4) either completes or rolls back to the layout in force,
never leaving a slice with no owner or two, and the job loses nothing: a dense sync job that a third
server joins mid-training ends bit-identical to an undisturbed run with the same seed, as in
tests/e2e/test_join.py, though

- the joining server is SIGKILLed during its catch-up copy: the scheduler rolls the join back (said by
  `pshard status` and a `JOIN ROLLED BACK` line) as soon as a new process of it registers, and that one
  catches up;
- then the scheduler is SIGKILLed while that one copies, and restarted: the servers register again,
  worker-0 gives the layout back, and the join goes on to its switch on the restarted scheduler.

The copy is held by a failpoint (`ps.before_replica_apply`, pshard.common.failpoints) in the joiner, just
before it applies the first batch of its donor's slices: the crash lands with the copy on its way, however
fast or slow the machine (the donor's steps do not wait for a joiner still catching up). The workers are
paused (SIGSTOP) from worker 0's JOIN_AT-th step until the crash is over, so that the join happens
mid-training; heartbeats of 60 s outlast the pause (tests/e2e/test_drain.py's _start_dense).
"""

from __future__ import annotations

import signal

import pytest
import torch

from pshard.status import fetch
from tests.e2e.harness import LocalCluster, Proc, Procs, free_port, wait_until
from tests.e2e.test_drain import RUN_TIMEOUT_S, _trained
from tests.e2e.test_join import PAUSED_COPY, catching_up, start_jobs, start_joiner

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # each wait bounded by RUN_TIMEOUT_S


def _assert_bit_identical(reference: LocalCluster, reference_workers: list[Proc], cluster: LocalCluster,
                          workers: list[Proc]) -> None:
    got = _trained(cluster, workers)
    expected = _trained(reference, reference_workers)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), (
            f"{key}: the grown run differs from the undisturbed one by {(got[key] - value).abs().max()}")


def test_a_join_survives_a_sigkill_of_the_joiner_and_then_of_the_scheduler_mid_copy(procs: Procs) -> None:
    """Both crashes in one job, one after the other (one reference run and one job to start: the e2e
    budget): the joiner is SIGKILLed mid-copy and started again, held mid-copy again, and then the
    scheduler is SIGKILLed and restarted. The first join is rolled back, the second completes on the
    restarted scheduler, and the job ends bit-identical to the undisturbed one."""
    reference, reference_workers, started, cluster, workers = start_jobs(procs)
    scheduler, scheduler_address = started[0], cluster.task("scheduler").address
    address = f"127.0.0.1:{free_port()}"
    try:
        # 1. The joiner SIGKILLed while its donor's copy is on its way: nothing moved.
        joiner = start_joiner(procs, cluster, [*cluster.plan.ps, address], "grown-ps-2", paused=True)
        joiner.wait_for_line(PAUSED_COPY, RUN_TIMEOUT_S)  # the donor's copy reached it, not applied
        assert catching_up(scheduler_address, address).donor == cluster.plan.ps[1]
        joiner.signal_group(signal.SIGKILL)
        joiner.wait(RUN_TIMEOUT_S)
        # A new process of it registers: the old join is rolled back at once, this one catches up.
        again = start_joiner(procs, cluster, [*cluster.plan.ps, address], "grown-ps-2-again", paused=True)
        again.wait_for_line(PAUSED_COPY, RUN_TIMEOUT_S)
        catching_up(scheduler_address, address)
        (rolled,) = [j for j in fetch(scheduler_address, 10.0).joins if j.rolled_back]  # `pshard status`
        assert (rolled.address, rolled.done, rolled.layout_version, rolled.rolled_back) == (
            address, False, 0, "registered again (a new process holds nothing of the copy)")
        rolled_line = f"JOIN ROLLED BACK: server 2 ({address})"
        assert any(rolled_line in line for line in scheduler.lines), scheduler.output()
        assert not any(f"JOIN: server 2 ({address}) took" in line for line in scheduler.lines)
        # 2. The scheduler SIGKILLed while the new joiner copies, and restarted at its address.
        scheduler.signal_group(signal.SIGKILL)
        scheduler.wait(RUN_TIMEOUT_S)
        restarted = procs.start("grown-scheduler-restarted", scheduler.argv,
                                tf_config=cluster.plan.tf_config(cluster.task("scheduler")))
        restarted.wait_for_line(r"registered ps-2 ", RUN_TIMEOUT_S)
        again.signal_group(signal.SIGUSR1)  # the copy goes on
    finally:
        for w in workers:  # worker-0 gives the restarted scheduler the layout back
            w.signal_group(signal.SIGCONT)
    wait_until(lambda: not again.alive() or any(f"JOIN: server 2 ({address}) took" in line
                                                for line in restarted.lines),
               RUN_TIMEOUT_S, "the restarted scheduler moving slices onto the joiner")
    assert again.alive(), again.output()
    wait_until(lambda: any(f"JOIN: server 2 ({address}) is backed up" in line for line in restarted.lines),
               RUN_TIMEOUT_S, "the joiner's backup holding what it took")
    (join,) = fetch(scheduler_address, 10.0).joins
    assert (join.address, join.donor, join.done) == (address, cluster.plan.ps[1], True)
    assert join.slices > 0 and join.layout_version > 0
    _assert_bit_identical(reference, reference_workers, cluster, workers)
    for s in (scheduler, restarted):
        assert not any("FAILOVER" in line for line in s.lines), s.output()
