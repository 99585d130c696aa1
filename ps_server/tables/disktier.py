"""The disk tier of a sparse table: the rows that do not fit its `memory_mb` (issue 22).

RAM is the cache. A table (ps_server.tables.table) keeps its hottest rows in its arrays and, past its
budget, spills the coldest by cap_policy's stamps (the last touch for lru, the update count for lfu)
here; a request that names a spilled id fetches it back into RAM before anything else, so every
request works on RAM rows with the same arithmetic, and pulls and pushes give the same values bit for
bit whatever the tier of each row.

A spilled row is one record: its stored values (row_dtype's bytes, as they are), its optimizer state and
lazy Adam's step count, packed side by side (`RecordLayout`), in a slab: one file of fixed-size records,
memory-mapped, the record of the row at directory slot s at s x record bytes. The directory is an
IdIndex of the spilled ids (its row numbers are the slots, freed ones reused first) with each row's
touch and count by slot, in RAM (about 27 bytes a row): eviction (ttl, max_rows) and the choice of what
to spill read no disk, an id that is on neither tier costs no disk read, and a spill or a fetch of
thousands of rows is one numpy scatter or gather into the map.

Why a slab of our own rather than LMDB or RocksDB: both were tried or weighed. py-lmdb (3.0.0) takes and
returns a Python bytes object per row (getmulti, putmulti): in the disk tier's bench (bench.disk_tier, a
table 4x its memory_mb, zipf ids) it moved 0.24x the rows/s of the same table in RAM, its servers spending
22 ms of CPU a step against 3; rocksdict is the same per-key Python interface over a 30 MB library with
compaction threads and a write-ahead log that a cache has no use for. A cache of fixed-size rows keyed
by an index the table already has needs neither a B-tree nor an LSM tree: the slab is the records, the
IdIndex the keys. Its blocks are allocated when it grows (posix_fallocate), so a full disk is an error
at a spill (QuotaExceededError), not a SIGBUS at a write into the map.

A cache, not durability: nothing is fsync'ed, and the directory is wiped when the table is made, so a
restart starts the tier empty and rebuilds the rows from the checkpoint.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pshard.common.errors import QuotaExceededError
from pshard.common.sparse import put_rows, take_rows
from pshard.ps_server.tables.rowhash import IdIndex

# RAM a spilled row keeps: its id (8), directory slots (int32 at <= 60% load: ~7), touch (8), count (4).
DIRECTORY_BYTES = 27
_STAMPS = ("touch", "count")
# Records the slab file holds at first; it doubles when the spilled rows outgrow it.
_FIRST_SLAB_ROWS = 1 << 12
_EMPTY_SLAB = np.zeros((0, 0), np.uint8)


@dataclass(frozen=True)
class TierStats:
    """Where a table's rows are: rows and bytes on each tier, rows spilled and fetched so far."""

    ram_rows: int
    ram_bytes: int  # the rows' values, optimizer state and stamps (the index not counted)
    disk_rows: int = 0
    disk_bytes: int = 0  # the spilled rows' records (the slab also keeps the room of freed slots)
    spilled: int = 0
    fetched: int = 0


@dataclass(frozen=True)
class RecordLayout:
    """Where each per-row column of a table (SparseTable.columns(), but its stamps) lies in a record."""

    fields: tuple[tuple[str, np.dtype, tuple[int, ...], int, int], ...]  # name, dtype, row shape, start, stop

    @classmethod
    def of(cls, columns: dict[str, tuple[np.ndarray, tuple[int, ...]]]) -> RecordLayout:
        fields, at = [], 0
        for name, (array, shape) in sorted(columns.items()):
            if name in _STAMPS:
                continue
            size = array.dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            fields.append((name, array.dtype, shape, at, at + size))
            at += size
        return cls(tuple(fields))

    @property
    def record_bytes(self) -> int:
        return self.fields[-1][4] if self.fields else 0

    def pack(self, columns: dict[str, tuple[np.ndarray, tuple[int, ...]]], rows: np.ndarray) -> np.ndarray:
        """(len(rows), record_bytes) uint8: the columns' values of `rows`, side by side."""
        out = np.empty((len(rows), self.record_bytes), np.uint8)
        for name, _, _, start, stop in self.fields:
            array = columns[name][0]
            values = take_rows(array, rows) if array.ndim == 2 else array[rows]
            out[:, start:stop] = values.view(np.uint8).reshape(len(rows), -1)
        return out

    def unpack(self, records: np.ndarray) -> dict[str, np.ndarray]:
        """The columns' values of each record (names as SparseTable.columns())."""
        n = len(records)
        return {name: np.ascontiguousarray(records[:, start:stop]).view(dtype).reshape((n, *shape))
                for name, dtype, shape, start, stop in self.fields}


