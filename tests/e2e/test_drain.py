"""`pshard ps --drain-on-term` (issue 20): a server asked to stop hands what it serves to its backup
first, leaves the job, and exits 0; nothing is lost or applied twice: a sync table's rows are exact,
an async table's rows are minus the sum of every acknowledged push, and a dense sync job drained
mid-training ends bit-identical to an undisturbed run with the same seed.

Real processes: a scheduler planning 4 row partitions per server, three servers with `--replicas 1`,
ps-1 started with `--drain-on-term`; two workers train a sync sparse table (SGD at lr 1, zero rows,
integer gradients, whose means over two workers are exact in float32). Worker 0 pushes clock K, then
ps-1 gets SIGTERM before worker 1 pushed K: that clock is pending there, unreplicated. ps-1 asks the
scheduler to hand its four partitions to its in-sync backup (a planned failover, logged DRAIN, not a
death after a heartbeat timeout), exits 0, and the workers re-route and resend. The final rows must be
minus the sum over clocks of the workers' mean gradients, exactly.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from pshard.common.cluster.view import NodeState
from pshard.common.errors import PSError
from pshard.common.sparse import TableConfig

from pshard.status import fetch
from tests.e2e.harness import SYNC, TIMEOUTS, LocalCluster, Proc, Procs, wait_healthy, wait_until
from tests.e2e.test_table_replication_async import job_cluster, replicated_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # each wait bounded by RUN_TIMEOUT_S

WORKERS = 2
CLOCKS = 10
DRAIN_AT = 4  # the clock worker 0 pushed, and worker 1 not yet, when ps-1 is told to stop
DIM = 8
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros", mode="sync")
IDS = np.arange(0, 3000, 3, dtype=np.int64)
RUN_TIMEOUT_S = 120.0
ASYNC_TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros")
ASYNC_CLIENTS = 4
ASYNC_PUSHES = 40  # per client
ASYNC_DRAIN_AFTER = 60  # acknowledged pushes in all, before the SIGTERM
# Digits' 1437 training images in union batches of 2 x 32: 23 clocks an epoch (tests/e2e/test_elastic.py).
# Three epochs, so that the workers are still training when they are paused at DENSE_DRAIN_AT steps (one
# epoch took 0.4 s, and a CI run once saw it end before the drain).
DENSE_RUN = ("--epochs", "3", "--batch-size", "32", "--threads", "1")
DENSE_CLOCKS = 3 * 23
DENSE_DRAIN_AT = 8  # worker 0's steps logged when the workers are paused and ps-1 gets SIGTERM


def _batch(worker: int, clock: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([worker, clock, 7])
    ids = rng.choice(IDS, size=300)  # repeats: the client sums them
    return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)


@pytest.mark.parametrize("trigger", ["sigterm", "pshard drain"])
def test_a_drained_server_hands_its_partitions_over_and_exits_0(procs: Procs, trigger: str) -> None:
    """Drained by a SIGTERM to a server started with --drain-on-term, or by an operator's `pshard drain`."""
    args = ("--drain-on-term",) if trigger == "sigterm" else ()
    started, scheds, layout, clients = replicated_job(procs, WORKERS, 4, ps_args={1: args})
    scheduler, drained = started[0], started[2]  # started: scheduler, ps-0, ps-1, ps-2
    pushed, stopping = threading.Event(), threading.Event()

    def run(w: int) -> None:
        clients[w].declare_table(TABLE)
        for clock in range(CLOCKS):
            if clock == DRAIN_AT and w == 1:
                assert stopping.wait(RUN_TIMEOUT_S)
            clients[w].push_rows(TABLE.name, *_batch(w, clock), clock=clock)
            if clock == DRAIN_AT and w == 0:
                pushed.set()
            clients[w].pull_rows(TABLE.name, IDS, clock=clock + 1)

    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = [pool.submit(run, w) for w in range(WORKERS)]
            assert pushed.wait(RUN_TIMEOUT_S), [f.exception() for f in futures if f.done()]
            if trigger == "sigterm":
                drained.signal_group(signal.SIGTERM)
            else:
                operator = procs.python("drain", "-m", "pshard", "drain", "--scheduler", scheds[0].address,
                                        "ps-1", "--insecure", "--timeout-s", "60")
                assert operator.wait(RUN_TIMEOUT_S) == 0, operator.output()
                assert any("ps-1" in line and "drained" in line for line in operator.lines)
            stopping.set()
            assert drained.wait(RUN_TIMEOUT_S) == 0, drained.output()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        expected = np.zeros((len(IDS), DIM), np.float64)
        for clock in range(CLOCKS):
            for w in range(WORKERS):
                ids, grads = _batch(w, clock)
                np.add.at(expected, np.searchsorted(IDS, ids), grads / WORKERS)
        final = clients[0].pull_rows(TABLE.name, IDS, clock=CLOCKS)
        np.testing.assert_array_equal(final, (-expected).astype(np.float32))
        after = scheds[0].get_layout(timeout_s=5.0)
        assert after.partitions_on(1) == () and set(after.partitions_on(2)) >= set(layout.partitions_on(1))
        (drain,) = fetch(scheds[0].address, 10.0).drains  # what `pshard status` shows
        assert drain.done and drain.node_id == "ps-1" and drain.seconds >= 0
        assert (drain.address, drain.heir, drain.partitions, drain.layout_version) == (
            layout.servers[1], layout.servers[2], layout.partitions_on(1), after.version)
        assert any("DRAINED" in line for line in drained.lines), drained.output()
        wait_until(lambda: any("DRAIN: server 1" in line for line in scheduler.lines), 10.0,
                   "the scheduler's DRAIN line")
        assert not any("FAILOVER" in line for line in scheduler.lines)  # planned, not a death
        view = scheds[0].view
        assert view is not None
        assert [n.state for n in view.nodes if n.address == layout.servers[1]] == [NodeState.LEFT]
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()


