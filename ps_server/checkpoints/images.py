"""Tables in a global checkpoint's part: captured in memory, written later, read back through a chain.

A capture (`capture`, under the table's lock) fixes what the part will hold, so that the files are
written in the background while the table keeps serving (issue 22: checkpoints that do not stop
training). It is either full (every live row) or incremental since the parent part's capture of the
same table object (same `token`): the live rows stamped after the parent's epoch, and the ids evicted
since (ps_server.tables.table keeps both). Under the lock it takes only the row numbers and ids; the
rows' columns are copied after, copy-on-write (`Copier`): a chunk of rows at a time in the background,
and the rows a request is about to change first, on that request's thread (`SparseTable.before_write`),
so the image is the table as it was at the capture whatever the requests do meanwhile.

On disk, the layout of ps_server.tables.files (`<part>.tables-<token>/t<k>/`, one `.npy` per column,
`table.json`, and `<part>.tables.json` naming the folder), plus in `table.json` the `token`, the `epoch`
captured and `since` (the parent's epoch, or null for a full table), and `removed.npy` for an
incremental one. Reading them back is pshard.common.checkpoint_chain's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import threading
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from pshard.common.checkpoint_store import write_atomically
from pshard.ps_server.tables.table import CHUNK_ROWS, SparseTable

_FORMAT = 1
_PIECE = 2 << 20  # bytes hashed and written at a time: a pace's quantum


@dataclass(frozen=True)
class TableImage:
    """One table as a part holds it: rows (all, or changed since `meta["since"]`), ids removed since."""

    meta: dict[str, Any]  # table.json: config, step, clock, evicted, token, epoch, since, admission's scalars
    ids: np.ndarray
    columns: dict[str, np.ndarray]  # SparseTable.columns() names -> the rows of `ids` (once `fill` ran)
    removed: np.ndarray  # int64 ids evicted since `since` (empty for a full image)
    admission: np.ndarray | None  # the count-min sketch's counters (a few MB whatever the table)
    copier: Copier | None = None  # fills `columns` (None: filled already)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.removed.nbytes + sum(a.nbytes for a in self.columns.values())

    def fill(self, pace: Pace | None = None) -> None:
        """Copy the rows not copied yet (a request may still be copying some: it is waited for)."""
        if self.copier is not None:
            self.copier.run(pace)


class Copier:
    """Copy-on-write of a table's rows into `out`, installed as the table's `before_write` until every
    row is copied. The rows are `rows` (ascending row numbers), or, when `rows` is None, every row
    number below `len(next(iter(out.values())))` (a table without freed rows: nothing to list). A
    request copies the rows it is about to change and no other (its ids are spread over the whole
    table: copying their chunks would copy the table); the writer copies every row a chunk at a time,
    then puts the rows requests copied back over them.

    What a request pays is what it cannot avoid, under the table's lock: which of its rows are still to
    copy, and where they go, is one read each of `_at` (a row number's position in `rows`, -1 for a
    row not captured; the row number itself without `rows`) and `_done` (a binary search of `rows`
    cost a request of 4,096 ids over a 10 M-row table 10 to 50 ms). Its copies go to small arrays of
    their own (`_saved`), which the writer moves into `out` after its chunks: written in place, each
    of a request's rows was a page fault of `out`'s fresh memory, 4,096 of them, another 15 ms.

    A request never waits for the writer's copy: the writer copies a chunk without `_lock` and takes
    it only to mark the chunk done. That is safe because a request saves a row before it changes it,
    and what it saved is put over the chunk at the end, so a row read mid-change is overwritten. (Copied
    under the lock, a request on the server's event loop waited for the writer's chunk, 30 to 350 ms at
    a time, for as long as the writer thread, at a lower priority on a busy host, took to be scheduled.)"""

    def __init__(self, table: SparseTable, rows: np.ndarray | None, out: dict[str, np.ndarray]) -> None:
        self._table, self._rows, self._out = table, rows, out
        n = len(next(iter(out.values())))
        self._at: np.ndarray | None = None  # None: a row's position is its number
        if rows is not None:
            self._at = np.full(int(rows[-1]) + 1 if len(rows) else 0, -1, np.int32)  # rows < 2**31
            self._at[rows] = np.arange(len(rows), dtype=np.int32)
        self._limit = len(self._at) if self._at is not None else n  # rows from here on: made after
        self._done = np.zeros(n, bool)  # by position: copied (by the writer or a request); lazily zeroed
        self._saved: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []  # (positions, their columns)
        self._lock = threading.Lock()
        table.before_write = self.before_write

    def before_write(self, rows: np.ndarray) -> None:
        with self._lock:
            if len(rows) == 0 or self._limit == 0:
                return
            rows = rows[rows < self._limit]  # rows made since the capture: none
            at = rows if self._at is None else self._at[rows]
            mine = ~self._done[at] if self._at is None else at >= 0
            if self._at is not None:
                mine[mine] = ~self._done[at[mine]]
            if mine.any():
                rows, at = rows[mine], at[mine]
                self._saved.append((at, {name: array[rows] for name, (array, _) in
                                         self._table.columns().items()}))
                self._done[at] = True

    def run(self, pace: Pace | None = None) -> None:
        if self._table.before_write != self.before_write:
            return  # done already
        try:
            n = len(self._done)
            for lo in range(0, n, CHUNK_ROWS):
                hi = min(lo + CHUNK_ROWS, n)
                # The whole chunk, straight into place (a quarter of a masked copy's time), without the
                # lock: the rows a request saved before they changed are put back over it at the end.
                for name, (array, _) in self._table.columns().items():
                    if self._rows is None:
                        self._out[name][lo:hi] = array[lo:hi]
                    else:
                        np.take(array, self._rows[lo:hi], axis=0, out=self._out[name][lo:hi], mode="clip")
                with self._lock:
                    self._done[lo:hi] = True
                if pace is not None:  # copying is most of a write's CPU: paced with it
                    pace.wrote(sum(a[lo:hi].nbytes for a in self._out.values()))
            with self._lock:  # everything is done: no request saves rows from here on
                saved, self._saved = self._saved, []
                self._limit = 0
            for at, columns in saved:
                for name, values in columns.items():
                    self._out[name][at] = values
        finally:
            with self._lock:
                self._limit = 0  # done: every row is copied (or the write failed)
            if self._table.before_write == self.before_write:
                self._table.before_write = None


def capture(table: SparseTable, parent: Mapping[str, Any] | None, partition_count: int = 0) -> TableImage:
    """What a part holds of `table` (its lock held). `parent`: the table.json of the same table in the
    parent part, or None; incremental only when it is this table object's and the eviction log
    still covers it, full otherwise. Advances the table's epoch: later changes go to the next one.
    `partition_count`: what the scheduled record's partitions are numbered under (0: it has none)."""
    # A table with a disk tier (memory_mb) moves rows between RAM and disk: it is captured whole, now.
    since = _since(table, parent) if table.disk is None else None
    epoch = table.epoch
    index = table.index
    # Every row number below `high` live (no row freed): the rows need no list, and their ids are one
    # slice's copy (a list of 10 M rows, the ids gathered by it and a map back took 0.2 to 5 s, loaded).
    rows: np.ndarray | None = None if since is None and index.live == index.high else index.live_rows()
    removed = np.zeros(0, np.int64)
    if since is not None and rows is not None:
        rows = rows[table.stamp[rows] > since]
        logged = [ids for e, ids in table.removed or () if e > since]
        removed = np.concatenate(logged).astype(np.int64) if logged else removed
    meta: dict[str, Any] = {"config": dataclasses.asdict(table.config), "step": table.step,
                            "clock": table.clock, "evicted": table.evicted, "token": table.token,
                            "epoch": epoch, "since": since,
                            "scheduled": table.scheduled.state(partition_count)}
    admission = None
    if table.admission is not None:
        counters, meta["admit_added"], meta["admit_epoch"] = table.admission.state()
        admission = counters.copy()
    if table.disk is not None:
        image = _whole(table, index.live_rows() if rows is None else rows, meta, admission)
        _advance(table, epoch, since)
        return image
    n = index.high if rows is None else len(rows)
    ids = index.ids[:n].copy() if rows is None else index.ids[rows].astype(np.int64, copy=False)
    columns = {c: np.empty((n, *shape), a.dtype) for c, (a, shape) in table.columns().items()}
    image = TableImage(meta=meta, ids=ids, columns=columns, removed=removed, admission=admission,
                       copier=Copier(table, rows, columns))
    _advance(table, epoch, since)
    return image


