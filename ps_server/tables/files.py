"""Sparse tables on disk: checkpoints (everything, to resume) and exports (ids and rows, for serving).

Both are plain `.npy` files, readable with numpy alone, written by streaming: the header is
written first (the live row count is known), then the live rows a chunk at a time
(ps_server.tables.table.CHUNK_ROWS), so saving a table never makes a second in-memory copy of it.

A checkpoint of a server's tables is a directory `<name>.tables-<token>/` holding one
subdirectory per table (`t0`, `t1`, ...: table names may hold any character) with `ids.npy`,
one `.npy` per per-row array (values, optimizer state, last touch, count, lazy Adam's steps) and
`table.json` (the config and the scalar state). `<name>.tables.json`, replaced atomically last,
names the directory; older directories are removed after it, so a crash at any point leaves the
previous checkpoint loadable. A table with admission by count also saves its counts (`admission.npy`,
the count-min sketch's counters, a few MB whatever the table; its halvings in `table.json`), so ids
waiting for admission keep their sightings across a restart (`restore_admission`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from pshard.common.errors import CheckpointError, PSError
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import decode_rows
from pshard.ps_server.tables.table import CHUNK_ROWS, SparseTable

log = logging.getLogger("pshard.ps")

_FORMAT = 1


def _write_npy(path: Path, dtype: np.dtype, shape: tuple[int, ...], chunks: Iterable[np.ndarray]) -> None:
    try:
        with open(path, "wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_2_0(f, header)
            written = 0
            for chunk in chunks:
                f.write(np.ascontiguousarray(chunk, dtype).data)
                written += len(chunk)
            if written != shape[0]:
                raise RuntimeError(f"{path}: wrote {written} rows, header says {shape[0]}")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # a write to a full disk names no file: name it
        if err.errno is not None and err.filename is None:
            err.filename = str(path)
        raise


def _stream_column(table: SparseTable, path: Path, column: Callable[[np.ndarray, np.ndarray], np.ndarray],
                   dtype: np.dtype, row_shape: tuple[int, ...],
                   spilled: Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]) -> None:
    """The column of every row: RAM rows by `column(rows, ids)`, then the disk tier's (a table with
    memory_mb) by `spilled(ids, columns)`."""
    ram = (column(rows, ids) for rows, ids in table.chunks())
    disk = (spilled(ids, columns) for ids, columns in table.spilled_chunks())
    _write_npy(path, dtype, (len(table), *row_shape), itertools.chain(ram, disk))


def _rows_of(array: np.ndarray) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    return lambda rows, ids: array[rows]


def _ids(ids: np.ndarray, *_: object) -> np.ndarray:
    return ids


def _column(name: str) -> Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]:
    return lambda ids, columns: columns[name]


def export_table(table: SparseTable, folder: Path) -> tuple[Path, Path, int]:
    """`folder/ids.npy` (int64, n) and `folder/rows.npy` (n, dim) of the live rows, in the same order."""
    folder.mkdir(parents=True, exist_ok=True)
    ids_path, rows_path = folder / "ids.npy", folder / "rows.npy"
    _stream_column(table, ids_path, lambda rows, ids: ids, np.dtype(np.int64), (), _ids)
    # Narrow rows are exported decoded, float32: the file is read by tools that know no row_dtype.
    _stream_column(table, rows_path, lambda rows, ids: table.decoded(rows), table.config.np_dtype,
                   (table.config.dim,), lambda ids, columns: decode_rows(table.config, columns["values"]))
    return ids_path, rows_path, len(table)


def pointer_path(directory: Path, name: str) -> Path:
    """The json that commits checkpoint `name`'s tables in `directory` (its mtime: when they were saved)."""
    return directory / f"{name}.tables.json"


# One save at a time per checkpoint (pointer path), whoever asks: a Checkpoint and a CheckpointTables (or a
# global checkpoint's part) ran save_tables at once on executor threads, shared the pointer's temporary
# file, and each deleted the other's folder after committing, so the pointer could be left naming a
# deleted folder (fuzzed: UNKNOWN FileNotFoundError).
_SAVING: dict[Path, threading.Lock] = {}
_SAVING_GUARD = threading.Lock()


def save_tables(directory: Path, name: str, tables: list[SparseTable]) -> Path:
    """Checkpoint `tables` (callers hold each table's lock); returns the path of the committing json."""
    pointer = pointer_path(directory, name)
    with _SAVING_GUARD:
        saving = _SAVING.setdefault(pointer.resolve(), threading.Lock())
    with saving:
        return _save_tables(directory, name, tables, pointer)