def _start_dense(procs: Procs, name: str, num_ps: int, *ps_args: str,
                 drain_on_term: int | None = None) -> tuple[LocalCluster, list[Proc]]:
    """The scheduler and servers (awaited later) of a sync MLP job on digits, in its own directory.
    Heartbeats outlast the pause of the workers while ps-1 drains: a paused worker must not be declared
    dead meanwhile (that would change the union batches and the result)."""
    cluster = LocalCluster(procs, num_ps=num_ps, workdir=procs.tmp_path / name, prefix=f"{name}-",
                           heartbeat_timeout_ms=60_000)
    started = [cluster.start_scheduler(), *(
        cluster.start_ps(i, *ps_args, *(("--drain-on-term",) if i == drain_on_term else ()))
        for i in range(num_ps))]
    return cluster, started


def _trained(cluster: LocalCluster, workers: list[Proc]) -> dict[str, torch.Tensor]:
    for w in workers:
        assert w.wait(RUN_TIMEOUT_S) == 0, w.output()
    state: dict[str, torch.Tensor] = torch.load(cluster.model_path, weights_only=True)["state_dict"]
    return state


def test_a_dense_sync_job_drained_mid_training_ends_bit_identical_to_an_undisturbed_one(procs: Procs) -> None:
    """Two workers train a sync MLP on digits over three replicated servers; ps-1 (started with
    --drain-on-term) gets SIGTERM once worker 0 logged DENSE_DRAIN_AT steps. Beside it, in the same
    time, the undisturbed reference trains with the same seed on one server without replicas: sync
    training averages and updates each element alone, so its result does not depend on how the
    parameters are sliced over servers, and the drained run must end bit for bit where it ends."""
    reference, reference_started = _start_dense(procs, "reference", 1)
    cluster, started = _start_dense(procs, "drained", 3, "--replicas", "1", drain_on_term=1)
    for c, procs_of in ((reference, reference_started), (cluster, started)):
        for task, proc in zip(c.plan.servers, procs_of, strict=True):
            wait_healthy(task.address, proc=proc)
    reference_workers = [reference.start_worker(i, *SYNC, *DENSE_RUN, *TIMEOUTS) for i in (0, 1)]
    workers = [cluster.start_worker(i, *SYNC, *DENSE_RUN, *TIMEOUTS, "--replicas", "1") for i in (0, 1)]
    scheduler, ps1 = started[0], started[2]
    wait_until(lambda: cluster.steps_logged("worker-0") >= DENSE_DRAIN_AT, RUN_TIMEOUT_S,
               f"worker-0 to log {DENSE_DRAIN_AT} steps")
    # The workers are paused mid-training (each may be inside a step), so that the drain happens in the
    # middle of the job however fast or slow the machine is; they go on once ps-1 has left.
    for w in workers:
        w.signal_group(signal.SIGSTOP)
    try:
        paused_at = cluster.steps_logged("worker-0")
        assert paused_at < DENSE_CLOCKS - 5, f"nearly over before the drain:\n{workers[0].output()}"
        backup_line = f"is an in-sync backup of {cluster.plan.ps[1]}"
        wait_until(lambda: any(backup_line in line for line in scheduler.lines), RUN_TIMEOUT_S,
                   "the scheduler counting ps-1's backup in sync")
        ps1.signal_group(signal.SIGTERM)
        assert ps1.wait(RUN_TIMEOUT_S) == 0, ps1.output()
    finally:
        for w in workers:
            w.signal_group(signal.SIGCONT)
    got = _trained(cluster, workers)
    assert any("DRAIN: server 1" in line for line in scheduler.lines), scheduler.output()
    assert not any("FAILOVER: server" in line for line in scheduler.lines)
    expected = _trained(reference, reference_workers)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key}: the drained run differs from the undisturbed one"