def _whole(table: SparseTable, rows: np.ndarray, meta: dict[str, Any], admission: np.ndarray | None
           ) -> TableImage:
    """Every row of a table with a disk tier, RAM's then the disk's, copied now (its lock held)."""
    ids = [table.index.ids[rows].astype(np.int64)]
    columns = {c: [a[rows]] for c, (a, _) in table.columns().items()}
    for spilled, values in table.spilled_chunks():
        ids.append(spilled.astype(np.int64))
        for c, parts in columns.items():
            parts.append(values[c])
    return TableImage(meta=meta, ids=np.concatenate(ids),
                      columns={c: np.concatenate(p) for c, p in columns.items()},
                      removed=np.zeros(0, np.int64), admission=admission)


def _since(table: SparseTable, parent: Mapping[str, Any] | None) -> int | None:
    if parent is None or parent.get("token") != table.token or table.removed is None:
        return None
    since = int(parent["epoch"])
    return since if since >= table.removed_since else None


def _advance(table: SparseTable, epoch: int, since: int | None) -> None:
    table.epoch = epoch + 1
    if table.removed is None:  # the log starts now: complete for every epoch after this capture's
        table.removed, table.removed_ids, table.removed_since = [], 0, epoch
        table.track_changes()
    elif since is not None:  # a later part's parent is this one's parent or newer: older entries go
        table.removed = [(e, ids) for e, ids in table.removed if e > since]
        table.removed_ids = sum(len(ids) for _, ids in table.removed)
        table.removed_since = max(table.removed_since, since)


