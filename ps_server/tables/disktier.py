"""The disk tier of a sparse table: the rows that do not fit its `memory_mb` (issue 22).

RAM is the cache. A table (ps_server.tables.table) keeps its hottest rows in its arrays and, past its
budget, spills the coldest by cap_policy's stamps (the last touch for lru, the update count for lfu)
here; a request that names a spilled id fetches it back into RAM before anything else, so every
request works on RAM rows with the same arithmetic, and pulls and pushes give the same values bit for
bit whatever the tier of each row.

A spilled row is one record: its stored values (row_dtype's bytes, as they are), its optimizer state and
lazy Adam's step count, packed side by side (`RecordLayout`), in LMDB under the id's 8 big-endian bytes.
Its touch and count stay in RAM, in a directory (an IdIndex of the spilled ids, and the two stamps by
directory slot: about 27 bytes a row), so that eviction (ttl, max_rows) and the choice of what to spill
read no disk, and an id that is on neither tier costs no disk read either.

Why LMDB (py-lmdb): a memory-mapped B+tree in one C library, with no background threads and no
compaction to tune or to compete with the server for its cores; a batch of reads is one read
transaction (getmulti) served from the page cache when the store is warm, a spill one write
transaction (putmulti). RocksDB (rocksdict) takes random writes faster, but brings a 30 MB library,
compaction threads and a write-ahead log that a cache has no use for.

A cache, not durability: the store is written without fsync (sync=False) and wiped when the table is
made, so a restart starts it empty and rebuilds the rows from the checkpoint. A fetched row's record
stays on disk (a fetch costs a read, not a write) until the row is spilled again, which overwrites it,
or evicted, which deletes it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
from pshard.common.errors import QuotaExceededError
from pshard.ps_server.tables.rowhash import IdIndex

# LMDB's address space for a store: a reservation, not an allocation (the file grows as rows are written).
_MAP_BYTES = 1 << 40
# RAM a spilled row keeps: its id (8), directory slots (int32 at <= 60% load: ~7), touch (8), count (4).
DIRECTORY_BYTES = 27
_STAMPS = ("touch", "count")


@dataclass(frozen=True)
class TierStats:
    """Where a table's rows are: rows and bytes on each tier, rows spilled and fetched so far."""

    ram_rows: int
    ram_bytes: int  # the rows' values, optimizer state and stamps (the index not counted)
    disk_rows: int = 0
    disk_bytes: int = 0  # the spilled rows' records (the store's file also holds free pages)
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
            values = np.ascontiguousarray(columns[name][0][rows])
            out[:, start:stop] = values.view(np.uint8).reshape(len(rows), -1)
        return out

    def unpack(self, records: np.ndarray) -> dict[str, np.ndarray]:
        """The columns' values of each record (names as SparseTable.columns())."""
        n = len(records)
        return {name: np.ascontiguousarray(records[:, start:stop]).view(dtype).reshape((n, *shape))
                for name, dtype, shape, start, stop in self.fields}


