"""Sparse-table rows as a backup holds them (docs/architecture.md, 9 Failures). Pure: numpy only.

A primary ships the rows that changed since its last batch to a backup, each with its whole state:
value, optimizer state, last touch, count of updates, lazy Adam's step count (`capture`). A row
pushed many times between two batches travels once, as it is after the last push; an id that is
no longer a row (evicted, or only counted by admission) travels as a deletion; every shipped id
travels with its estimated admission sightings (ps_server.tables.admission). The table's scalars
(pushes applied, newest clock, evictions, admissions), the admission counts' halvings, the admission
generator's state and the idempotence keys of recent pushes ride along, so the copy (`install`) is
the primary's table, row for row and counter for counter.

A backup keeps one replica table per (primary, table) (`ReplicaTables`); on failover the heir
merges a dead primary's replica tables into its own serving tables (`merge`): the two hold ids of
different row partitions (pshard.common.sparse.server_of), so no id is in both. One thing does not
survive the merge exactly: dense Adam's bias correction counts a server's pushes per table, and the
heir keeps the larger of the two counts.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import numpy as np
from pshard.common.sparse import TableConfig, take_rows
from pshard.ps_server.tables.table import CHUNK_ROWS, SparseTable

# Idempotence keys remembered per worker and table: far more pushes than a worker has in flight
# while a failover happens (its calls wait, a few per table at most).
PUSHES_KEPT = 256


PushKey = tuple[int, int]  # (push_id, row partition): one push spans the partitions a server serves


class PushLog:
    """Idempotence keys of the recent pushes to one table, by worker: a resend is dropped."""

    def __init__(self) -> None:
        self._by_worker: dict[str, OrderedDict[PushKey, None]] = {}

    def seen(self, worker: str, push_id: PushKey) -> bool:
        keys = self._by_worker.get(worker)
        return keys is not None and push_id in keys

    def add(self, worker: str, push_id: PushKey) -> None:
        keys = self._by_worker.setdefault(worker, OrderedDict())
        keys[push_id] = None
        while len(keys) > PUSHES_KEPT:
            keys.popitem(last=False)

    def keys_of(self, workers: Iterable[str]) -> dict[str, list[PushKey]]:
        return {w: list(self._by_worker[w]) for w in workers if w in self._by_worker}

    def workers(self) -> list[str]:
        return list(self._by_worker)

    def replace(self, worker: str, keys: Iterable[PushKey]) -> None:
        """Hold `keys` for `worker` (a primary's list, oldest first), replacing what was there."""
        self._by_worker[worker] = OrderedDict((k, None) for k in list(keys)[-PUSHES_KEPT:])

    def merge(self, other: PushLog, partitions: Collection[int] | None = None) -> None:
        """Hold `other`'s keys too (of `partitions` only, when given: the ones a server takes over), the
        newest PUSHES_KEPT per worker of both. By push id, not appended: a server taking a partition over
        appended up to PUSHES_KEPT keys of its old server after its own, evicting its own newest, and
        then applied again a push that a move's re-route resent to it (push ids grow per worker)."""
        for worker, keys in other._by_worker.items():
            mine = self._by_worker.get(worker, OrderedDict())
            new = [k for k in keys if k not in mine and (partitions is None or k[1] in partitions)]
            if new:
                newest = sorted([*mine, *new])[-PUSHES_KEPT:]
                self._by_worker[worker] = OrderedDict((k, None) for k in newest)


@dataclass
class RowBatch:
    """Changed rows of one table and its scalars, as `capture` takes them from a primary's table."""

    config: TableConfig
    ids: np.ndarray  # int64, the rows shipped
    columns: dict[str, np.ndarray]  # SparseTable.columns() names -> their rows, in `ids` order
    deleted: np.ndarray  # int64 ids that are no rows
    step: int = 0
    clock: float = 0.0
    evicted: int = 0
    admitted: int = 0
    seen_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seen_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rng_state: str = ""  # json of the admission generator's state ("": no admission by probability)
    pushes: dict[str, list[PushKey]] = field(default_factory=dict)
    # Sync tables: per row partition, the first clock not applied when the rows were captured.
    applied: dict[int, int] | None = None
    admit_epoch: int = 0  # halvings of the primary's admission counts at capture
    # The table's scheduled calls' record (ps_server/tables/scheduled.py): schedule id -> last push number
    # for every partition, its floor, and per row partition (`scheduled_parts`). None: not in this batch (an
    # older primary's, or rows of a push not all shipped yet).
    scheduled: dict[int, int] | None = None
    schedule_floor: int = 0
    scheduled_parts: dict[int, dict[int, int]] = field(default_factory=dict)  # per row partition
    # Records restored from a global checkpoint over this batch's rows (ScheduledPushes.restored_over):
    # they go with every batch of those rows, so a backup never holds a restored row without its record.
    restored: list[tuple[np.ndarray, dict[int, int]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return (self.ids.nbytes + self.deleted.nbytes + self.seen_ids.nbytes
                + sum(c.nbytes for c in self.columns.values()))


# alloc(dtype, shape) -> an array to gather a column into (a shared-memory segment's room).
Alloc = Callable[[np.dtype, tuple[int, ...]], np.ndarray]


def capture(table: SparseTable, ids: np.ndarray, pushes: dict[str, list[PushKey]] | None = None,
            alloc: Alloc | None = None) -> RowBatch:
    """The state of `ids` (distinct) in `table` now: rows with every per-row array (gathered into
    `alloc`'s arrays, in column name order, when given), the rest as deletions with their admission
    sightings. Copies: the batch outlives the table's next request."""
    rows = table.index.lookup(ids)
    live = rows >= 0
    taken = rows[live]
    # Rows on a disk tier (memory_mb) are read where they are: capture runs on the event loop, maybe beside
    # a large request's thread on the table, so it must move nothing.
    spilled_ids, spilled = table.spilled(ids[~live])
    columns = {}
    for name, (array, shape) in sorted(table.columns().items()):
        n = len(taken) + len(spilled_ids)
        out = alloc(array.dtype, (n, *shape)) if alloc is not None else np.empty((n, *shape), array.dtype)
        if array.ndim == 2:
            take_rows(array, taken, out[:len(taken)])
        else:
            np.take(array, taken, out=out[:len(taken)])
        if len(spilled_ids):
            out[len(taken):] = spilled[name]
        columns[name] = out
    deleted = ids[~live]
    if len(spilled_ids):
        deleted = deleted[~np.isin(deleted, spilled_ids)]
    # Rows too: the sketch keeps counting admitted ids, and an evicted row's counts readmit it.
    counts = table.sightings(ids)
    return RowBatch(table.config, np.concatenate([ids[live], spilled_ids]), columns, deleted.copy(),
                    table.step, table.clock, table.evicted, table.admitted, ids[counts > 0].copy(),
                    counts[counts > 0],
                    json.dumps(table.rng_state) if table.config.admit_prob < 1.0 else "", pushes or {},
                    admit_epoch=table.admit_epoch, scheduled=dict(table.scheduled.last),
                    schedule_floor=table.scheduled.floor,
                    scheduled_parts={p: dict(kept) for p, kept in table.scheduled.parts.items()},
                    restored=table.scheduled.restored_over(ids) if table.scheduled.restored else [])


def install(table: SparseTable, batch: RowBatch) -> None:
    """Make `table` (a replica) hold `batch` as its primary did."""
    if len(batch.ids):
        table.restore_rows(batch.ids, batch.columns)
    if len(batch.deleted):
        rows = table.index.lookup(batch.deleted)
        table.index.delete_rows(rows[rows >= 0])  # the primary counted the eviction (`evicted`)
    # Counts only grow between halvings (a count-min sketch forgets nothing but by decay): raising the
    # shipped ids' counts to the primary's makes the backup's estimates of them the primary's.
    table.follow_sightings(batch.admit_epoch, batch.seen_ids, batch.seen_counts)
    table.step, table.clock, table.evicted, table.admitted = batch.step, batch.clock, batch.evicted, \
        batch.admitted
    if batch.rng_state:
        table.rng_state = json.loads(batch.rng_state)
    if batch.scheduled is not None:
        table.scheduled.replace(batch.schedule_floor, batch.scheduled, batch.scheduled_parts)
    table.scheduled.hold_restored(batch.restored)


def all_ids(table: SparseTable) -> np.ndarray:
    """Every live id of `table` (a new backup's copy ships them all)."""
    parts = [ids for _, ids in table.chunks()] + [ids for ids, _ in table.spilled_chunks()]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def merge(into: SparseTable, replica: SparseTable, keep: Callable[[np.ndarray], np.ndarray] | None = None
          ) -> np.ndarray:
    """Move every row of `replica` into `into` (the heir's serving table) with its whole state; the
    ids moved. Their row partitions differ, so no id is in both. `keep(ids)`: a mask of the rows to move
    (None: all), so that rows of a partition a move took from the replica's primary earlier, which the
    heir serves and has updated since, are not overwritten by their stale copy."""
    moved = []
    for rows, ids in replica.chunks():
        if keep is not None:
            mask = keep(ids)
            rows, ids = rows[mask], ids[mask]
            if not len(ids):
                continue
        into.restore_rows(ids, {name: array[rows] for name, (array, _) in replica.columns().items()})
        moved.append(ids.copy())
    for ids, columns in replica.spilled_chunks():
        if keep is not None:
            mask = keep(ids)
            ids, columns = ids[mask], {name: c[mask] for name, c in columns.items()}
            if not len(ids):
                continue
        into.restore_rows(ids, columns)
        moved.append(ids)
    into.step = max(into.step, replica.step)
    into.clock = max(into.clock, replica.clock)
    into.evicted += replica.evicted
    into.admitted += replica.admitted
    # The replica's partitions are the dead primary's: the heir takes its record for exactly those.
    into.scheduled.merge(replica.scheduled.floor, replica.scheduled.last, replica.scheduled.parts)
    taken = np.concatenate(moved) if moved else np.zeros(0, np.int64)
    # And the records a global checkpoint restored over the rows it takes (no other row's: see `keep`).
    into.scheduled.hold_restored(replica.scheduled.restored_over(taken) if replica.scheduled.restored else [])
    return taken


class ReplicaTables:
    """Backup side: per primary, a replica of each of its tables, and its push log. Thread-safe: the
    Replicate call applies batches off the event loop, a promotion takes them on it."""

    def __init__(self) -> None:
        self._tables: dict[tuple[str, str], SparseTable] = {}
        self._logs: dict[tuple[str, str], PushLog] = {}
        self._clocks: dict[tuple[str, str], dict[int, int]] = {}  # sync tables' applied clocks
        self._lock = threading.Lock()
        self.batches_applied = 0

    def apply(self, primary: str, batches: Iterable[RowBatch],
              refuse: Callable[[RowBatch], None] | None = None) -> None:
        """`refuse(batch)`: raises to refuse the call, nothing applied; run under the lock that `copy`
        holds, so a batch is either refused or in the replica before a copy reads it."""
        with self._lock:
            batches = list(batches)
            if refuse is not None:
                for batch in batches:
                    refuse(batch)
            for batch in batches:
                key = (primary, batch.config.name)
                table = self._tables.get(key)
                if table is None or table.config != batch.config:  # first batch, or redeclared
                    table = self._tables[key] = SparseTable(batch.config, expected_rows=len(batch.ids))
                    self._logs[key] = PushLog()
                install(table, batch)
                if batch.applied is not None:
                    self._clocks[key] = dict(batch.applied)
                log = self._logs[key]
                for worker, keys in batch.pushes.items():
                    log.replace(worker, keys)
                self.batches_applied += 1

    def release(self, primary: str) -> int:
        """Drop `primary`'s replicas (it forwards elsewhere now); the rows dropped."""
        with self._lock:
            keys = [k for k in self._tables if k[0] == primary]
            rows = sum(len(self._tables[k]) for k in keys)
            for key in keys:
                del self._tables[key]
                self._logs.pop(key, None)
                self._clocks.pop(key, None)
            return rows

    def clocks(self, primary: str) -> dict[str, dict[int, int]]:
        """`primary`'s sync tables' applied clocks per partition, by table (read before `take`)."""
        with self._lock:
            return {name: dict(c) for (p, name), c in self._clocks.items() if p == primary}

    def take(self, primary: str) -> list[tuple[SparseTable, PushLog]]:
        """Hand over `primary`'s replicas, to be merged into this server's tables (a failover)."""
        with self._lock:
            keys = sorted(k for k in self._tables if k[0] == primary)
            for key in keys:
                self._clocks.pop(key, None)
            return [(self._tables.pop(k), self._logs.pop(k)) for k in keys]

    def copy(self, primary: str, keep: Callable[[np.ndarray], np.ndarray], before: Callable[[], None]
             ) -> list[tuple[SparseTable, PushLog, dict[int, int] | None]]:
        """Copies of `primary`'s replicas holding only the rows whose ids `keep` (a mask) selects, with its
        push log and sync clocks (a row partition moving to this server while `primary` keeps the rest:
        its replicas stay, a later failover of it takes what it still serves). `before()` runs first,
        under the lock every batch is applied under."""
        with self._lock:
            before()
            out = []
            for key in sorted(k for k in self._tables if k[0] == primary):
                replica = self._tables[key]
                part = SparseTable(replica.config)
                for rows, ids in replica.chunks():
                    mask = keep(ids)
                    if mask.any():
                        part.restore_rows(ids[mask], {name: array[rows][mask]
                                                      for name, (array, _) in replica.columns().items()})
                for ids, columns in replica.spilled_chunks():
                    mask = keep(ids)
                    if mask.any():
                        part.restore_rows(ids[mask], {name: c[mask] for name, c in columns.items()})
                part.step, part.clock = replica.step, replica.clock
                # The scheduled record goes too (`merge` folds it in as a failover's does), with the records
                # a global checkpoint restored over the rows copied: else the new server applies again a
                # re-dispatched push that the moved rows had.
                held = replica.scheduled
                part.scheduled.merge(held.floor, held.last, held.parts)
                if held.restored:
                    part.scheduled.hold_restored(held.restored_over(all_ids(part)))
                push_log = PushLog()
                push_log.merge(self._logs[key])
                clocks = self._clocks.get(key)
                out.append((part, push_log, dict(clocks) if clocks is not None else None))
            return out

    def primaries(self) -> set[str]:
        with self._lock:
            return {p for p, _ in self._tables}

    def rows(self, primary: str, name: str) -> int:
        with self._lock:
            table = self._tables.get((primary, name))
            return 0 if table is None else len(table)

    def table(self, primary: str, name: str) -> SparseTable | None:
        """The replica itself (tests compare it with its primary's table)."""
        with self._lock:
            return self._tables.get((primary, name))


def chunked(ids: np.ndarray, rows: int = CHUNK_ROWS) -> list[np.ndarray]:
    """`ids` in pieces of at most `rows` (a big copy goes in several batches)."""
    return [ids[i:i + rows] for i in range(0, len(ids), rows)] or [ids]