# ---- files ----

class Pace:
    """At most `mb_per_s` written, on average since the first byte: the writer waits when ahead. A
    background checkpoint's write then takes a bounded share of the host's CPU and disk, which the
    training beside it would otherwise lose (on a 2-core host, steps twice as long while it writes)."""

    def __init__(self, mb_per_s: float) -> None:
        self._rate = mb_per_s * 2**20
        self._started: float | None = None
        self._bytes = 0

    def wrote(self, n: int) -> None:
        now = time.monotonic()
        if self._started is None:
            self._started = now
        self._bytes += n
        ahead = self._started + self._bytes / self._rate - now
        if ahead > 0:
            time.sleep(ahead)  # rate limiting: what the pace is for


def _npy_header(array: np.ndarray) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(header, np.lib.format.header_data_from_array_1_0(array))
    return header.getvalue()


def _pieces(array: np.ndarray) -> Iterator[memoryview]:
    """A C-contiguous array's bytes, _PIECE at a time, without a copy: each piece's write and hash
    release the GIL (np.savez's 16 MiB `tobytes` held it, a copy each, on the server's one GIL)."""
    flat = array.reshape(-1).view(np.uint8).data
    for start in range(0, len(flat), _PIECE):
        yield flat[start:start + _PIECE]


def save_npy(path: Path, array: np.ndarray, pace: Pace | None = None) -> tuple[str, int]:
    """`array` as an .npy file, atomically; its (SHA-256, size). The bytes are hashed from memory, not
    read back, and written from it in pieces (no copy; the GIL is released while each is written)."""
    array = np.ascontiguousarray(array)
    head = _npy_header(array)
    sha = hashlib.sha256(head)

    def save(f: BinaryIO) -> None:
        f.write(head)
        # Each piece hashed as it is written, so the hashing is paced too (hashing the whole array
        # first was a burst of CPU as long as the array's write, beside the training).
        for piece in _pieces(array):
            sha.update(piece)
            f.write(piece)
            if pace is not None:
                pace.wrote(len(piece))
    write_atomically(path, save)
    return sha.hexdigest(), len(head) + array.nbytes


