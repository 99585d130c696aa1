"""A server's part of a global checkpoint: written by parameter and range, restored by the current layout.

The format is pshard.common.checkpoint_store (docs/architecture.md, 9 Failures). Here: a shard's
snapshot becomes a part (`write_part`), and a committed checkpoint becomes the snapshot one
server of any layout restores (`shard_snapshot`: its slices re-cut from the pieces that cover
them) plus the table rows it owns by row hash (`restore_tables`). Pure: numpy, json and files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pshard.common import checkpoint_store as ckpt
from pshard.common.checkpoint_store import CheckpointError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig, server_of
from pshard.common.types import SliceKey
from pshard.ps_server.core.optimizers import SliceState
from pshard.ps_server.core.store import ShardSnapshot, SliceSnapshot
from pshard.ps_server.tables.files import restore_admission
from pshard.ps_server.tables.table import CHUNK_ROWS, SparseTable


def write_part(directory: Path, server: int, snapshot: ShardSnapshot, ranges: Mapping[SliceKey, ckpt.Range],
               write_tables: Callable[[Path, str], Path | None] | None = None,
               between: Callable[[str], None] | None = None) -> list[ckpt.FileEntry]:
    """Write server `server`'s part; the files written, with their checksums.

    `write_tables(directory, name)` saves the server's tables under `name` (None: none held).
    `between(stage)` runs between the files (a test hook: a server killed there leaves a torn part).
    """
    name = f"part-{server}"
    arrays: dict[str, Any] = {}  # Any: savez's stubs type **kwds like its allow_pickle flag
    entries = []
    for i, s in enumerate(snapshot.slices):
        r = ranges.get(s.key)
        if r is None:
            raise CheckpointError(f"checkpoint part {server}: slice {str(s.key)!r} is not in the layout "
                                  "given")
        if s.value.size != r.numel:
            raise CheckpointError(f"checkpoint part {server}: slice {str(s.key)!r} holds {s.value.size} "
                                  f"elements, the layout says {r.numel}")
        entries.append(_entry(i, s, r, arrays))
    ckpt.write_atomically(directory / f"{name}.npz", lambda f: np.savez(f, allow_pickle=False, **arrays))
    written = [f"{name}.npz"]
    if between is not None:
        between("dense")
    if write_tables is not None:
        pointer = write_tables(directory, name)
        if pointer is not None:
            index = json.loads(pointer.read_text())
            folder = directory / index["directory"]
            written += [str(p.relative_to(directory)) for p in sorted(folder.rglob("*")) if p.is_file()]
            written.append(pointer.name)
    if between is not None:
        between("tables")
    meta = {"format": ckpt.FORMAT, "server": server, "config": ckpt.job_to_json(snapshot.config),
            "counters": snapshot.counters, "slices": entries}
    encoded = json.dumps(meta, indent=1).encode()
    ckpt.write_atomically(directory / f"{name}.json", lambda f: f.write(encoded))
    written.append(f"{name}.json")
    ckpt.sync_directory(directory)
    return [ckpt.FileEntry(n, *ckpt.digest(directory / n)) for n in written]


def _entry(i: int, s: SliceSnapshot, r: ckpt.Range, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    # Arrays by position: their names must be valid zip member names, and positions are unique.
    arrays[f"s{i}.value"] = s.value.reshape(-1)
    state_arrays: list[str] = []
    scalars: dict[str, int | float] = {}
    for name, v in s.opt_state.items():
        if isinstance(v, np.ndarray):
            arrays[f"s{i}.opt{len(state_arrays)}"] = v.reshape(-1)
            state_arrays.append(name)
        else:
            scalars[name] = v.item() if isinstance(v, np.generic) else v
    return {"index": i, "key": r.key, "offset": r.offset, "numel": r.numel, "shape": list(r.shape),
            "dtype": s.dtype, "version": s.version, "clocks": s.clocks, "floors": s.floors,
            "state_arrays": state_arrays, "state_scalars": scalars}


def _slice_snapshot(reader: ckpt.DenseReader, slice_key: SliceKey, r: ckpt.Range, sync: bool
                    ) -> SliceSnapshot:
    """A slice of the current layout, cut from the checkpoint's pieces.

    Sync: the pending sums of the clock after the boundary are not part of the checkpoint, so every
    worker pushes that clock again, and the clocks it had pushed are taken back to the boundary:
    otherwise a worker that had already pushed it would see its resend dropped as a duplicate, and
    the clock would wait for it for ever."""
    pieces = reader.overlapping(r.key, r.offset, r.numel)
    if not pieces:
        raise CheckpointError(f"checkpoint {reader.checkpoint.path}: parameter {r.key!r} has no elements "
                              f"[{r.offset}, {r.offset + r.numel})")
    first = pieces[0].meta
    state: SliceState = {n: reader.read(r.key, r.offset, r.numel, n) for n in first["state_arrays"]}
    state.update(first["state_scalars"])
    clocks: dict[str, int] = {}
    floors: dict[str, int] = {}
    for p in pieces:
        for w, c in p.meta["clocks"].items():
            clocks[w] = max(clocks.get(w, c), int(c))
        for w, c in p.meta["floors"].items():
            floors[w] = max(floors.get(w, c), int(c))
    version = min(int(p.meta["version"]) for p in pieces)
    if sync:
        clocks = {w: min(c, version - 1) for w, c in clocks.items()}
    return SliceSnapshot(
        key=slice_key, dtype=first["dtype"], value=reader.read(r.key, r.offset, r.numel),
        version=version, opt_state=state, clocks=clocks, floors=floors, pending=None, contributors=())


def shard_snapshot(checkpoint: ckpt.Checkpoint, job: JobConfig, ranges: Mapping[SliceKey, ckpt.Range],
                   quorum: Mapping[str, int] | None) -> ShardSnapshot:
    """What one server of the current layout restores: its slices, re-cut from the checkpoint.

    Generations are not restored: a restore starts a new incarnation of the job, whose workers
    register anew.
    """
    with ckpt.DenseReader(checkpoint) as reader:
        missing = sorted({r.key for r in ranges.values()} - set(reader.keys))
        if missing:
            raise CheckpointError(f"checkpoint {checkpoint.path}: the model's parameters {missing[:8]} are "
                                  "not in it (another model?)")
        for r in ranges.values():
            shape = checkpoint.params[r.key][1]
            if tuple(shape) != tuple(r.shape):
                raise CheckpointError(f"checkpoint {checkpoint.path}: parameter {r.key!r} has shape "
                                      f"{tuple(shape)}, the model has {tuple(r.shape)}")
        slices = tuple(_slice_snapshot(reader, k, ranges[k], job.mode == "sync") for k in sorted(ranges))
    return ShardSnapshot(config=job, slices=slices, generations={},
                         quorum=dict(quorum) if quorum else None, seen=(), counters={})


def restore_tables(checkpoint: ckpt.Checkpoint, server: int, servers: int,
                   make: Callable[[TableConfig], SparseTable], row_owners: Sequence[int] = ()
                   ) -> list[SparseTable]:
    """The rows of every part's tables that server `server` of `servers` owns by row hash: the ids
    of the row partitions `row_owners` puts on it (empty: partition i on server i). The checkpoint
    holds ids, not partitions, so any partitioning restores from any other."""
    owners = np.asarray(row_owners, np.int64) if len(row_owners) else None
    tables: dict[str, SparseTable] = {}
    for part in ckpt.table_parts(checkpoint):
        index = json.loads((checkpoint.path / f"{part}.tables.json").read_text())
        folder = checkpoint.path / index["directory"]
        for entry in index["tables"]:
            sub = folder / entry
            meta: dict[str, Any] = json.loads((sub / "table.json").read_text())
            config = TableConfig(**{**meta["config"], "betas": tuple(meta["config"]["betas"])})
            table = tables.get(config.name)
            if table is None:
                table = tables[config.name] = make(config)
            ids = np.load(sub / "ids.npy", mmap_mode="r")
            columns = {c: np.load(sub / f"{c}.npy", mmap_mode="r") for c in table.columns()}
            for start in range(0, len(ids), CHUNK_ROWS):
                chunk_ids = np.array(ids[start:start + CHUNK_ROWS])
                mine = (server_of(chunk_ids, servers) == server if owners is None
                        else owners[server_of(chunk_ids, len(owners))] == server)
                if mine.any():
                    chunk = {c: np.array(a[start:start + CHUNK_ROWS])[mine] for c, a in columns.items()}
                    table.restore_rows(chunk_ids[mine], chunk)
            table.step = max(table.step, int(meta["step"]))
            table.clock = max(table.clock, float(meta["clock"]))
            restore_admission(table, sub, meta)
    return list(tables.values())


