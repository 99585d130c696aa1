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

Meanwhile a fourth server joins, and its donor (the third, whose slices server 0 backs up) is SIGKILLed
mid-copy and started again: a join keeps the donor's old backup in sync until its switch, so the
scheduler fails the donor over to server 0 (where it used to find no in-sync copy and lose the slices),
rolls the fourth server's join back, and the job still ends bit-identical. The copy is held by a
failpoint in the fourth server (as in tests/e2e/test_join_crashes.py), so the kill lands mid-copy.
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
STATUS_TIMEOUT_S = 3.0  # per call of `pshard status` while a joiner is held (the scheduler answers in ms)


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


def start_joiner(procs: Procs, cluster: LocalCluster, servers: list[str], name: str, *,
                 paused: bool = False) -> Proc:
    """The server at the next place of `servers` (its last), for the running job; `paused`: held by the
    failpoint before it applies its first copy."""
    return procs.python(name, "-m", "pshard.ps_server", "--task-type", "ps", "--task-index",
                        str(len(servers) - 1), "--ps", ",".join(servers), "--bind", servers[-1],
                        "--scheduler", cluster.task("scheduler").address, "--replicas", "1",
                        env={FAILPOINTS: "ps.before_replica_apply=pause-once"} if paused else None)


def catching_up(scheduler_address: str, address: str) -> JoinReport:
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


def test_a_dense_sync_job_grown_mid_training_ends_bit_identical_to_an_undisturbed_one(procs) -> None:
    reference, reference_workers, started, cluster, workers = start_jobs(procs)
    scheduler = started[0]
    scheduler_address = cluster.task("scheduler").address
    address = f"127.0.0.1:{free_port()}"
    try:
        joiner = start_joiner(procs, cluster, [*cluster.plan.ps, address], "grown-ps-2")
        joined = f"JOIN: server 2 ({address}) took"
        wait_until(lambda: not joiner.alive() or any(joined in line for line in scheduler.lines),
                   RUN_TIMEOUT_S, "the scheduler moving slices onto the new server")
        assert joiner.alive(), joiner.output()
        # The moved slices have a backup again: the server after the new one in ring order holds them,
        # and only then is the join done.
        backed_up = f"JOIN: server 2 ({address}) is backed up: {cluster.plan.ps[0]} holds"
        wait_until(lambda: any(backed_up in line for line in scheduler.lines), RUN_TIMEOUT_S,
                   "the new server's slices counted in sync on its backup")
        (join,) = fetch(scheduler_address, 10.0).joins  # what `pshard status` shows
        assert (join.address, join.donor, join.done) == (address, cluster.plan.ps[1], True)
        assert join.slices > 0 and join.nbytes > 0 and join.seconds > 0
        _kill_a_donor_mid_join(procs, cluster, scheduler, joiner)
    finally:
        for w in workers:
            w.signal_group(signal.SIGCONT)
    got = _trained(cluster, workers)
    assert not any("FAILOVER IMPOSSIBLE" in line for line in scheduler.lines), scheduler.output()
    expected = _trained(reference, reference_workers)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), (
            f"{key}: the grown run differs from the undisturbed one by {(got[key] - value).abs().max()}")
    assert any(f"server {address} joined the layout" in line for line in workers[0].lines), (
        workers[0].output())


def _kill_a_donor_mid_join(procs: Procs, cluster: LocalCluster, scheduler: Proc, old: Proc) -> None:
    """Server 3 joins, copying from server 2 (`old`, the donor); server 2 is SIGKILLed mid-copy and started
    again. Its new process registering fails it over at once, to server 0, the in-sync backup it kept
    through the join, and server 3's join is rolled back (it joins again, from the new server 2)."""
    scheduler_address = cluster.task("scheduler").address
    donor = old.argv[old.argv.index("--bind") + 1]
    servers = [*cluster.plan.ps, donor, f"127.0.0.1:{free_port()}"]
    fourth = start_joiner(procs, cluster, servers, "grown-ps-3", paused=True)
    fourth.wait_for_line(PAUSED_COPY, RUN_TIMEOUT_S)  # the donor's copy reached it, not applied
    assert catching_up(scheduler_address, servers[3]).donor == donor
    old.signal_group(signal.SIGKILL)
    old.wait(RUN_TIMEOUT_S)
    start_joiner(procs, cluster, servers[:3], "grown-ps-2-again")
    failover = f"FAILOVER: server 2 ({donor}) is gone"
    wait_until(lambda: any(failover in line or "FAILOVER IMPOSSIBLE" in line for line in scheduler.lines),
               RUN_TIMEOUT_S, "the scheduler failing the donor over")
    assert any(f"{failover}; its " in line and f"now have server 0 ({cluster.plan.ps[0]})" in line
               for line in scheduler.lines), scheduler.output()
    fourth.signal_group(signal.SIGUSR1)  # its stats answer `pshard status` again
    rolled = [j for j in fetch(scheduler_address, 10.0).joins if j.address == servers[3] and j.rolled_back]
    assert [j.rolled_back for j in rolled] == [
        f"lost its donor: {donor} registered again (a new process holds nothing)"], rolled
