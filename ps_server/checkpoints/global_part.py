"""A server's part of a global checkpoint: written by parameter and range, restored by the current layout.

The format is pshard.common.checkpoint_store (docs/architecture.md, 9 Failures). Here: a shard's
snapshot and its tables' captures become a part in memory (`capture_part`, quick: copies), written
later, in the background if the caller likes (`write_image`); a committed checkpoint, or an
incremental one's chain, becomes the snapshot one server of any layout restores (`shard_snapshot`:
its slices re-cut from the pieces that cover them) plus the table rows it owns by row hash
(`restore_tables`). Pure: numpy, json and files.

Incremental parts (issue 22): given the parent checkpoint, a slice whose version did not move since
the parent's part (written by this same server process, `writer`) is not written again; its entry
names the ancestor's npz that holds it. Tables hold their changed rows (ps_server.checkpoints.images).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pshard.common import checkpoint_store as ckpt
from pshard.common.checkpoint_chain import chain_rows, part_tables, table_chain
from pshard.common.checkpoint_store import CheckpointError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig, server_of
from pshard.common.types import SliceKey
from pshard.ps_server.checkpoints.images import Pace, TableImage, capture, save_npz, write_images
from pshard.ps_server.core.optimizers import SliceState
from pshard.ps_server.core.store import ShardSnapshot, SliceSnapshot
from pshard.ps_server.tables.files import restore_admission
from pshard.ps_server.tables.table import SparseTable


@dataclass(frozen=True)
class PartImage:
    """A part captured in memory, ready to be written: its json, its own arrays and its tables."""

    name: str  # part-<server>
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    tables: tuple[TableImage, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(t.nbytes for t in self.tables)


def capture_part(server: int, snapshot: ShardSnapshot, ranges: Mapping[SliceKey, ckpt.Range],
                 tables: Sequence[SparseTable] = (), parent: Path | None = None, writer: str = "",
                 partition_count: int = 0) -> PartImage:
    """Server `server`'s part of `snapshot` (a copy already) and of `tables` (their locks held: their rows
    are copied here). With `parent` (a committed checkpoint's directory) and `writer` (this server
    process's name), what did not change since the parent's part by the same writer is referred to.
    `partition_count`: the row partitions the tables' scheduled records are numbered under (0: none)."""
    name = f"part-{server}"
    previous = _parent_part(parent, name, writer)
    refs = _refs(parent, name, previous)
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
        entries.append(_entry(i, s, r, arrays, refs.get((r.key, r.offset, r.numel))))
    held = part_tables(parent, name) if previous is not None and parent is not None else {}
    images = tuple(capture(t, held[t.config.name][1] if t.config.name in held else None, partition_count)
                   for t in tables)
    meta = {"format": ckpt.FORMAT, "server": server, "config": ckpt.job_to_json(snapshot.config),
            "counters": snapshot.counters, "writer": writer,
            "parent": parent.name if previous is not None and parent is not None else None,
            "slices": entries}
    return PartImage(name=name, meta=meta, arrays=arrays, tables=images)


def write_image(directory: Path, image: PartImage, between: Callable[[str], None] | None = None,
                pace: Pace | None = None) -> list[ckpt.FileEntry]:
    """Write a captured part, every file fsync'ed, its json last; the files, with their checksums.
    `between(stage)` runs between the files (a test hook: a server killed there leaves a torn part)."""
    name = image.name
    arrays = image.arrays
    for table in image.tables:  # first: until it is done, the tables' requests copy before they write
        table.fill(pace)
    # The dense npz is paced and hashed as it is written, as the tables are (unpaced, its 100 MB of a
    # 25 M-parameter model were a burst of writing and hashing mid-training).
    npz = save_npz(directory / f"{name}.npz", arrays, pace)
    if between is not None:
        between("dense")
    hashed = write_images(directory, name, image.tables, uuid.uuid4().hex[:12], pace) if image.tables else {}
    if between is not None:
        between("tables")
    encoded = json.dumps(image.meta, indent=1).encode()
    ckpt.write_atomically(directory / f"{name}.json", lambda f: f.write(encoded))
    ckpt.sync_directory(directory)
    files = [ckpt.FileEntry(f"{name}.npz", *npz)]
    files += [ckpt.FileEntry(n, sha, size) for n, (sha, size) in hashed.items()]
    return [*files, ckpt.FileEntry(f"{name}.json", hashlib.sha256(encoded).hexdigest(), len(encoded))]


def write_part(directory: Path, server: int, snapshot: ShardSnapshot, ranges: Mapping[SliceKey, ckpt.Range],
               tables: Sequence[SparseTable] = (), between: Callable[[str], None] | None = None
               ) -> list[ckpt.FileEntry]:
    """Capture and write server `server`'s full part at once (the tables' locks held throughout)."""
    return write_image(directory, capture_part(server, snapshot, ranges, tables), between)


def _parent_part(parent: Path | None, name: str, writer: str) -> dict[str, Any] | None:
    """The parent's json of part `name`, if this same server process wrote it (else the part is full)."""
    if parent is None or not writer:
        return None
    try:
        meta: dict[str, Any] = json.loads((parent / f"{name}.json").read_bytes())
    except FileNotFoundError:
        return None
    return meta if meta.get("writer") == writer else None


def _refs(parent: Path | None, name: str, previous: dict[str, Any] | None
          ) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The parent part's slices by range, each with the npz that holds its arrays."""
    if previous is None or parent is None:
        return {}
    own = f"../{parent.name}/{name}.npz"
    return {(e["key"], int(e["offset"]), int(e["numel"])): {**e, "npz": e.get("npz", own)}
            for e in previous["slices"]}


def _entry(i: int, s: SliceSnapshot, r: ckpt.Range, arrays: dict[str, np.ndarray],
           ref: dict[str, Any] | None = None) -> dict[str, Any]:
    state_arrays: list[str] = []
    scalars: dict[str, int | float] = {}
    own: dict[str, np.ndarray] = {f"s{i}.value": s.value.reshape(-1)}
    for name, v in s.opt_state.items():
        if isinstance(v, np.ndarray):
            own[f"s{i}.opt{len(state_arrays)}"] = v.reshape(-1)
            state_arrays.append(name)
        else:
            scalars[name] = v.item() if isinstance(v, np.generic) else v
    entry = {"index": i, "key": r.key, "offset": r.offset, "numel": r.numel, "shape": list(r.shape),
             "dtype": s.dtype, "version": s.version, "clocks": s.clocks, "floors": s.floors,
             "state_arrays": state_arrays, "state_scalars": scalars,
             "scheduled": {str(sid): seq for sid, seq in s.scheduled.items()}}  # json keys are strings
    if (ref is not None and int(ref["version"]) == s.version and ref["dtype"] == s.dtype
            and ref["state_arrays"] == state_arrays):
        # Unchanged since the parent: its arrays stay where they are (an ancestor's npz).
        return {**entry, "index": ref["index"], "npz": ref["npz"]}
    # Arrays by position: their names must be valid zip member names, and positions are unique.
    arrays.update(own)
    return entry


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
        version=version, opt_state=state, clocks=clocks, floors=floors, pending=None, contributors=(),
        scheduled=_scheduled([p.meta.get("scheduled", {}) for p in pieces]))


