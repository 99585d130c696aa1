"""`pshard rebalance` (issue 20, items 3 and 5): the scheduler rates each server's load from its heartbeats,
and the command moves a hot row partition of the busiest server to that server's backup while clients keep
pushing to it; no acknowledged update is lost or applied twice.

Real processes: a scheduler planning 4 row partitions per server, three servers with `--replicas 1`, and
four clients pushing integer gradients (SGD at lr 1, zero rows) to an async table, nearly all to ids of
ps-1's partitions and a few to ps-0's (ps-0 holds the job's one dense slice, which no client declares, so
its backup never counts in sync, so no move to it could count done; ps-1 has none): ps-1 is the hottest
server, ps-2 (its backup) the coolest, so the plan's first move goes to ps-2 (`--max-moves 1`). The final
rows must be minus the sum of every acknowledged push, exactly. The second test runs the job without
replicas: every move there makes a catch-up copy of the partition to its new server first.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.common.cluster.layout import Layout
from pshard.common.security.credentials import SecurityConfig
from pshard.common.sparse import TableConfig, server_of

from pshard.admin import scheduler_stub
from pshard.api.v1 import scheduler_pb2
from pshard.status import fetch, render
from tests.e2e.harness import Procs, wait_until
from tests.e2e.test_table_replication_async import replicated_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLIENTS = 4
DIM = 8
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros")
RUN_TIMEOUT_S = 60.0
IDS = 6000
EVERY = np.arange(0, IDS, dtype=np.int64)  # the table's ids
PUSHES_AFTER = 20  # acknowledged pushes in all after the move, so some go to the partition's new server


@contextlib.contextmanager
def _stopping(stop: threading.Event) -> Iterator[None]:
    """The clients stop before the pool waits for them, also when an assertion fails."""
    try:
        yield
    finally:
        stop.set()


class _Pushers:
    """Clients pushing `batch(client, push)` (ids and integer gradients) to TABLE until `stop`: `acked` sums
    every acknowledged push by id (the final rows must be minus it, exactly), `count` counts them."""

    def __init__(self, clients: list, batch: Callable[[int, int], tuple[np.ndarray, np.ndarray]]) -> None:
        self.clients, self.batch = clients, batch
        self.acked = np.zeros((IDS, DIM), np.float64)
        self.lock = threading.Lock()
        self.count = 0
        self.stop = threading.Event()

    def run(self, i: int) -> None:
        self.clients[i].declare_table(TABLE)
        push = 0
        while not self.stop.is_set():
            ids, grads = self.batch(i, push)
            self.clients[i].push_rows(TABLE.name, ids, grads)  # returns once acknowledged
            with self.lock:
                np.add.at(self.acked, ids, grads)
                self.count += 1
            push += 1


def _batch(hot: np.ndarray, warm: np.ndarray, client: int, push: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([client, push, 11])
    chosen = np.concatenate([rng.choice(hot, size=100), rng.choice(warm, size=3)])  # repeats: summed
    return chosen, rng.integers(-3, 4, size=(len(chosen), DIM)).astype(np.float32)


def _hot_on_ps1(clients: list, layout: Layout) -> _Pushers:
    """Pushers loading ps-1's partitions (100 ids a push) far more than ps-0's (3), and ps-2's not at all."""
    partition = server_of(EVERY, layout.partition_count)
    hot = EVERY[np.isin(partition, layout.partitions_on(1))]
    warm = EVERY[np.isin(partition, layout.partitions_on(0))]
    return _Pushers(clients, lambda i, push: _batch(hot, warm, i, push))


