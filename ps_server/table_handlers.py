"""What a parameter server does with a sparse-table request, whatever transport brought it.

Requests carry ids as raw int64 bytes and rows as raw bytes of the table's dtype (the wire format
of proto/pshard/api/v1/sparse.proto). Each request is validated whole before anything moves:
ids a whole number of int64s, distinct, within the request limit; gradients exactly one row of
`dim` numbers per id and finite unless the table allows otherwise; the table declared. A refusal
names the table (and the id, when one is to blame) and leaves the table unchanged.

Requests of one table are serialised by an asyncio lock; they run on the event loop (a request
of a few thousand rows is a few vectorised numpy passes). Checkpoints and exports hold the lock
and write from a worker thread, so the loop keeps serving other tables meanwhile.
"""

from __future__ import annotations

import asyncio
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pshard.common.errors import (
    InvalidArgumentError,
    LayoutConflictError,
    MessageTooLargeError,
    QuotaExceededError,
    UnknownKeyError,
)
from pshard.common.sparse import TableConfig
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.table import SparseTable
from pshard.ps_server.table_files import append_ids, export_table, load_tables, save_tables

_ID = np.dtype("<i8")
# Tables per server: far more than any model has, few enough that hostile declarations cannot
# exhaust the server with empty tables (each holds a few KB of index).
MAX_TABLES = 1024


@dataclass(frozen=True)
class TableStats:
    rows: int
    evicted: int
    steps: int


class TableHandlers:
    def __init__(self, settings: ServerSettings, now: Callable[[], float] = time.monotonic) -> None:
        """`now`: the clock of ttl in seconds (tests inject their own)."""
        self._settings = settings
        self._now = now
        self._tables: dict[str, SparseTable] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._dir = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
        if self._dir is not None:
            for table in load_tables(self._dir, settings.shard_name, self._make):
                self._tables[table.config.name] = table
                self._locks[table.config.name] = asyncio.Lock()

    def _make(self, config: TableConfig) -> SparseTable:
        on_evict = None
        if config.log_evictions:
            if self._dir is None:
                raise InvalidArgumentError(f"table {config.name!r}: log_evictions needs a server started "
                                           "with --checkpoint-dir (the log is written there)")
            path = self._dir / f"{self._settings.shard_name}.{_file_name(config.name)}.evicted.txt"
            self._dir.mkdir(parents=True, exist_ok=True)
            on_evict = lambda ids: append_ids(path, ids)  # noqa: E731
        return SparseTable(config, now=self._now, on_evict=on_evict)

    def _table(self, name: str) -> SparseTable:
        table = self._tables.get(name)
        if table is None:
            raise UnknownKeyError(f"table {name[:256]!r} is not declared on this server (declare it first)")
        return table

    # ---- requests ----

    async def declare(self, config: TableConfig) -> bool:
        """Create the table; False if it exists with the same config (LayoutConflictError if not)."""
        existing = self._tables.get(config.name)
        if existing is not None:
            if existing.config != config:
                raise LayoutConflictError(f"table {config.name!r}: declared as {existing.config}, "
                                          f"now as {config}")
            return False
        if len(self._tables) >= MAX_TABLES:
            raise QuotaExceededError(f"table {config.name!r}: this server holds {len(self._tables)} tables "
                                     f"already, the most it takes (MAX_TABLES)")
        self._tables[config.name] = self._make(config)
        self._locks[config.name] = asyncio.Lock()
        return True

    async def pull(self, name: str, ids: bytes, clock: int = 0) -> np.ndarray:
        table = self._table(name)
        keys = self._ids(table, ids, "pull")
        async with self._locks[name]:
            return table.pull(keys, clock or None)

    async def push(self, name: str, ids: bytes, grads: bytes, clock: int = 0) -> int:
        table = self._table(name)
        keys = self._ids(table, ids, "push")
        rows = self._grads(table, keys, grads)
        async with self._locks[name]:
            return table.push(keys, rows, clock or None)

    async def push_pull(self, name: str, push_ids: bytes, grads: bytes, pull_ids: bytes,
                        clock: int = 0) -> tuple[int, np.ndarray]:
        table = self._table(name)
        keys = self._ids(table, push_ids, "push")
        rows = self._grads(table, keys, grads)
        wanted = self._ids(table, pull_ids, "pull")
        async with self._locks[name]:
            stored = table.push(keys, rows, clock or None)
            return stored, table.pull(wanted, clock or None)

    async def export(self, name: str) -> tuple[Path, Path, int]:
        table = self._table(name)
        if self._dir is None:
            raise InvalidArgumentError(f"export of table {name!r}: this server was started without "
                                       "--checkpoint-dir (exports are written there)")
        folder = self._dir / "export" / f"{self._settings.shard_name}.{_file_name(name)}"
        async with self._locks[name]:
            return await asyncio.get_running_loop().run_in_executor(None, export_table, table, folder)

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
        finally:
            for name in names:
                self._locks[name].release()

    def stats(self, name: str) -> TableStats:
        table = self._table(name)
        return TableStats(rows=len(table), evicted=table.evicted, steps=table.step)

    # ---- validation ----

    def _ids(self, table: SparseTable, raw: bytes, what: str) -> np.ndarray:
        name = table.config.name
        if len(raw) % 8:
            raise InvalidArgumentError(f"{what} of table {name!r}: ids are {len(raw)} bytes, not a whole "
                                       "number of int64s (8 bytes each)")
        limit = self._settings.limits.max_request_bytes
        if len(raw) > limit or (len(raw) // 8) * table.config.dim * table.config.np_dtype.itemsize > limit:
            raise MessageTooLargeError(f"{what} of table {name!r}: {len(raw) // 8} ids of dim "
                                       f"{table.config.dim} exceed the request limit of {limit} bytes")
        ids = np.frombuffer(raw, _ID)
        if len(ids) > 1:
            ordered = np.sort(ids)
            repeats = ordered[1:] == ordered[:-1]
            if repeats.any():
                raise InvalidArgumentError(f"{what} of table {name!r}: id {int(ordered[1:][repeats][0])} "
                                           "appears more than once (send each id once, gradients summed)")
        return ids.astype(np.int64)

    def _grads(self, table: SparseTable, ids: np.ndarray, raw: bytes) -> np.ndarray:
        config = table.config
        row_bytes = config.dim * config.np_dtype.itemsize
        if len(raw) != len(ids) * row_bytes:
            size = config.np_dtype.itemsize
            per_id = f" ({len(raw) / len(ids) / size:g} numbers per id)" if len(ids) else ""
            raise InvalidArgumentError(
                f"push of table {config.name!r}: {len(ids)} ids need {len(ids)} rows of dim {config.dim} "
                f"{config.dtype} ({len(ids) * row_bytes} bytes), got {len(raw)} bytes{per_id}")
        grads = np.frombuffer(raw, config.np_dtype.newbyteorder("<")).reshape(len(ids), config.dim)
        if not config.allow_nonfinite:
            bad = ~np.isfinite(grads).all(axis=1)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgumentError(f"push of table {config.name!r}: the gradient of id {int(ids[i])} "
                                           f"holds {grads[i][~np.isfinite(grads[i])][0]} (the table does not "
                                           "allow non-finite gradients)")
        return grads


def _file_name(name: str) -> str:
    """A file name for a table name of any characters: its safe part and a crc of the whole."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)[:64]}-{zlib.crc32(name.encode()):08x}"
