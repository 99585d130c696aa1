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
from collections.abc import Mapping, Sequence
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
    """Copy-on-write of a table's `rows` (ascending row numbers) into `out`: installed as the table's
    `before_write` until every row is copied. A request copies the rows it is about to change and no
    other (its ids are spread over the whole table: copying their chunks would copy the table); the
    writer copies every row a chunk at a time, then puts the rows requests copied back over them.

    What a request pays is what it cannot avoid, under the table's lock. Which of its rows are still to
    copy, and where they go, is one read each of `_pending` (a row number's position in `rows`, -1 once
    copied): a binary search of `rows` cost a request of 4,096 ids over a 10 M-row table 10 to 50 ms.
    Its copies go to small arrays of their own (`_saved`), which the writer moves into `out` after its
    chunks: written in place, each of a request's rows was a page fault of `out`'s fresh memory, 4,096
    of them, another 15 ms."""

    def __init__(self, table: SparseTable, rows: np.ndarray, out: dict[str, np.ndarray]) -> None:
        self._table, self._rows, self._out = table, rows, out
        self._pending = np.full(int(rows[-1]) + 1 if len(rows) else 0, -1, np.int32)  # rows < 2**31
        self._pending[rows] = np.arange(len(rows), dtype=np.int32)
        self._saved: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []  # (positions, their columns)
        self._lock = threading.Lock()
        table.before_write = self.before_write

    def before_write(self, rows: np.ndarray) -> None:
        with self._lock:
            if len(rows) == 0 or len(self._pending) == 0:
                return
            rows = rows[rows < len(self._pending)]  # rows made since the capture: none
            at = self._pending[rows]
            mine = at >= 0
            if mine.any():
                rows = rows[mine]
                self._saved.append((at[mine], {name: array[rows] for name, (array, _) in
                                               self._table.columns().items()}))
                self._pending[rows] = -1

    def run(self, pace: Pace | None = None) -> None:
        if self._table.before_write != self.before_write:
            return  # done already: `_pending` is gone
        try:
            for lo in range(0, len(self._rows), CHUNK_ROWS):
                hi = min(lo + CHUNK_ROWS, len(self._rows))
                with self._lock:
                    # The whole chunk, straight into place (a quarter of a masked copy's time): the rows
                    # a request saved before they changed are put back over it after the last chunk.
                    rows = self._rows[lo:hi]
                    for name, (array, _) in self._table.columns().items():
                        np.take(array, rows, axis=0, out=self._out[name][lo:hi], mode="clip")
                    self._pending[rows] = -1
                if pace is not None:  # copying is most of a write's CPU: paced with it
                    pace.wrote(sum(a[lo:hi].nbytes for a in self._out.values()))
            with self._lock:  # nothing is pending any more: no request saves rows from here on
                saved, self._saved = self._saved, []
            for at, columns in saved:
                for name, values in columns.items():
                    self._out[name][at] = values
        finally:
            with self._lock:
                self._pending = self._pending[:0]  # done: every row is copied (or the write failed)
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
    rows = table.index.live_rows()
    removed = np.zeros(0, np.int64)
    if since is not None:
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
        image = _whole(table, rows, meta, admission)
        _advance(table, epoch, since)
        return image
    columns = {c: np.empty((len(rows), *shape), a.dtype) for c, (a, shape) in table.columns().items()}
    image = TableImage(meta=meta, ids=table.index.ids[rows].astype(np.int64), columns=columns,
                       removed=removed, admission=admission, copier=Copier(table, rows, columns))
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


class PacedFile:
    """A binary file whose writes are paced (np.savez's, which writes a dense part's npz in 16 MiB
    pieces); everything else is the file's own (zipfile seeks back to its headers)."""

    def __init__(self, f: BinaryIO, pace: Pace) -> None:
        self._f, self._pace = f, pace

    def write(self, data: bytes | memoryview) -> int:
        written = self._f.write(data)
        self._pace.wrote(memoryview(data).nbytes)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def save_npy(path: Path, array: np.ndarray, pace: Pace | None = None) -> tuple[str, int]:
    """`array` as an .npy file, atomically; its (SHA-256, size). The bytes are hashed from memory, not
    read back, and written from it in pieces (no copy; the GIL is released while each is written)."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(header, np.lib.format.header_data_from_array_1_0(array))
    head = header.getvalue()
    sha = hashlib.sha256(head)

    def save(f: BinaryIO) -> None:
        f.write(head)
        flat = array.reshape(-1).view(np.uint8).data
        # Each piece hashed as it is written, so the hashing is paced too (hashing the whole array
        # first was a burst of CPU as long as the array's write, beside the training).
        for start in range(0, len(flat), _PIECE):
            piece = flat[start:start + _PIECE]
            sha.update(piece)
            f.write(piece)
            if pace is not None:
                pace.wrote(len(piece))
    write_atomically(path, save)
    return sha.hexdigest(), len(head) + array.nbytes


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