def test_rebalance_moves_a_hot_partition_to_its_backup_and_loses_no_acknowledged_update(procs: Procs) -> None:
    started, scheds, layout, clients = replicated_job(procs, CLIENTS, 4)
    scheduler = started[0]
    address = scheds[0].address
    pushers = _hot_on_ps1(clients, layout)
    acked, stop = pushers.acked, pushers.stop

    def loaded() -> bool:
        """Rates for the pushed servers, and ps-1's partitions sized: a server recounts its partitions'
        bytes every 2 s at most, so its first reports may still carry the sizes from before any push
        (a move's bytes come from them)."""
        loads = {load.node_id: load for load in fetch(address, 10.0).loads}
        return len(loads) == 3 and all(sum(loads[f"ps-{i}"].rows_per_s.values()) > 0 for i in (0, 1)) and all(
            loads["ps-1"].partition_bytes.get(p, 0) > 0 for p in layout.partitions_on(1))

    try:
        with ThreadPoolExecutor(CLIENTS) as pool, _stopping(stop):
            futures = [pool.submit(pushers.run, i) for i in range(CLIENTS)]
            wait_until(lambda: loaded() or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       "the scheduler rating the servers' load")
            status = fetch(address, 10.0)
            assert "HOT PARTITION" in render(status)
            ps1 = next(load for load in status.loads if load.node_id == "ps-1")
            assert set(ps1.rows_per_s) == set(layout.partitions_on(1))
            operator = procs.python("rebalance", "-m", "pshard", "rebalance", "--scheduler", address,
                                    "--insecure", "--timeout-s", "30", "--max-moves", "1")
            assert operator.wait(RUN_TIMEOUT_S) == 0, operator.output()
            at_move = pushers.count
            wait_until(lambda: pushers.count >= at_move + PUSHES_AFTER or any(f.done() for f in futures),
                       RUN_TIMEOUT_S, f"{PUSHES_AFTER} acknowledged pushes after the move")
            # The move is done once ps-2's backup (ps-0) holds the partition: status and log say so.
            wait_until(lambda: all(m.done for m in fetch(address, 10.0).moves), RUN_TIMEOUT_S,
                       "the move done")
            (move,) = fetch(address, 10.0).moves
            wait_until(lambda: any("MOVE: row partition" in line for line in scheduler.lines), 10.0,
                       "the scheduler's MOVE line")
            assert not any("FAILOVER" in line for line in scheduler.lines)  # planned, not a death
            # The source keeps its other partitions' copy on ps-2: a SIGKILL of it now loses nothing.
            started[2].kill()  # started: scheduler, ps-0, ps-1, ps-2
            at_kill = pushers.count
            wait_until(lambda: pushers.count >= at_kill + PUSHES_AFTER or any(f.done() for f in futures),
                       RUN_TIMEOUT_S, f"{PUSHES_AFTER} acknowledged pushes after ps-1's failover")
            stop.set()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        output = operator.output()
        assert "to its backup" in output and "after a catch-up copy" not in output, output
        assert "moved from server 1" in output, output
        assert re.search(r"1 row partition\(s\) moved in", output), output
        moved = move.partition
        assert layout.row_owner(moved) == 1 and (move.source, move.target, move.bytes_left) == (
            layout.servers[1], layout.servers[2], 0)
        assert move.nbytes > 0 and move.bytes_copied == move.nbytes
        assert move.layout_version == layout.version + 1
        final = clients[0].pull_rows(TABLE.name, EVERY)
        np.testing.assert_array_equal(final, -acked.astype(np.float32))
        after = scheds[0].get_layout(timeout_s=5.0)
        assert set(after.partitions_on(2)) == {moved, *layout.partitions_on(1), *layout.partitions_on(2)}
    finally:
        stop.set()
        for c in clients:
            c.close()
        for s in scheds:
            s.close()


