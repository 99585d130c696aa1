"""Zero lost table updates with replicas, sync (issue 10, docs/architecture.md 9 Failures).

Real processes: a scheduler and three servers with `--replicas 1`; two workers train a sync sparse
table (SGD at lr 1, zero rows, integer gradients), each pushing its clock and then pulling at the
next, as PSEmbedding does. Worker 0 pushes clock K, then the server of row partition 1 is SIGKILLed
before worker 1 pushed K: worker 0's push is acknowledged and lies pending, unreplicated, on the dead
server. The scheduler moves partition 1 to its backup, which resumes it at the replicated applied
clock; worker 0 sends its kept push again, worker 1 re-routes its own. The mean of integer gradients
over two workers is exact in float32, so the final rows must equal minus the sum over clocks of
those means, exactly: a lost or doubled update shows.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.common.sparse import TableConfig, server_of

from tests.e2e.harness import Procs, wait_until
from tests.e2e.test_table_replication_async import replicated_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]  # the run itself is bounded by RUN_TIMEOUT_S

WORKERS = 2
CLOCKS = 12
KILL_AT = 5  # the clock worker 0 pushed, and worker 1 not yet, when ps-1 dies
DIM = 8
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros", mode="sync")
IDS = np.arange(0, 3000, 3, dtype=np.int64)
RUN_TIMEOUT_S = 150.0


def _batch(worker: int, clock: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([worker, clock])
    ids = rng.choice(IDS, size=300)  # repeats: the client sums them
    return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)


@pytest.mark.parametrize("partitions_per_server", [1, 4])
def test_sync_table_workers_lose_no_update_when_a_server_with_a_pending_clock_is_sigkilled(
        procs: Procs, partitions_per_server: int) -> None:
    """With 4 row partitions per server (issue 20) the scheduler plans 12, each server serves four,
    and the failover hands all four of ps-1's to its backup."""
    started, scheds, layout, clients = replicated_job(procs, WORKERS, partitions_per_server)
    assert layout.partition_count == 3 * partitions_per_server
    pushed = threading.Event()  # worker 0 pushed clock KILL_AT
    killed = threading.Event()

    def run(w: int) -> None:
        clients[w].declare_table(TABLE)
        for clock in range(CLOCKS):
            if clock == KILL_AT and w == 1:
                assert killed.wait(RUN_TIMEOUT_S)
            clients[w].push_rows(TABLE.name, *_batch(w, clock), clock=clock)
            if clock == KILL_AT and w == 0:
                pushed.set()
            clients[w].pull_rows(TABLE.name, IDS, clock=clock + 1)

    assert set(server_of(IDS, 3).tolist()) == {0, 1, 2}
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = [pool.submit(run, w) for w in range(WORKERS)]
            assert pushed.wait(RUN_TIMEOUT_S), [f.exception() for f in futures if f.done()]
            # Only a backup the scheduler counts in sync is promoted: killed before ps-1's heartbeat
            # reported its copy (a loaded machine, in CI), ps-1 fails over to no one, loudly. Clock
            # KILL_AT stays pending meanwhile: worker 1 waits for the kill to push it.
            in_sync = f"is an in-sync backup of {layout.servers[1]}"
            wait_until(lambda: any(in_sync in line for line in started[0].lines), RUN_TIMEOUT_S,
                       f"the scheduler counting a backup of ps-1 ({layout.servers[1]}) in sync")
            os.kill(started[2].pid, signal.SIGKILL)  # started: scheduler, ps-0, ps-1, ps-2: ps-1
            killed.set()
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
        assert after.version > layout.version and after.row_owner(1) == 2, "no failover happened"
        assert after.partitions_on(1) == () and after.partition_count == layout.partition_count
        assert clients[0].tables.resent > 0
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
