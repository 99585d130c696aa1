"""What a parameter server does with a sparse-table request, whatever transport brought it.

Requests carry ids as raw int64 bytes and rows as raw bytes of the table's dtype (the wire format
of proto/pshard/api/v1/sparse.proto). Each request is validated whole before anything moves:
ids a whole number of int64s, distinct, within the request limit; gradients exactly one row of
`dim` numbers per id and finite unless the table allows otherwise; the table declared. A refusal
names the table (and the id, when one is to blame) and leaves the table unchanged.

Requests of one table are serialised by an asyncio lock; they run on the event loop (a request
of a few thousand rows is a few vectorised numpy passes), except large ones (OFF_LOOP_IDS ids or
more), whose table work runs on a worker thread while the lock is held, so that health probes and
other tables' callers keep their latency. Checkpoints and exports hold the lock and write from a
worker thread too.

Reads create nothing (ps_server.tables.table): a pull of ids that have no row returns their initial
values. In a PushPullRows, the push is applied first, so the rows it created are read as they
are now; its other pulled ids, like any pull's, stay absent.

Sync tables (ps_server.tables.sync) need the worker of each push and the quorum: the server's
static one (--workers) or the scheduler's, given to `set_quorum`. Their pulls wait, as coroutines,
until the clock they read is applied in the row partitions of their ids. With replicas, a sync
push also names the layout version it was routed with (TableReplication.routed).

Writes are under the server's lease from the scheduler as dense ones are (ps_server/core/lease.py,
`fence`): a push that finds it expired waits for a renewal until it lapses, then is refused with
FencedError (the worker re-routes), and a sync pull waiting for a clock ends so once it has lapsed: a
server failed over behind a partition takes no table row either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import shutil
import time
import zlib
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
from pshard.common.dirlock import DirectoryInUseError, DirectoryLock
from pshard.common.errors import (
    InvalidArgumentError,
    LayoutConflictError,
    MessageTooLargeError,
    PullTimeoutError,
    QuotaExceededError,
    StaleGenerationError,
    UnknownKeyError,
    checkpoint_write_error,
)
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import decode_grads
from pshard.ps_server.core.lease import SchedulerLease
from pshard.ps_server.replication.api import NO_ROW_REPLICATION, RowReplication
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.files import append_ids, export_table, load_tables, save_tables
from pshard.ps_server.tables.scheduled import ALL
from pshard.ps_server.tables.sync import OWN, PartitionClocks
from pshard.ps_server.tables.table import SparseTable

_ID = np.dtype("<i8")
# Ids and rows as the transports hand them: gRPC's bytes, or a fast path's view of its region.
Raw = bytes | np.ndarray
# A scheduled call's push (pshard.coordinator): (schedule id, push number, coordinator's floor); id 0: none.
Schedule = tuple[int, int, int]
NOT_SCHEDULED: Schedule = (0, 0, 0)
T = TypeVar("T")


class WriteFence(Protocol):
    """The server's lease (ps_server.handlers.dense.ParameterServerHandlers holds it, renews it and
    signals its renewals): None while the server follows no scheduler with replicas."""

    lease: SchedulerLease | None

    async def await_lease(self, what: str, deadline: float) -> None:
        """Until the lease holds (a write goes on), or FencedError once it lapsed."""
        ...


class _Unfenced:
    lease: SchedulerLease | None = None

    async def await_lease(self, what: str, deadline: float) -> None:
        return None
# Where the rows of a pull go: (table config, number of rows) -> a (rows, width) array of its row_layout.
Into = Callable[[TableConfig, int], np.ndarray]
# Tables per server: far more than any model has, few enough that hostile declarations cannot
# exhaust the server with empty tables (each holds a few KB of index).
MAX_TABLES = 1024
# Ids from which a request's table work leaves the event loop: below, a thread's hand-off costs more
# than the work (tens of microseconds); at 64 Ki ids the work is a few milliseconds, and a 2 Mi-id
# pull held the loop, and every health probe, for seconds.
OFF_LOOP_IDS = 1 << 16
# Servers that may share one --table-dir (each takes a locked server-N under it).
MAX_TABLE_DIR_SERVERS = 256


@dataclass(frozen=True)
class TableStats:
    rows: int
    evicted: int
    steps: int
    admitted: int = 0
    admission_bytes: int = 0  # the admission counts' fixed size (0: no admission by count)
    admission_halvings: int = 0
    row_bytes: int = 0  # a row's values as stored and pulled (row_dtype), optimizer state not counted
    # Tiers (memory_mb, ps_server/tables/disktier.py): rows and bytes in RAM and on disk, rows moved.
    ram_rows: int = 0
    ram_bytes: int = 0
    disk_rows: int = 0
    disk_bytes: int = 0
    spilled: int = 0
    fetched: int = 0


class TableHandlers:
    def __init__(self, settings: ServerSettings, now: Callable[[], float] = time.monotonic) -> None:
        """`now`: the clock of ttl in seconds (tests inject their own)."""
        self._settings = settings
        self._now = now
        self._tables: dict[str, SparseTable] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._sync: dict[str, PartitionClocks] = {}
        self._changed: dict[str, asyncio.Event] = {}  # set (and replaced) when a sync clock is applied
        self._quorum: dict[str, int] | None = dict(settings.static_quorum) if settings.static_quorum else None
        self._dir = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
        # With replicas (ps_server/replication/tables.py): rows changed go to the backups before a
        # push is acknowledged, and ids of row partitions served elsewhere are refused. Without, the
        # no-op of ps_server/replication/api.py: nothing to wait for, nothing refused.
        self.replication: RowReplication = NO_ROW_REPLICATION
        # The dense handlers' lease, once the server is wired (ps_server.service): table writes are
        # fenced as theirs are.
        self.fence: WriteFence = _Unfenced()
        self._table_dir: Path | None = None  # this server's part of --table-dir (the disk tiers)
        self._table_dir_lock: DirectoryLock | None = None
        if settings.table_dir:
            self._table_dir, self._table_dir_lock = _claim_table_dir(Path(settings.table_dir))
        if self._dir is not None:
            for table in load_tables(self._dir, settings.shard_name, self._make):
                self._add(table)

    def _add(self, table: SparseTable) -> None:
        name = table.config.name
        self._tables[name] = table
        self._locks[name] = asyncio.Lock()
        if table.config.mode == "sync":
            self._sync[name] = PartitionClocks()
            self._changed[name] = asyncio.Event()

    def _make(self, config: TableConfig) -> SparseTable:
        on_evict = None
        if config.log_evictions:
            if self._dir is None:
                raise InvalidArgumentError(f"table {config.name!r}: log_evictions needs a server started "
                                           "with --checkpoint-dir (the log is written there)")
            path = self._dir / f"{self._settings.shard_name}.{_file_name(config.name)}.evicted.txt"
            self._dir.mkdir(parents=True, exist_ok=True)
            on_evict = lambda ids: append_ids(path, ids)  # noqa: E731
        return SparseTable(config, now=self._now, on_evict=on_evict, store=self._store(config))

    def _store(self, config: TableConfig) -> Path | None:
        """The disk tier's directory of a table with memory_mb: under --table-dir, one per table."""
        if config.memory_mb == 0:
            return None
        if self._table_dir is None:
            raise InvalidArgumentError(f"table {config.name!r}: memory_mb {config.memory_mb:g} needs a "
                                       "server started with --table-dir (the rows beyond it spill there)")
        return self._table_dir / f"{_file_name(config.name)}.rows"

    def _served(self, name: str, what: str) -> SparseTable:
        """The table a pull or push of `name` reads or changes, once the layout places this server."""
        self.replication.placed(name, what)
        return self._table(name)

    def _table(self, name: str) -> SparseTable:
        table = self._tables.get(name)
        if table is None:
            raise UnknownKeyError(f"table {name[:256]!r} is not declared on this server (declare it first)")
        return table

    # ---- requests ----

    async def declare(self, config: TableConfig) -> bool:
        """Create the table; False if it exists with the same config (LayoutConflictError if not)."""
        if config.name not in self._tables:
            # The first table of a dtype compiles its loops, or loads them from numba's cache
            # (ps_server.tables.kernels): seconds or a fraction of one, on a thread, so the event loop
            # serves meanwhile. The checks below come after, as another declaration may have won.
            await asyncio.get_running_loop().run_in_executor(None, _warm_kernels, config)
        existing = self._tables.get(config.name)
        if existing is not None:
            if existing.config != config:
                raise LayoutConflictError(f"table {config.name!r}: declared as {existing.config}, "
                                          f"now as {config}")
            return False
        if len(self._tables) >= MAX_TABLES:
            raise QuotaExceededError(f"table {config.name!r}: this server holds {len(self._tables)} tables "
                                     f"already, the most it takes (MAX_TABLES)")
        self._add(self._make(config))
        return True

    def set_quorum(self, quorum: dict[str, int]) -> None:
        """Membership changed: a sync clock now complete (a member left) is applied, its pulls woken."""
        self._quorum = dict(quorum)
        for name in self._sync:
            asyncio.get_running_loop().create_task(self._apply_ready(name))

    async def _apply_ready(self, name: str) -> None:
        async with self._locks[name]:
            self._apply(name, self._sync[name].ready(self._quorum or {}))

    async def pull(self, name: str, ids: Raw, clock: int = 0, worker: str = "", into: Into | None = None
                   ) -> np.ndarray:
        """`into(config, n)`: where the n rows are written (a fast path's reply region), else a new array."""
        table = self._served(name, "pull")
        keys = self._ids(table, ids, "pull")
        await self._wait_applied(name, clock, keys)
        async with self._locks[name]:
            out = into(table.config, len(keys)) if into else None
            return await _run(table, len(keys), table.pull, keys, clock or None, out)

    async def push(self, name: str, ids: Raw, grads: Raw, clock: int = 0, worker: str = "",
                   push_id: int = 0, layout_version: int = 0, schedule: Schedule = NOT_SCHEDULED) -> int:
        """`push_id`: the push's idempotence key per worker (0: none); a repeat is dropped, stored 0.
        `layout_version`: the layout the worker routed the push with (0: none). `schedule`: a scheduled
        call's push, applied once per (schedule id, push number) whichever worker sends it."""
        table = self._served(name, "push")
        keys = self._ids(table, ids, "push")
        rows = self._grads(table, keys, grads)
        quorum = self._sync_quorum(name, worker)
        self._check_scheduled(name, worker, schedule)
        await self._await_lease(name, worker, clock)
        async with self._locks[name]:
            stored = await self._push(table, keys, rows, clock, worker, quorum, push_id, layout_version,
                                      schedule)
        # Acknowledged once the backups hold it, and while its partitions are still served here.
        await self.replication.settle(time.monotonic() + self._settings.pull_timeout_s)
        self.replication.kept(table, keys, "push")
        return stored

    async def push_pull(self, name: str, push_ids: Raw, grads: Raw, pull_ids: Raw, clock: int = 0,
                        worker: str = "", into: Into | None = None,
                        push_id: int = 0, layout_version: int = 0,
                        schedule: Schedule = NOT_SCHEDULED) -> tuple[int, np.ndarray]:
        """Push for `clock`, then pull: at clock + 1 in a sync table (the clock just pushed, applied)."""
        table = self._served(name, "push")
        keys = self._ids(table, push_ids, "push")
        rows = self._grads(table, keys, grads)
        wanted = self._ids(table, pull_ids, "pull")
        quorum = self._sync_quorum(name, worker)
        self._check_scheduled(name, worker, schedule)
        await self._await_lease(name, worker, clock)
        async with self._locks[name]:
            stored = await self._push(table, keys, rows, clock, worker, quorum, push_id, layout_version,
                                      schedule)
        if name in self._sync:
            clock += 1
            await self._wait_applied(name, clock, wanted)
        else:
            await self.replication.settle(time.monotonic() + self._settings.pull_timeout_s)
            self.replication.kept(table, keys, "push")
        async with self._locks[name]:
            out = into(table.config, len(wanted)) if into else None
            return stored, await _run(table, len(wanted), table.pull, wanted, clock or None, out)

    async def _push(self, table: SparseTable, keys: np.ndarray, rows: np.ndarray, clock: int, worker: str,
              quorum: dict[str, int] | None, push_id: int = 0, layout_version: int = 0,
              schedule: Schedule = NOT_SCHEDULED) -> int:
        name = table.config.name
        sync = self._sync.get(name)
        if sync is None or quorum is None:
            record = table.scheduled if schedule[0] else None
            partition = self.replication.partitions(keys) if record is not None else ALL
            if record is not None:
                # A re-dispatched call's push counts once per partition, as a resend does by its push key:
                # the rows of a partition that applied it on the call's first run are dropped, the others
                # (a partition the first run's push never reached before a failover) applied.
                fresh = record.fresh(*schedule, partition, keys)
                if fresh is not None:
                    if not fresh.any():
                        return 0
                    keys, rows = keys[fresh], rows[fresh]
            keep = self.replication.fresh(name, keys, worker, push_id)
            if keep is not None:  # applied before (a resend after a failover): those rows are done
                keys, rows = keys[keep], rows[keep]
            stored = (await _run(table, len(keys), table.push, keys, rows, clock or None)
                      if keep is None or len(keys) else 0)
            if record is not None:  # before `changed`: the record rides with the push's rows to the backups
                record.record(schedule[0], schedule[1], partition)
            self.replication.changed(name, keys, worker, push_id)
            return stored
        self.replication.routed(name, layout_version)  # before anything is recorded
        self._apply(name, sync.push(clock, worker, keys, rows, *self._partitioned(keys), quorum))
        return len(keys)

    async def _await_lease(self, name: str, worker: str, clock: int) -> None:
        """A push goes on only while the server's lease holds (after validation: a refused request
        waits for nothing). The words of a refusal are made only when it has expired: every push asks."""
        lease = self.fence.lease
        if lease is None or not lease.expired():
            return
        await self.fence.await_lease(f"push to table {name!r} by {worker[:256]!r} at clock {clock}",
                                     time.monotonic() + self._settings.pull_timeout_s)

    def _apply(self, name: str, updates: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
        table = self._tables[name]
        for ids, mean, clock in updates:
            table.push(ids, mean, clock or None)
            self.replication.changed(name, ids, clocked=True)  # the rows, and the partition's applied clock
        if updates:
            self._changed[name].set()
            self._changed[name] = asyncio.Event()

    def _check_scheduled(self, name: str, worker: str, schedule: Schedule) -> None:
        """Scheduled calls run on any worker, whenever one is free: only an async table takes their pushes."""
        if schedule[0] and name in self._sync:
            raise InvalidArgumentError(
                f"schedule_id: worker {worker[:256]!r} pushed for scheduled call {schedule[0]} to sync table "
                f"{name!r}; a ClusterCoordinator's tables are async (TableConfig mode 'async')")

    def _sync_quorum(self, name: str, worker: str) -> dict[str, int] | None:
        """The quorum a push to sync table `name` counts in (None: not a sync table); refusals name why."""
        if name not in self._sync:
            return None
        if not worker:
            raise InvalidArgumentError(f"push of sync table {name!r}: no worker_id (a sync table waits for "
                                       "each worker's push of every clock)")
        if self._quorum is None:
            raise StaleGenerationError(f"push of sync table {name!r}: this server knows no quorum yet (start "
                                       "it with --workers, or with a scheduler)")
        if worker not in self._quorum:
            raise StaleGenerationError(f"push of sync table {name!r}: worker {worker[:256]!r} is not in the "
                                       f"quorum {sorted(self._quorum)}")
        return self._quorum

    def _partitioned(self, keys: np.ndarray) -> tuple[int | np.ndarray, Collection[int]]:
        """The row partition of each of `keys` (one number when all are in one), and the partitions
        served here: OWN for both while this server knows no layout (or replicates nothing)."""
        served = self.replication.served()
        if served is None:
            return OWN, (OWN,)
        return self.replication.partitions(keys), served

    def _partitions(self, keys: np.ndarray) -> set[int]:
        """The row partitions of `keys` (all those served here when there are none)."""
        partition, served = self._partitioned(keys)
        if not len(keys):
            return set(served)
        return {partition} if isinstance(partition, int) else set(np.unique(partition).tolist())

    async def _wait_applied(self, name: str, clock: int, keys: np.ndarray) -> None:
        """Until every clock below `clock` of sync table `name` is applied in the row partitions of
        `keys` (async tables: at once)."""
        sync = self._sync.get(name)
        if sync is None:
            return
        deadline = time.monotonic() + self._settings.pull_timeout_s
        partitions = self._partitions(keys)
        table = self._tables.get(name)
        while (behind := sync.behind(clock, partitions)) is not None:
            if table is not None:  # moved away while it waited: the worker pushes that clock elsewhere
                self.replication.kept(table, keys, f"pull at clock {clock}")
            lease = self.fence.lease
            if lease is not None and lease.lapsed():  # fenced for good: no push completes the clock here
                lease.check(f"pull of sync table {name!r} at clock {clock}")
            lapses_at = lease.lapses_at if lease is not None else None
            left = min(deadline, lapses_at if lapses_at is not None else deadline) - time.monotonic()
            try:
                await asyncio.wait_for(self._changed[name].wait(), max(left, 0.0))
            except TimeoutError:
                if lapses_at is not None and time.monotonic() < deadline:
                    continue  # the lease's lapse, unless renewed meanwhile: checked above
                partition, applied = behind
                where = "" if partition == OWN else f" of row partition {partition}"
                raise PullTimeoutError(
                    f"pull of sync table {name!r} at clock {clock}: clock {applied}{where} still waits for "
                    f"{sync.waiting_for(partition, applied, self._quorum or {})} after "
                    f"{self._settings.pull_timeout_s:.1f}s") from None
        await self.replication.settle(deadline)  # a clock's update is read once its backups hold it
        if table is not None:
            # A partition a move or a join took meanwhile: this server may have applied a clock its new
            # server's copy lacks (it refused the rows). Refused, so the worker keeps its pushes of that
            # clock, re-routes and sends them there again, rather than reading them here and dropping them.
            self.replication.kept(table, keys, f"pull at clock {clock}")

    async def export(self, name: str) -> tuple[Path, Path, int]:
        table = self._table(name)
        if self._dir is None:
            raise InvalidArgumentError(f"export of table {name!r}: this server was started without "
                                       "--checkpoint-dir (exports are written there)")
        folder = self._dir / "export" / f"{self._settings.shard_name}.{_file_name(name)}"
        async with self._locks[name]:
            return await asyncio.get_running_loop().run_in_executor(None, export_table, table, folder)

    def tables(self) -> list[SparseTable]:
        return list(self._tables.values())

    def find(self, name: str) -> SparseTable | None:
        return self._tables.get(name)

    def sync_applied(self, name: str) -> dict[int, int] | None:
        """A sync table's first clock not applied per row partition (None: not a sync table)."""
        sync = self._sync.get(name)
        return None if sync is None else sync.applied()

    def adopt_sync(self, name: str, applied: dict[int, int]) -> None:
        """Serve a failover's partitions of sync table `name` from their replicated applied clocks."""
        sync = self._sync.get(name)
        if sync is not None:
            sync.adopt(applied)

    def number_own(self, partition: int) -> None:
        """The layout told this server its partition's number (ps_server/replication/tables.py)."""
        for sync in self._sync.values():
            sync.number_own(partition)

    def moved_away(self) -> None:
        """Row partitions moved from this server (a layout): the sync pulls waiting for a clock look again,
        and those of a moved partition are refused (`_wait_applied`), since no push of it comes here now."""
        for name, changed in list(self._changed.items()):
            changed.set()
            self._changed[name] = asyncio.Event()

    def make(self, config: TableConfig) -> SparseTable:
        """An empty table as a Declare would create it (a global checkpoint's restore fills it)."""
        return self._make(config)

    def add(self, table: SparseTable) -> None:
        """Hold a restored table (a global checkpoint's); replaces none: the server held no model."""
        if table.config.name in self._tables:
            raise InvalidArgumentError(f"table {table.config.name!r} is already declared on this server")
        self._add(table)

    @contextlib.asynccontextmanager
    async def all_locked(self) -> AsyncIterator[list[SparseTable]]:
        """Every table, each under its lock (taken in name order, as checkpoint() does)."""
        names = sorted(self._tables)
        for name in names:
            await self._locks[name].acquire()
        try:
            yield [self._tables[n] for n in names]
        finally:
            for name in names:
                self._locks[name].release()

    async def checkpoint(self) -> Path | None:
        """Save every table (None: no checkpoint directory, or no tables)."""
        if self._dir is None or not self._tables:
            return None
        names = sorted(self._tables)
        for name in names:  # in name order, so two checkpoints cannot deadlock
            await self._locks[name].acquire()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, save_tables, self._dir, self._settings.shard_name, [self._tables[n] for n in names])
        except OSError as err:  # a full or read-only disk: its errno, not UNKNOWN
            raise checkpoint_write_error(err, self._dir) from None
        finally:
            for name in names:
                self._locks[name].release()

    def stats(self, name: str) -> TableStats:
        table = self._table(name)
        sketch = table.admission
        return TableStats(rows=len(table), evicted=table.evicted, steps=table.step, admitted=table.admitted,
                          admission_bytes=sketch.nbytes if sketch else 0,
                          admission_halvings=sketch.epoch if sketch else 0,
                          row_bytes=table.config.row_bytes, **dataclasses.asdict(table.tiers()))

    def all_stats(self) -> dict[str, TableStats]:
        """Every table's stats by name (the metrics endpoint reads them at scrape time)."""
        return {name: self.stats(name) for name in sorted(self._tables)}

    # ---- validation ----

    def _ids(self, table: SparseTable, raw: Raw, what: str) -> np.ndarray:
        name = table.config.name
        if len(raw) % 8:
            raise InvalidArgumentError(f"{what} of table {name!r}: ids are {len(raw)} bytes, not a whole "
                                       "number of int64s (8 bytes each)")
        limit = self._settings.limits.max_request_bytes
        if len(raw) > limit or (len(raw) // 8) * table.config.dim * table.config.np_dtype.itemsize > limit:
            raise MessageTooLargeError(f"{what} of table {name!r}: {len(raw) // 8} ids of dim "
                                       f"{table.config.dim} exceed the request limit of {limit} bytes")
        ids = np.frombuffer(raw, _ID)
        # Clients send each server's ids ascending: strictly ascending ids are distinct, checked
        # in one pass; only other orders pay for a sort.
        if not table.kernels.ascending(ids):
            ordered = np.sort(ids)
            repeats = ordered[1:] == ordered[:-1]
            if repeats.any():
                raise InvalidArgumentError(f"{what} of table {name!r}: id {int(ordered[1:][repeats][0])} "
                                           "appears more than once (send each id once, gradients summed)")
        self.replication.check(table, ids, what)  # ids of a partition another server serves (a failover)
        return ids  # read-only (gRPC's bytes) or a view of a fast path's region: the tables keep no reference

    def _grads(self, table: SparseTable, ids: np.ndarray, raw: Raw) -> np.ndarray:
        config = table.config
        size = config.grad_dtype.itemsize
        row_bytes = config.dim * size
        if len(raw) != len(ids) * row_bytes:
            per_id = f" ({len(raw) / len(ids) / size:g} numbers per id)" if len(ids) else ""
            sent = config.dtype if config.compression == "none" else f"{config.compression} (compression)"
            raise InvalidArgumentError(
                f"push of table {config.name!r}: {len(ids)} ids need {len(ids)} rows of dim {config.dim} "
                f"{sent} ({len(ids) * row_bytes} bytes), got {len(raw)} bytes{per_id}")
        wire = np.frombuffer(raw, config.grad_dtype.newbyteorder("<")).reshape(len(ids), config.dim)
        grads = decode_grads(config, wire)  # widened to float32: the update is exact in float32
        # One compiled pass over the bits (a third of numpy's sum, which was a third of a push's time);
        # only a refusal pays for finding the first id to blame.
        if not config.allow_nonfinite and not table.kernels.all_finite(grads):
            i = int(np.flatnonzero(~np.isfinite(grads).all(axis=1))[0])
            raise InvalidArgumentError(f"push of table {config.name!r}: the gradient of id {int(ids[i])} "
                                       f"holds {grads[i][~np.isfinite(grads[i])][0]} (the table does not "
                                       "allow non-finite gradients)")
        return grads


async def _run(table: SparseTable, n: int, work: Callable[..., T], *args: object) -> T:
    """`work(*args)` on table `table` for a request of `n` ids: on the loop, or on a worker thread when
    large. The caller holds the table's lock; the thread's run is awaited to its end even when the
    caller is cancelled meanwhile (the lock must not be released while the thread changes the table),
    and the cancellation is then raised. Evictions reach the table's evict_hook back on the loop."""
    if n < OFF_LOOP_IDS:
        return work(*args)
    with table.hooks_held():
        done = asyncio.get_running_loop().run_in_executor(None, work, *args)
        cancelled: asyncio.CancelledError | None = None
        while not done.done():
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError as e:
                if done.done() and done.cancelled():
                    raise
                cancelled = e
        if cancelled is not None:
            raise cancelled
        return done.result()


def _warm_kernels(config: TableConfig) -> None:
    from pshard.ps_server.tables import kernels  # numba is loaded by servers that hold a table only

    kernels.warm(config.np_dtype)
    if config.narrow:  # the compiled pushes of narrow rows (SparseTable uses them for sgd and adagrad)
        from pshard.ps_server.tables import narrow_kernels

        narrow_kernels.warm(config.row_dtype)


def _claim_table_dir(table_dir: Path) -> tuple[Path, DirectoryLock]:
    """The first `server-N` under --table-dir that no live process holds, locked, its old disk tiers
    deleted: servers of one host may share a --table-dir (their checkpoint files are all named "shard"),
    and a crashed server's tiers are caches that mean nothing now."""
    for n in range(MAX_TABLE_DIR_SERVERS):
        sub = table_dir / f"server-{n}"
        sub.mkdir(parents=True, exist_ok=True)
        try:
            lock = DirectoryLock.acquire(sub, {"role": "ps"}, flag="--table-dir")
        except DirectoryInUseError:
            continue
        for old in sub.glob("*.rows"):
            shutil.rmtree(old, ignore_errors=True)
        return sub, lock
    raise DirectoryInUseError(f"--table-dir: {str(table_dir)!r} is in use by {MAX_TABLE_DIR_SERVERS} "
                              "servers; give this one another directory")


def _file_name(name: str) -> str:
    """A file name for a table name of any characters: its safe part and a crc of the whole."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)[:64]}-{zlib.crc32(name.encode()):08x}"
