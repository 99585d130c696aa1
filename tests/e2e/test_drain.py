"""`pshard ps --drain-on-term` (issue 20): a server asked to stop hands what it serves to its backup
first, leaves the job, and exits 0; nothing is lost or applied twice.

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
from pshard.common.cluster.view import NodeState
from pshard.common.sparse import TableConfig

from tests.e2e.harness import Procs, wait_until
from tests.e2e.test_table_replication_async import replicated_job

pytestmark = pytest.mark.e2e

WORKERS = 2
CLOCKS = 10
DRAIN_AT = 4  # the clock worker 0 pushed, and worker 1 not yet, when ps-1 is told to stop
DIM = 8
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros", mode="sync")
IDS = np.arange(0, 3000, 3, dtype=np.int64)
RUN_TIMEOUT_S = 120.0


def _batch(worker: int, clock: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([worker, clock, 7])
    ids = rng.choice(IDS, size=300)  # repeats: the client sums them
    return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)


def test_a_server_drained_on_sigterm_hands_its_partitions_over_and_exits_0(procs: Procs) -> None:
    started, scheds, layout, clients = replicated_job(procs, WORKERS, 4, ps_args={1: ("--drain-on-term",)})
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
            drained.signal_group(signal.SIGTERM)
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
