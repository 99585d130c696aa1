"""The scheduler's automatic rebalance (issue 20, item 3): `pshard scheduler --rebalance-auto 1.2` moves a row
partition off a hot server on its own, and none while the load is balanced.

Real processes: a scheduler (4 row partitions per server, a 2 s load window and cool-down) and three servers
without replicas, heartbeating every 200 ms; two clients push integer gradients to an async table, first
spread over every id (balanced: the scheduler decides, with a full window of samples, that there is nothing
to move), then nearly all to ids of ps-1's partitions (the scheduler starts a move off ps-1, a catch-up copy
then a switch, logged AUTO-REBALANCE). The final rows are minus the sum of every acknowledged push, exactly.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.common.sparse import server_of

from pshard.status import fetch
from tests.e2e.harness import LocalCluster, Procs, wait_until
from tests.e2e.test_rebalance import DIM, EVERY, RUN_TIMEOUT_S, TABLE, _Pushers, _stopping
from tests.e2e.test_table_replication_async import replicated_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CLIENTS = 2
POLICY = ("--rebalance-auto", "1.2", "--rebalance-cooldown", "2", "--load-window-s", "2")


def test_the_scheduler_moves_a_partition_off_a_hot_server_on_its_own_and_none_while_balanced(
        procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=3, num_workers=CLIENTS,
                           scheduler_args=("--row-partitions-per-server", "4", *POLICY))
    started, scheds, layout, clients = replicated_job(procs, CLIENTS, cluster=cluster, replicas=0)
    scheduler, address = started[0], scheds[0].address
    hot = EVERY[np.isin(server_of(EVERY, layout.partition_count), layout.partitions_on(1))]
    skewed = threading.Event()

    def batch(client: int, push: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([client, push, 13])
        ids = rng.choice(hot if skewed.is_set() else EVERY, size=100)  # repeats: summed
        return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)

    pushers = _Pushers(clients, batch)

    def decided(prefix: str) -> bool:
        auto = fetch(address, 10.0).auto_rebalance
        return auto is not None and auto.reason.startswith(prefix)

    try:
        with ThreadPoolExecutor(CLIENTS) as pool, _stopping(pushers.stop):
            futures = [pool.submit(pushers.run, i) for i in range(CLIENTS)]
            # Balanced: decided on a full window of every server's samples, and nothing moved.
            wait_until(lambda: decided("balanced:") or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       "the scheduler deciding the balanced load needs no move")
            assert scheds[0].get_layout(timeout_s=5.0).version == layout.version
            assert not any("AUTO-REBALANCE" in line for line in scheduler.lines)
            skewed.set()
            line = scheduler.wait_for_line(r"AUTO-REBALANCE: row partition (\d+) from server 1 ",
                                           RUN_TIMEOUT_S)
            moved = int(line.group(1))
            wait_until(lambda: scheds[0].get_layout(timeout_s=5.0).row_owner(moved) != 1
                       or any(f.done() for f in futures), RUN_TIMEOUT_S, f"row partition {moved} switched")
            at_move = pushers.count
            wait_until(lambda: pushers.count >= at_move + 10 or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       "10 acknowledged pushes after the move")
            pushers.stop.set()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        assert moved in layout.partitions_on(1)
        status = fetch(address, 10.0).auto_rebalance
        assert status is not None and status.enabled and status.moves >= 1 and status.threshold == 1.2
        final = clients[0].pull_rows(TABLE.name, EVERY)
        np.testing.assert_array_equal(final, -pushers.acked.astype(np.float32))
    finally:
        pushers.stop.set()
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