def test_rebalance_without_replicas_copies_hot_partitions_to_other_servers_and_loses_no_acknowledged_update(
        procs: Procs) -> None:
    """No server holds a copy of another's rows: each move first copies the partition to its new server
    (its rows, then every change of them) while the clients keep pushing to it, then switches."""
    started, scheds, layout, clients = replicated_job(procs, CLIENTS, 4, replicas=0)
    scheduler = started[0]
    address = scheds[0].address
    pushers = _hot_on_ps1(clients, layout)
    acked, stop = pushers.acked, pushers.stop

    def loaded() -> bool:
        loads = {load.node_id: load for load in fetch(address, 10.0).loads}
        return len(loads) == 3 and all(sum(loads[f"ps-{i}"].rows_per_s.values()) > 0 for i in (0, 1))

    try:
        with ThreadPoolExecutor(CLIENTS) as pool, _stopping(stop):
            futures = [pool.submit(pushers.run, i) for i in range(CLIENTS)]
            wait_until(lambda: loaded() or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       "the scheduler rating the servers' load")
            operator = procs.python("rebalance", "-m", "pshard", "rebalance", "--scheduler", address,
                                    "--insecure", "--timeout-s", "30")
            assert operator.wait(RUN_TIMEOUT_S) == 0, operator.output()
            at_move = pushers.count
            wait_until(lambda: pushers.count >= at_move + PUSHES_AFTER or any(f.done() for f in futures),
                       RUN_TIMEOUT_S, f"{PUSHES_AFTER} acknowledged pushes after the moves")
            wait_until(lambda: all(m.done for m in fetch(address, 10.0).moves), RUN_TIMEOUT_S,
                       "the moves done")
            stop.set()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        output = operator.output()
        assert "to its backup" not in output and "after a catch-up copy" in output, output
        moved = {int(p): (int(a), int(b)) for p, a, b in re.findall(
            r"row partition (\d+): moved from server (\d) \(\S+\) to server (\d) ", output)}
        assert 1 in {a for a, _ in moved.values()}, output  # off the hottest server
        assert re.search(rf"{len(moved)} row partition\(s\) moved in", output), output
        assert any("which caught up with it" in line for line in scheduler.lines)
        assert not any("FAILOVER" in line or "ROLLED BACK" in line for line in scheduler.lines)
        after = scheds[0].get_layout(timeout_s=5.0)
        assert after.version == layout.version + len(moved)  # one switch each, nothing else
        assert {p: (layout.row_owner(p), after.row_owner(p)) for p in moved} == moved
        final = clients[0].pull_rows(TABLE.name, EVERY)
        np.testing.assert_array_equal(final, -acked.astype(np.float32))
    finally:
        stop.set()
        for c in clients:
            c.close()
        for s in scheds:
            s.close()


def test_a_move_whose_target_is_sigkilled_mid_copy_rolls_back_and_loses_no_acknowledged_update(
        procs: Procs) -> None:
    """No replicas, a move of one of ps-1's partitions to ps-2, whose copy ps-2 holds unapplied (a failpoint)
    when it is SIGKILLed: the scheduler rolls the move back (the layout never named ps-2), ps-1 serves the
    partition on, and the clients' pushes to it go on and keep every acknowledged update."""
    started, scheds, layout, clients = replicated_job(
        procs, 2, 4, replicas=0, ps_env={2: {"PSHARD_FAILPOINTS": "ps.before_rows_apply=pause-once"}})
    scheduler, target = started[0], started[3]  # started: scheduler, ps-0, ps-1, ps-2
    hot = EVERY[np.isin(server_of(EVERY, layout.partition_count), layout.partitions_on(1))]

    def batch(i: int, push: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([i, push, 12])
        ids = rng.choice(hot, size=100)
        return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)

    pushers = _Pushers(clients, batch)
    acked, stop = pushers.acked, pushers.stop

    moved = layout.partitions_on(1)[0]
    try:
        with ThreadPoolExecutor(2) as pool, _stopping(stop):
            futures = [pool.submit(pushers.run, i) for i in range(2)]
            wait_until(lambda: pushers.count >= 10 or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       "10 acknowledged pushes")
            with scheduler_stub(scheds[0].address, SecurityConfig()) as stub:
                reply = stub.MovePartition(scheduler_pb2.MovePartitionRequest(
                    partition=moved, target=layout.servers[2], layout_version=layout.version), timeout=10.0)
            assert reply.copying and reply.layout_version == layout.version
            target.wait_for_line("failpoint ps.before_rows_apply: paused", RUN_TIMEOUT_S)
            target.kill()
            wait_until(lambda: any("MOVE ROLLED BACK" in line for line in scheduler.lines), RUN_TIMEOUT_S,
                       "the scheduler rolling the move back")
            at_kill = pushers.count
            wait_until(lambda: pushers.count >= at_kill + PUSHES_AFTER or any(f.done() for f in futures),
                       RUN_TIMEOUT_S, f"{PUSHES_AFTER} acknowledged pushes after the roll-back")
            stop.set()
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        after = scheds[0].get_layout(timeout_s=5.0)
        assert after.version == layout.version and after.row_owner(moved) == 1  # never switched
        assert not fetch(scheds[0].address, 10.0).moves
        final = clients[0].pull_rows(TABLE.name, hot)
        np.testing.assert_array_equal(final, -acked[np.searchsorted(EVERY, hot)].astype(np.float32))
    finally:
        stop.set()
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