def _save_tables(directory: Path, name: str, tables: list[SparseTable], pointer: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    folder = directory / f"{name}.tables-{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    entries = []
    for i, table in enumerate(tables):
        sub = folder / f"t{i}"
        sub.mkdir()
        _stream_column(table, sub / "ids.npy", lambda rows, ids: ids, np.dtype(np.int64), (), _ids)
        for column, (array, row_shape) in table.columns().items():
            _stream_column(table, sub / f"{column}.npy", _rows_of(array), array.dtype, row_shape,
                           _column(column))
        meta: dict[str, Any] = {"config": dataclasses.asdict(table.config), "step": table.step,
                                "clock": table.clock, "evicted": table.evicted,
                                "scheduled": table.scheduled.state()}
        if table.admission is not None:
            counters, meta["admit_added"], meta["admit_epoch"] = table.admission.state()
            _write_npy(sub / "admission.npy", counters.dtype, counters.shape, [counters])
        (sub / "table.json").write_text(json.dumps(meta))
        entries.append(sub.name)
    tmp = pointer.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "directory": folder.name, "tables": entries}))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    for old in directory.glob(f"{name}.tables-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return pointer


def load_tables(directory: Path, name: str, make: Callable[[TableConfig], SparseTable]) -> list[SparseTable]:
    """The tables of checkpoint `name` in `directory` ([] if none); `make` builds an empty table.
    CheckpointError naming the pointer and why when a file is missing or damaged."""
    pointer = pointer_path(directory, name)
    if not pointer.exists():
        return []
    try:
        tables = _load_tables(directory, pointer, make)
    except PSError:
        raise
    except (OSError, ValueError, EOFError, KeyError, TypeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(f"table checkpoint {pointer}: cannot read it ({type(err).__name__}: "
                              f"{reason})") from None
    log.info("restored %d tables from %s", len(tables), pointer)
    return tables


def _load_tables(directory: Path, pointer: Path, make: Callable[[TableConfig], SparseTable]
                 ) -> list[SparseTable]:
    index = json.loads(pointer.read_text())
    folder = directory / index["directory"]
    tables = []
    for entry in index["tables"]:
        sub = folder / entry
        meta: dict[str, Any] = json.loads((sub / "table.json").read_text())
        config = meta["config"]
        table = make(TableConfig(**{**config, "betas": tuple(config["betas"])}))
        ids = np.load(sub / "ids.npy", mmap_mode="r")
        columns = {c: np.load(sub / f"{c}.npy", mmap_mode="r") for c in table.columns()}
        for start in range(0, len(ids), CHUNK_ROWS):
            stop = start + CHUNK_ROWS
            chunk = {c: np.array(a[start:stop]) for c, a in columns.items()}
            table.restore_rows(np.array(ids[start:stop]), chunk)
        table.step, table.clock, table.evicted = int(meta["step"]), float(meta["clock"]), int(meta["evicted"])
        table.scheduled.load(meta.get("scheduled"))  # an older checkpoint has none
        restore_admission(table, sub, meta)
        tables.append(table)
    return tables


def restore_admission(table: SparseTable, sub: Path, meta: dict[str, Any]) -> None:
    """Fold the admission counts saved in `sub` into `table`'s: each counter the larger of the two, so
    that folding several servers' parts (a restore onto another server count) counts every id at least
    as its own server did: never later admitted, at times earlier. A checkpoint without them (older, or
    another admit_after): the counts start anew."""
    path = sub / "admission.npy"
    if table.admission is None or not path.exists():
        return
    counters, added, epoch = table.admission.state()
    saved = np.load(path)
    if saved.shape != counters.shape or saved.dtype != counters.dtype:
        log.warning("%s: admission counts of another size (%s%s, the table has %s%s): they start anew",
                    path, saved.dtype, saved.shape, counters.dtype, counters.shape)
        return
    table.admission.load(np.maximum(counters, saved), max(added, int(meta["admit_added"])),
                         max(epoch, int(meta["admit_epoch"])))


def append_ids(path: Path, ids: np.ndarray) -> None:
    """Append evicted ids to a text log, one per line (a serving system tails it)."""
    with open(path, "a") as f:
        f.write("".join(f"{i}\n" for i in ids.tolist()))
