"""A server joining a running job takes table row partitions (issue 20, item 1), while clients keep pushing
to an async table and training a sync one: no acknowledged update is lost or applied twice.

Real processes: a scheduler planning 4 row partitions per server, two servers with `--replicas 1`, and
two clients pushing integer gradients (SGD at lr 1, zero rows) to ids of every partition, of an async
table and, at each of their clocks, of a sync table (push, then pull at the next clock). A third
`pshard ps` started for the running job becomes ps-1's backup (the server before it in ring order),
catches up with its rows, and once ps-1 reports it in sync the scheduler switches it some of ps-1's
partitions, weighed by the bytes ps-1 reports for them (ps-1 holds no dense slice: the job's one is on
ps-0, so a join that took only dense slices would take nothing). The clients re-route on ps-1's
PartitionMovedError and resend; the join is done once ps-0, the joiner's backup, holds what it took. The
final async rows must be minus the sum of every acknowledged push, exactly, the sync rows minus the sum
over clocks of the clients' mean gradients (halves of integers: exact in float32), as an undisturbed run
ends, and `pshard status` shows the partitions on the joiner.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.sparse import TableConfig, server_of

from pshard.status import fetch, render
from tests.e2e.harness import LocalCluster, Procs, wait_healthy, wait_until
from tests.e2e.test_rebalance import DIM, TABLE
from tests.e2e.test_replication_async import _newer_layout
from tests.e2e.test_table_replication_async import STEP_TIMEOUT_S

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SYNC_TABLE = TableConfig("emb-sync", DIM, optimizer="sgd", lr=1.0, initializer="zeros", mode="sync")
CLIENTS = 2
RUN_TIMEOUT_S = 60.0
CLOCKS_BEFORE = 5  # clocks every client finished before the third server starts
CLOCKS_AFTER = 10  # and after its join is done, so that some go to the partitions it took
IDS = np.arange(0, 4000, dtype=np.int64)


def _batch(client: int, clock: int, table: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([client, clock, table, 20])
    ids = rng.choice(IDS, size=120)  # repeats: summed
    return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)


def test_a_joining_server_takes_table_partitions_losing_no_async_push_and_no_sync_clock(procs: Procs) -> None:
    # Heartbeats of 10 s: a loaded host must not declare a server dead mid-test (a failover is not a join).
    cluster = LocalCluster(procs, num_ps=3, num_workers=CLIENTS, heartbeat_timeout_ms=10_000,
                           scheduler_args=("--row-partitions-per-server", "4"))
    started = [cluster.start_scheduler(), *(cluster.start_ps(i, "--replicas", "1") for i in range(2))]
    for task, proc in zip(cluster.plan.servers, started, strict=False):  # the third server starts later
        wait_healthy(task.address, proc=proc)
    scheduler, address = started[0], cluster.plan.scheduler
    ps = [cluster.task(f"ps-{i}").address for i in range(3)]
    scheds = [SchedulerClient(address, "worker", node_id=f"worker-{i}", rank_hint=i,
                              own_address=cluster.task(f"worker-{i}").address, connect_timeout_s=30.0)
              for i in range(CLIENTS)]
    for s in scheds:
        s.register()
    layout = scheds[0].propose_layout([ParamSpec("bias", "float32", (4,))], servers=ps[:2], replicas=1)
    assert layout.partitions_on(1) == (1, 3, 5, 7) and not layout.slices_on(1)
    clients = [PSClient(ps[:2], f"worker-{i}", layout=layout, generation=lambda s=scheds[i]: s.generation,
                        timeout_s=STEP_TIMEOUT_S, transport="auto", relayout=_newer_layout(scheds[i]),
                        reroute_wait_s=10.0) for i in range(CLIENTS)]
    acked = np.zeros((len(IDS), DIM), np.float64)
    lock = threading.Lock()
    done = [0] * CLIENTS  # clocks each client finished
    end: list[int | None] = [None]  # the clock every client stops before, once the test sets it

    def run(i: int) -> None:
        for table in (TABLE, SYNC_TABLE):
            clients[i].declare_table(table)
        clock = 0
        while True:
            ids, grads = _batch(i, clock, 0)
            clients[i].push_rows(TABLE.name, ids, grads)  # returns once acknowledged
            with lock:
                np.add.at(acked, ids, grads)
            ids, grads = _batch(i, clock, 1)
            clients[i].push_rows(SYNC_TABLE.name, ids, grads, clock=clock)
            clients[i].pull_rows(SYNC_TABLE.name, np.unique(ids), clock=clock + 1)
            clock += 1
            with lock:  # a sync clock needs every client: they all stop after the same one
                done[i] = clock
                if end[0] is not None and clock >= end[0]:
                    return

    def finished(n: int) -> bool:
        return min(done) >= n or any(f.done() for f in futures)

    def stop() -> None:
        with lock:
            end[0] = max(done) + 1

    backed_up = f"JOIN: server 2 ({ps[2]}) is backed up: {ps[0]} holds"
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(run, i) for i in range(CLIENTS)]
            try:
                wait_until(lambda: finished(CLOCKS_BEFORE), RUN_TIMEOUT_S, f"{CLOCKS_BEFORE} clocks")
                joiner = cluster.start_ps(2, "--replicas", "1")
                wait_until(lambda: not joiner.alive() or any(f.done() for f in futures)
                           or any(backed_up in line for line in scheduler.lines),
                           RUN_TIMEOUT_S, "the third server joining, and its backup holding what it took")
                assert joiner.alive(), joiner.output()
                at_join = max(done)
                wait_until(lambda: finished(at_join + CLOCKS_AFTER), RUN_TIMEOUT_S,
                           f"{CLOCKS_AFTER} clocks after the join")
            finally:
                stop()  # also when an assertion failed: the pool waits for the clients
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        after = scheds[0].get_layout(timeout_s=5.0)
        taken = after.partitions_on(2)
        assert taken and set(taken) < set(layout.partitions_on(1))  # some of its donor's, whole
        assert after.servers == tuple(ps) and after.slices == layout.slices  # ps-1 had no slice to give
        assert set(after.partitions_on(1)) == set(layout.partitions_on(1)) - set(taken)
        final = clients[0].pull_rows(TABLE.name, IDS)
        wrong = np.flatnonzero((final != -acked.astype(np.float32)).any(axis=1))
        assert not len(wrong), (
            f"{len(wrong)} rows differ from minus their acknowledged pushes, of partitions "
            f"{sorted(set(server_of(IDS[wrong], after.partition_count).tolist()))} (moved: {list(taken)}); "
            f"first {IDS[wrong[0]]}: {final[wrong[0]]} against {-acked[wrong[0]]}")
        clocks = end[0]
        assert clocks is not None and done == [clocks] * CLIENTS
        expected = np.zeros((len(IDS), DIM), np.float64)
        for clock in range(clocks):
            for i in range(CLIENTS):
                ids, grads = _batch(i, clock, 1)
                np.add.at(expected, ids, grads / CLIENTS)
        synced = clients[0].pull_rows(SYNC_TABLE.name, IDS, clock=clocks)
        wrong = np.flatnonzero((synced != -expected.astype(np.float32)).any(axis=1))
        assert not len(wrong), (
            f"{len(wrong)} sync rows differ from an undisturbed run's, of partitions "
            f"{sorted(set(server_of(IDS[wrong], after.partition_count).tolist()))} (moved: {list(taken)})")
        assert all(c.layout.version == after.version for c in clients)  # every client re-routed
        assert set(server_of(IDS, after.partition_count).tolist()) >= set(taken)  # pushed to them too
        status = fetch(address, 10.0)
        *rolled, join = status.joins  # rolled back: a joiner's heartbeats late on a loaded host
        assert all(j.rolled_back for j in rolled), rolled
        assert (join.address, join.donor, join.done, join.partitions, join.slices) == (
            ps[2], ps[1], True, taken, 0)
        assert join.nbytes > 0 and join.layout_version == after.version
        lines = render(status).splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("JOIN "))
        row = lines[header + 1]
        assert row.split()[1] == "done" and row.endswith(",".join(map(str, taken))), row
        took = f"JOIN: server 2 ({ps[2]}) took 0 slices and row partitions {list(taken)}"
        assert any(took in line for line in scheduler.lines), scheduler.output()
        assert not any("FAILOVER" in line for line in scheduler.lines)  # planned, not a death
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