class DiskTier:
    """Spilled rows of one table: records in LMDB at `path` (wiped at creation), stamps in RAM."""

    def __init__(self, path: Path, layout: RecordLayout) -> None:
        self.path = path
        self.layout = layout
        shutil.rmtree(path, ignore_errors=True)  # a cache: what a previous process left means nothing
        try:
            path.mkdir(parents=True)
            self._env = lmdb.open(str(path), map_size=_MAP_BYTES, subdir=True, sync=False, metasync=False,
                                  readahead=False, lock=False, max_dbs=0)
        except (OSError, lmdb.Error) as err:
            raise QuotaExceededError(f"disk tier {path}: cannot create it ({type(err).__name__}: {err}); "
                                     "check that --table-dir is writable and has room") from None
        self.index = IdIndex()
        self.touch = np.zeros(self.index.row_capacity, np.float64)
        self.count = np.zeros(self.index.row_capacity, np.int32)
        self.spilled = 0  # rows written here, ever
        self.fetched = 0  # rows read back into RAM, ever

    def __len__(self) -> int:
        return len(self.index)

    @property
    def bytes(self) -> int:
        """Bytes of the records of the rows held here (the file also holds free pages and stale records)."""
        return len(self.index) * self.layout.record_bytes

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Directory slot of each id, -1 where it is not here."""
        return self.index.lookup(ids)

    def put(self, ids: np.ndarray, records: np.ndarray, touch: np.ndarray, count: np.ndarray) -> None:
        """Hold `ids` (distinct, not here) with their records and stamps. QuotaExceededError naming the
        store if the disk refuses the write; then nothing is held and the caller keeps its rows."""
        keys = _keys(ids)
        values = np.ascontiguousarray(records).view(f"V{self.layout.record_bytes}").ravel().tolist()
        try:
            with self._env.begin(write=True) as txn:
                txn.cursor().putmulti(list(zip(keys, values, strict=True)))
        except (OSError, lmdb.Error) as err:
            raise QuotaExceededError(f"disk tier {self.path}: cannot write {len(ids)} rows "
                                     f"({type(err).__name__}: {err}); give --table-dir more room, "
                                     "or the table more memory_mb") from None
        slots = self.index.insert(ids)
        if len(self.touch) < self.index.row_capacity:
            self.touch = _grown(self.touch, self.index.row_capacity)
            self.count = _grown(self.count, self.index.row_capacity)
        self.touch[slots] = touch
        self.count[slots] = count
        self.spilled += len(ids)

    def read(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Every column of the rows at `slots`, stamps included, as the table's columns name them."""
        keys = _keys(self.index.ids[slots])
        with self._env.begin() as txn:
            found = txn.cursor().getmulti(keys)
        if len(found) != len(keys):  # the directory and the store disagree: a bug, not an input
            raise RuntimeError(f"disk tier {self.path}: {len(keys) - len(found)} of {len(keys)} rows missing")
        raw = np.frombuffer(b"".join(value for _, value in found), np.uint8)
        columns = self.layout.unpack(raw.reshape(len(keys), self.layout.record_bytes))
        columns["touch"], columns["count"] = self.touch[slots], self.count[slots]
        return columns

    def take(self, slots: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(ids, columns) of the rows at `slots`, which leave the directory (their records stay)."""
        ids = self.index.ids[slots].copy()
        columns = self.read(slots)
        self.index.delete_rows(slots)
        self.fetched += len(slots)
        return ids, columns

    def drop(self, slots: np.ndarray) -> np.ndarray:
        """Forget the rows at `slots`, records too (evictions); their ids."""
        ids = self.index.ids[slots].copy()
        self.index.delete_rows(slots)
        self.forget(ids)
        return ids

    def forget(self, ids: np.ndarray) -> None:
        """Delete any record of `ids` (evicted rows: a fetched row's record stays until then)."""
        if self.spilled == 0 or len(ids) == 0:
            return
        with self._env.begin(write=True) as txn:
            for key in _keys(ids):
                txn.delete(key)

    def chunks(self, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(slots, ids) of the rows held here, `rows` directory slots at a time."""
        for start in range(0, self.index.high, rows):
            slots = self.index.live_rows(start, start + rows)
            if len(slots):
                yield slots, self.index.ids[slots]

    def close(self) -> None:
        """Close the store and delete its files."""
        self._env.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _keys(ids: np.ndarray) -> list[bytes]:
    """LMDB keys of `ids`: 8 big-endian bytes each (void items keep their zero bytes, unlike S8)."""
    return np.ascontiguousarray(ids, ">i8").view("V8").tolist()  # type: ignore[no-any-return]


def _grown(a: np.ndarray, need: int) -> np.ndarray:
    out = np.zeros(max(need, 2 * len(a)), a.dtype)
    out[: len(a)] = a
    return out