class _Stream:
    """The bytes of a file as they are written: hashed, counted and paced. It has no `tell`, so zipfile
    takes it for a stream that cannot seek and writes each member's sizes after its bytes instead of
    going back for them: the file is then exactly the bytes hashed, and needs no reading back."""

    def __init__(self, f: BinaryIO, pace: Pace | None) -> None:
        self._f, self._pace = f, pace
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes, /) -> int:  # zipfile writes bytes and memoryviews
        written = self._f.write(data)
        self.sha.update(data)
        n = memoryview(data).nbytes
        self.size += n
        if self._pace is not None:
            self._pace.wrote(n)
        return written

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        """The file is the caller's (write_atomically fsyncs and closes it)."""


def save_npz(path: Path, arrays: Mapping[str, np.ndarray], pace: Pace | None = None) -> tuple[str, int]:
    """`arrays` as an uncompressed .npz (what np.savez writes, np.load reads), atomically; its (SHA-256,
    size), hashed as it is written. Written from the arrays' memory in pieces, paced: np.savez copied
    each 16 MiB with the GIL held, and the file was read back for its checksum, 100 MB of a 25 M
    parameter model each time, beside the training."""
    digest: list[tuple[str, int]] = []

    def save(f: BinaryIO) -> None:
        stream = _Stream(f, pace)
        with zipfile.ZipFile(stream, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
            for key, value in arrays.items():
                array = np.ascontiguousarray(value)
                with z.open(f"{key}.npy", "w", force_zip64=True) as member:
                    member.write(_npy_header(array))
                    for piece in _pieces(array):
                        member.write(piece)
        digest.append((stream.sha.hexdigest(), stream.size))
    write_atomically(path, save)
    return digest[0]


def write_images(directory: Path, name: str, images: Sequence[TableImage], token: str,
                 pace: Pace | None = None) -> dict[str, tuple[str, int]]:
    """Write `images` as part `name`'s tables (every file fsync'ed, the index last); the files written,
    relative to `directory`, with their SHA-256 and size (the rows' files hashed as they are written)."""
    for image in images:
        image.fill(pace)  # if the caller did not
    folder = directory / f"{name}.tables-{token}"
    folder.mkdir()
    written: dict[str, tuple[str, int]] = {}
    entries = []
    for k, image in enumerate(images):
        sub = folder / f"t{k}"
        sub.mkdir()
        arrays = {"ids": image.ids, **image.columns}
        if image.meta["since"] is not None:
            arrays["removed"] = image.removed
        if image.admission is not None:
            arrays["admission"] = image.admission
        for column, array in arrays.items():
            path = sub / f"{column}.npy"
            written[str(path.relative_to(directory))] = save_npy(path, array, pace)
        encoded = json.dumps(image.meta).encode()
        write_atomically(sub / "table.json", lambda f, b=encoded: f.write(b))
        written[str((sub / "table.json").relative_to(directory))] = (hashlib.sha256(encoded).hexdigest(),
                                                                     len(encoded))
        entries.append(sub.name)
        _sync(sub)
    _sync(folder)
    index = json.dumps({"format": _FORMAT, "directory": folder.name, "tables": entries}).encode()
    write_atomically(directory / f"{name}.tables.json", lambda f: f.write(index))
    written[f"{name}.tables.json"] = (hashlib.sha256(index).hexdigest(), len(index))
    return written


def _sync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