def test_async_table_clients_lose_no_acknowledged_update_while_a_server_drains(procs: Procs) -> None:
    """Conservation: four clients push integer gradients to an async table while ps-1 drains on SIGTERM;
    the final rows are minus the sum of every acknowledged push, exactly (none lost, none twice)."""
    started, scheds, layout, clients = replicated_job(procs, ASYNC_CLIENTS, 4,
                                                      ps_args={1: ("--drain-on-term",)})
    acked = np.zeros((len(IDS), DIM), np.float64)
    lock = threading.Lock()
    count = [0]

    def run(i: int) -> None:
        clients[i].declare_table(ASYNC_TABLE)
        for push in range(ASYNC_PUSHES):
            ids, grads = _batch(i, push)
            clients[i].push_rows(ASYNC_TABLE.name, ids, grads)  # returns once acknowledged
            with lock:
                np.add.at(acked, np.searchsorted(IDS, ids), grads)
                count[0] += 1

    try:
        with ThreadPoolExecutor(ASYNC_CLIENTS) as pool:
            futures = [pool.submit(run, i) for i in range(ASYNC_CLIENTS)]
            wait_until(lambda: count[0] >= ASYNC_DRAIN_AFTER or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       f"{ASYNC_DRAIN_AFTER} acknowledged pushes")
            started[2].signal_group(signal.SIGTERM)  # started: scheduler, ps-0, ps-1, ps-2
            assert started[2].wait(RUN_TIMEOUT_S) == 0, started[2].output()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        assert count[0] == ASYNC_CLIENTS * ASYNC_PUSHES
        final = clients[0].pull_rows(ASYNC_TABLE.name, IDS)
        np.testing.assert_array_equal(final, -acked.astype(np.float32))
        after = scheds[0].get_layout(timeout_s=5.0)
        assert after.partitions_on(1) == () and after.version > layout.version
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()


def test_a_drain_whose_scheduler_is_sigkilled_completes_once_it_restarts(procs: Procs) -> None:
    """A SIGKILL of the scheduler mid-drain (issue 20, item 4): ps-1 is told to stop while no scheduler
    answers; it keeps serving and asking, registers again with the scheduler restarted at the same
    address, whose refusal holds it until worker-0 has given the layout back (as a worker session does
    when it registers again), and is then handed over as usual: it exits 0, and an async table's rows
    are minus the sum of every acknowledged push, pushed before, during and after the outage."""
    cluster = job_cluster(procs, ASYNC_CLIENTS, 4)
    started, scheds, layout, clients = replicated_job(procs, ASYNC_CLIENTS, 4, cluster=cluster,
                                                      ps_args={1: ("--drain-on-term",)})
    scheduler, ps1 = started[0], started[2]  # started: scheduler, ps-0, ps-1, ps-2
    half = ASYNC_PUSHES // 2
    acked = np.zeros((len(IDS), DIM), np.float64)
    lock = threading.Lock()
    count = [0]
    outage = threading.Event()

    def run(i: int) -> None:
        clients[i].declare_table(ASYNC_TABLE)
        for push in range(ASYNC_PUSHES):
            if push == half:
                assert outage.wait(RUN_TIMEOUT_S)
            ids, grads = _batch(i, push)
            clients[i].push_rows(ASYNC_TABLE.name, ids, grads)  # returns once acknowledged
            with lock:
                np.add.at(acked, np.searchsorted(IDS, ids), grads)
                count[0] += 1

    def give_layout_back() -> bool:
        try:
            scheds[0].restore_layout(layout)
        except PSError:  # not registered again yet, or the servers have not said what they route by
            return False
        return True

    try:
        with ThreadPoolExecutor(ASYNC_CLIENTS) as pool:
            futures = [pool.submit(run, i) for i in range(ASYNC_CLIENTS)]
            wait_until(lambda: count[0] >= ASYNC_CLIENTS * half or any(f.done() for f in futures),
                       RUN_TIMEOUT_S, "the first half of the pushes")
            backup_line = f"is an in-sync backup of {layout.servers[1]}"
            wait_until(lambda: any(backup_line in line for line in scheduler.lines), RUN_TIMEOUT_S,
                       "the scheduler counting ps-1's backup in sync")
            scheduler.signal_group(signal.SIGKILL)
            scheduler.wait(RUN_TIMEOUT_S)
            ps1.signal_group(signal.SIGTERM)
            ps1.wait_for_line(r"DRAIN: the scheduler is unreachable", RUN_TIMEOUT_S)
            outage.set()  # the second half pushes through the outage and the hand-over
            restarted = procs.start("scheduler-restarted", scheduler.argv,
                                    tf_config=cluster.plan.tf_config(cluster.task("scheduler")))
            restarted.wait_for_line(r"registered ps-1 ", RUN_TIMEOUT_S)
            assert ps1.alive(), ps1.output()  # refused while the restarted scheduler has no layout
            wait_until(give_layout_back, RUN_TIMEOUT_S, "worker-0 giving the layout back")
            assert ps1.wait(RUN_TIMEOUT_S) == 0, ps1.output()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        assert count[0] == ASYNC_CLIENTS * ASYNC_PUSHES
        final = clients[0].pull_rows(ASYNC_TABLE.name, IDS)
        np.testing.assert_array_equal(final, -acked.astype(np.float32))
        after = scheds[0].get_layout(timeout_s=5.0)
        assert after.partitions_on(1) == () and after.version > layout.version
        assert any("DRAIN: server 1" in line for line in restarted.lines), restarted.output()
        assert not any("FAILOVER" in line for line in restarted.lines), restarted.output()
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