class DiskTier:
    """Spilled rows of one table: records in a slab file at `path` (wiped at creation), stamps in RAM."""

    def __init__(self, path: Path, layout: RecordLayout) -> None:
        self.path = path
        self.layout = layout
        shutil.rmtree(path, ignore_errors=True)  # a cache: what a previous process left means nothing
        try:
            path.mkdir(parents=True)
            self._file = open(path / "rows.slab", "w+b")  # noqa: SIM115 (the map needs it: kept for the table's life)
        except OSError as err:
            raise QuotaExceededError(f"disk tier {path}: cannot create it ({err.strerror or err}); check "
                                     "that --table-dir is writable and has room") from None
        self.index = IdIndex()  # spilled id -> its slot: its record's place in the slab, its stamps'
        self.touch = np.zeros(self.index.row_capacity, np.float64)
        self.count = np.zeros(self.index.row_capacity, np.int32)
        self._slab = np.zeros((0, layout.record_bytes), np.uint8)
        self._map: mmap.mmap | None = None  # the slab file's map, once it has records
        self.spilled = 0  # rows written here, ever
        self.fetched = 0  # rows read back into RAM, ever

    def __len__(self) -> int:
        return len(self.index)

    @property
    def bytes(self) -> int:
        """Bytes of the records of the rows held here (the slab is as large as the most ever held)."""
        return len(self.index) * self.layout.record_bytes

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Directory slot of each id, -1 where it is not here."""
        return self.index.lookup(ids)

    def put(self, ids: np.ndarray, records: np.ndarray, touch: np.ndarray, count: np.ndarray) -> None:
        """Hold `ids` (distinct, not here) with their records and stamps. QuotaExceededError naming the
        store if the disk has no room; then nothing is held and the caller keeps its rows."""
        free = self.index.high - len(self.index)  # slots below `high` not held: reused first
        self._reserve(self.index.high + max(0, len(ids) - free))
        slots = self.index.insert(ids)
        if len(self.touch) < self.index.row_capacity:
            self.touch = _grown(self.touch, self.index.row_capacity)
            self.count = _grown(self.count, self.index.row_capacity)
        put_rows(self._slab, slots, np.ascontiguousarray(records))
        self.touch[slots] = touch
        self.count[slots] = count
        self.spilled += len(ids)

    def _reserve(self, rows: int) -> None:
        """A slab of at least `rows` records, doubling; its blocks allocated now (posix_fallocate), so that
        a full disk refuses here, as an error, rather than as a SIGBUS at a write into the map."""
        if rows <= len(self._slab):
            return
        size = max(rows, 2 * len(self._slab), _FIRST_SLAB_ROWS)
        record = self.layout.record_bytes
        try:
            os.posix_fallocate(self._file.fileno(), 0, size * record)
        except OSError as err:
            raise QuotaExceededError(f"disk tier {self.path}: no room for {size} rows of {record} bytes "
                                     f"({err.strerror or err}); give --table-dir more room, or the table "
                                     "more memory_mb") from None
        if self._map is None:
            self._map = mmap.mmap(self._file.fileno(), size * record)  # shared, read and write
        else:
            # Grown in place (mremap): the pages the process mapped stay mapped. A fresh map of the grown
            # file faulted each page again at its first write (ext4: 1.7 us a page): a disk-tier server
            # spent 4x the CPU in its spills of the hundred requests after a growth (bench.disk_tier's
            # timed steps follow its fill's last growth). The map cannot move while an array views it: the
            # table keeps none (reads are copies), and the slab's view is dropped meanwhile.
            old, self._slab, grown = len(self._slab), _EMPTY_SLAB, False
            try:
                self._map.resize(size * record)
                grown = True
            except OSError as err:
                raise QuotaExceededError(f"disk tier {self.path}: cannot map {size} rows of {record} bytes "
                                         f"({err.strerror or err}); give the table more memory_mb") from None
            finally:
                self._slab = self._view(size if grown else old)
            return
        self._slab = self._view(size)

    def _view(self, rows: int) -> np.ndarray:
        """The slab's first `rows` records, a plain ndarray over the map (np.memmap's own indexing took 12x
        as long to gather a request's rows)."""
        assert self._map is not None
        record = self.layout.record_bytes
        return np.frombuffer(self._map, np.uint8, rows * record).reshape(rows, record)

    def read(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Every column of the rows at `slots`, stamps included, as the table's columns name them."""
        columns = self.layout.unpack(take_rows(self._slab, slots))
        columns["touch"], columns["count"] = self.touch[slots], self.count[slots]
        return columns

    def take(self, slots: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(ids, columns) of the rows at `slots`, which leave the tier (their slots are reused)."""
        ids = self.index.ids[slots].copy()
        columns = self.read(slots)
        self.index.delete_rows(slots)
        self.fetched += len(slots)
        return ids, columns

    def drop(self, slots: np.ndarray) -> np.ndarray:
        """Forget the rows at `slots` (evictions); their ids."""
        ids = self.index.ids[slots].copy()
        self.index.delete_rows(slots)
        return ids

    def chunks(self, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(slots, ids) of the rows held here, `rows` directory slots at a time."""
        for start in range(0, self.index.high, rows):
            slots = self.index.live_rows(start, start + rows)
            if len(slots):
                yield slots, self.index.ids[slots]


def _grown(a: np.ndarray, need: int) -> np.ndarray:
    out = np.zeros(max(need, 2 * len(a)), a.dtype)
    out[: len(a)] = a
    return out