def _scheduled(pieces: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """A slice's record of scheduled pushes from the records of the pieces it is cut from (an older part
    has none): a push counts as applied only where every piece had it. On the layout the checkpoint was
    taken on a slice is one piece, and its record is exact; a slice cut from pieces one push reached and
    another not (a checkpoint taken while it was landing, restored on another server count) takes the
    push again over all of it rather than lose it on the pieces that lacked it."""
    records = [{int(sid): int(seq) for sid, seq in piece.items()} for piece in pieces]
    common = set(records[0]).intersection(*records[1:]) if records else set()
    return {sid: min(r[sid] for r in records) for sid in common}


def shard_snapshot(checkpoint: ckpt.Checkpoint, job: JobConfig, ranges: Mapping[SliceKey, ckpt.Range],
                   quorum: Mapping[str, int] | None, links: Sequence[ckpt.Checkpoint] = ()) -> ShardSnapshot:
    """What one server of the current layout restores: its slices, re-cut from the checkpoint (an
    incremental one's `links`: its verified chain, ckpt.chain).

    Generations are not restored: a restore starts a new incarnation of the job, whose workers
    register anew.
    """
    with ckpt.DenseReader(checkpoint, links) as reader:
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
                   make: Callable[[TableConfig], SparseTable], row_owners: Sequence[int] = (),
                   links: Sequence[ckpt.Checkpoint] = ()) -> list[SparseTable]:
    """The rows of every part's tables that server `server` of `servers` owns by row hash: the ids
    of the row partitions `row_owners` puts on it (empty: partition i on server i). The checkpoint
    holds ids, not partitions, so any partitioning restores from any other. An incremental
    checkpoint's are folded from its `links` (ckpt.chain)."""
    owners = np.asarray(row_owners, np.int64) if len(row_owners) else None
    tables: dict[str, SparseTable] = {}
    folders = [c.path for c in links] or [checkpoint.path]
    for part in ckpt.table_parts(checkpoint):
        for name, (sub, meta) in part_tables(checkpoint.path, part).items():
            config = TableConfig(**{**meta["config"], "betas": tuple(meta["config"]["betas"])})
            table = tables.get(config.name)
            if table is None:
                table = tables[config.name] = make(config)
            taken = []
            for chunk_ids, chunk in chain_rows(table_chain(folders, part, name), list(table.columns())):
                mine = (server_of(chunk_ids, servers) == server if owners is None
                        else owners[server_of(chunk_ids, len(owners))] == server)
                if mine.any():
                    table.restore_rows(chunk_ids[mine], {c: a[mine] for c, a in chunk.items()})
                    taken.append(chunk_ids[mine])
            table.step = max(table.step, int(meta["step"]))
            table.clock = max(table.clock, float(meta["clock"]))
            # The part's record (older parts: none) holds for the rows taken from it, whatever our partitions.
            table.scheduled.restore_part(meta.get("scheduled"),
                                         np.concatenate(taken) if taken else np.zeros(0, np.int64))
            restore_admission(table, sub, meta)
    return list(tables.values())


