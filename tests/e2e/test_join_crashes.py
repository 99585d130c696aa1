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
from pshard.common.failpoints import ENV as FAILPOINTS

from pshard.status import JoinReport, fetch
from tests.e2e.harness import SYNC, TIMEOUTS, LocalCluster, Proc, Procs, free_port, wait_healthy, wait_until
from tests.e2e.test_drain import DENSE_CLOCKS, DENSE_RUN, RUN_TIMEOUT_S, _start_dense, _trained

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # each wait bounded by RUN_TIMEOUT_S

JOIN_AT = 8  # worker 0's steps logged when the workers are paused and the third server started
PAUSED_COPY = r"failpoint ps\.before_replica_apply: paused"
STATUS_TIMEOUT_S = 3.0  # per call of `pshard status` while the joiner is held (the scheduler answers in ms)


def _start_jobs(procs: Procs) -> tuple[LocalCluster, list[Proc], list[Proc], LocalCluster, list[Proc]]:
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


def _start_joiner(procs: Procs, cluster: LocalCluster, address: str, name: str, *, paused: bool) -> Proc:
    """ps-2 for the running job; `paused`: held by the failpoint before it applies its first copy."""
    return procs.python(name, "-m", "pshard.ps_server", "--task-type", "ps", "--task-index", "2",
                        "--ps", ",".join([*cluster.plan.ps, address]), "--bind", address,
                        "--scheduler", cluster.task("scheduler").address, "--replicas", "1",
                        env={FAILPOINTS: "ps.before_replica_apply=pause-once"} if paused else None)


def _catching_up(scheduler_address: str, address: str) -> JoinReport:
    """The join `pshard status` shows in progress once its donor reported the copy it has left (with its
    heartbeats' load, about every second): more than nothing, while the joiner holds it unapplied. The
    joiner's own stats may not answer meanwhile (a copy in shared memory is applied on its event loop,
    which the failpoint holds): `pshard status` gives each server STATUS_TIMEOUT_S, not its default 10 s."""
    def copying() -> JoinReport | None:
        joins = [j for j in fetch(scheduler_address, STATUS_TIMEOUT_S).joins
                 if j.address == address and not j.rolled_back]
        assert len(joins) == 1 and not joins[0].done, joins
        return joins[0] if joins[0].bytes_left > 0 else None
    report = wait_until(copying, RUN_TIMEOUT_S, f"the scheduler showing {address}'s copy under way")
    assert report is not None
    return report


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
    reference, reference_workers, started, cluster, workers = _start_jobs(procs)
    scheduler, scheduler_address = started[0], cluster.task("scheduler").address
    address = f"127.0.0.1:{free_port()}"
    try:
        # 1. The joiner SIGKILLed while its donor's copy is on its way: nothing moved.
        joiner = _start_joiner(procs, cluster, address, "grown-ps-2", paused=True)
        joiner.wait_for_line(PAUSED_COPY, RUN_TIMEOUT_S)  # the donor's copy reached it, not applied
        assert _catching_up(scheduler_address, address).donor == cluster.plan.ps[1]
        joiner.signal_group(signal.SIGKILL)
        joiner.wait(RUN_TIMEOUT_S)
        # A new process of it registers: the old join is rolled back at once, this one catches up.
        again = _start_joiner(procs, cluster, address, "grown-ps-2-again", paused=True)
        again.wait_for_line(PAUSED_COPY, RUN_TIMEOUT_S)
        _catching_up(scheduler_address, address)
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
    (join,) = fetch(scheduler_address, 10.0).joins
    assert (join.address, join.donor, join.done) == (address, cluster.plan.ps[1], True)
    assert join.slices > 0 and join.layout_version > 0
    _assert_bit_identical(reference, reference_workers, cluster, workers)
    for s in (scheduler, restarted):
        assert not any("FAILOVER" in line for line in s.lines), s.output()
