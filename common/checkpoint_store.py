"""Global checkpoints on disk: one directory per checkpoint, a part per server, one manifest.

Layout-independent (docs/architecture.md, 9 Failures): a server's part names each dense slice by
its parameter and global element range, never by the server or slice number that held it, and
its tables by row id. A reader re-cuts the ranges and re-hashes the rows for any number of
servers. A checkpoint directory `ckpt-<clock>-<token>/` holds, per server index i:

- `part-<i>.npz`: the slices' values and optimizer state arrays (numpy, allow_pickle=False);
- `part-<i>.json`: per slice its parameter, range, shape, dtype, version, clocks and scalar
  optimizer state; the job config;
- `part-<i>.tables-<token>/` and `part-<i>.tables.json`: the sparse tables (ps_server.tables.files),
  when the server holds any;

and `MANIFEST.json`, written last by the coordinator (tmp file, fsync, rename): the clock, the
job, the parameters' shapes and every part file with its size and SHA-256. A directory without
a manifest, or whose files do not match it, is torn: never restored, reported and skipped.

Incremental checkpoints (format 2, issue 22) name a `parent`: the committed checkpoint directory
beside them that they complete. Their dense slices that did not change since the parent point at
the npz that holds them (`"npz": "../ckpt-.../part-<i>.npz"`, an ancestor's), and their tables hold
only the rows written or touched since, plus the ids removed (ps_server.checkpoints.images). The
chain ends at a full checkpoint (no parent). Reading one verifies every link (`chain`): a missing
or damaged link is refused naming the file, never skipped. Format 1 (full) is written as before.

The format, shared by the servers (ps_server.checkpoints.global_part writes and restores parts), the
coordinator (worker.checkpoint_coordinator) and `pshard checkpoint`. Pure: numpy, json and files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from pshard.common import checkpoint_chain
from pshard.common.errors import CheckpointError  # re-exported: callers catch ckpt.CheckpointError
from pshard.common.job import JobConfig, OptimizerConfig

FORMAT = 1
FORMAT_CHAIN = 2  # a manifest with a parent: older readers refuse it rather than restore part of it
MANIFEST = "MANIFEST.json"
_DIR = re.compile(r"^ckpt-(\d{12})-([0-9a-f]{8})$")
_TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class Range:
    """Where one slice lies in its parameter's flattened elements."""

    key: str
    offset: int
    numel: int
    shape: tuple[int, ...]  # of the whole parameter


@dataclass(frozen=True)
class FileEntry:
    name: str  # relative to the checkpoint directory
    sha256: str
    size: int


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its directory and manifest."""

    path: Path
    clock: int
    created: float
    job: JobConfig
    params: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    files: tuple[FileEntry, ...]
    servers: int  # how many servers wrote it
    # A coordinator's own state, committed with the weights (pshard.coordinator: its shard queues'
    # positions); {} for a worker-driven job's.
    coordinator: dict[str, Any] = dataclasses.field(default_factory=dict)
    parent: str | None = None  # incremental: the name of the checkpoint directory it completes
    depth: int = 0  # links to the full checkpoint at the end of its chain


@dataclass(frozen=True)
class Torn:
    path: Path
    reason: str


def new_directory(root: Path, clock: int) -> Path:
    """A fresh checkpoint directory under `root` for `clock` (created empty)."""
    path = root / f"ckpt-{clock:012d}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


# ---- files ----

def digest(path: Path, each: Callable[[int], object] | None = None) -> tuple[str, int]:
    """(SHA-256 hex, size) of a file; `each(n)` after each n bytes read (a background write's pace)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if each is not None:
                each(len(chunk))
    return h.hexdigest(), path.stat().st_size


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write to a temporary name, fsync, then rename: a reader sees the whole file or none. An
    OSError names `path` when the system named no file (a write to a full disk)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes must be on disk before the name points at them
        os.replace(tmp, path)
    except OSError as err:
        if err.errno is not None and err.filename in (None, str(tmp)):  # the file meant, not its temporary
            err.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def sync_directory(folder: Path) -> None:
    # The renames themselves live in the directory: sync it so they survive a power cut.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def job_to_json(job: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(job)


def job_from_json(d: Mapping[str, Any]) -> JobConfig:
    opt = dict(d["optimizer"])
    opt["betas"] = tuple(opt["betas"])  # JSON has no tuples
    return JobConfig(**{**d, "optimizer": OptimizerConfig(**opt)})  # compression: JobConfig reads its dict


# ---- the manifest ----

def commit(directory: Path, clock: int, job: JobConfig, params: Mapping[str, tuple[str, tuple[int, ...]]],
           parts: Sequence[Sequence[FileEntry]], coordinator: Mapping[str, Any] | None = None,
           parent: Checkpoint | None = None) -> Path:
    """Write the manifest (last, atomically): from here on the checkpoint is committed. `coordinator`: a
    coordinator's own state (JSON), committed with the weights. With `parent`, an incremental checkpoint
    whose parts refer to it (a sibling directory under the same root)."""
    chained: dict[str, Any] = {}
    if parent is not None:
        if parent.path.parent.resolve() != directory.parent.resolve():
            raise CheckpointError(f"checkpoint {directory}: its parent {parent.path} is not under the same "
                                  "root")
        chained = {"parent": parent.path.name, "depth": parent.depth + 1}
    manifest: dict[str, Any] = {
        "format": FORMAT_CHAIN if chained else FORMAT, **chained, "clock": clock, "created": time.time(),
        "job": job_to_json(job),
        "servers": len(parts),
        "params": {k: {"dtype": d, "shape": list(s)} for k, (d, s) in params.items()},
        "files": [dataclasses.asdict(f) for part in parts for f in part],
    }
    if coordinator:
        manifest["coordinator"] = dict(coordinator)
    encoded = json.dumps(manifest, indent=1).encode()
    path = directory / MANIFEST
    write_atomically(path, lambda f: f.write(encoded))
    sync_directory(directory)
    return path


def scan(root: Path, verify: bool = False) -> tuple[list[Checkpoint], list[Torn]]:
    """The committed checkpoints under `root`, oldest first, and the torn ones.

    Committed: a manifest that parses and every file it lists present with its size (and, with
    `verify`, its SHA-256). Anything else under a checkpoint's name is torn.
    """
    committed: list[Checkpoint] = []
    torn: list[Torn] = []
    if not root.is_dir():
        return committed, torn
    for path in sorted(p for p in root.iterdir() if p.is_dir() and _DIR.match(p.name)):
        try:
            committed.append(load_manifest(path, verify=verify))
        except CheckpointError as err:
            torn.append(Torn(path, str(err)))
    committed.sort(key=lambda c: (c.clock, c.created))
    return committed, torn


def load_manifest(path: Path, verify: bool = False) -> Checkpoint:
    """The committed checkpoint in `path`; CheckpointError naming what is missing or wrong."""
    try:
        raw = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (torn: a part was never finished)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} unreadable ({err})") from None
    if raw.get("format") not in (FORMAT, FORMAT_CHAIN):
        raise CheckpointError(f"checkpoint {path}: got format {raw.get('format')!r}, expected {FORMAT} or "
                              f"{FORMAT_CHAIN}")
    files = tuple(FileEntry(f["name"], f["sha256"], int(f["size"])) for f in raw["files"])
    for f in files:
        p = path / f.name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {path}: {f.name} is missing")
        if p.stat().st_size != f.size:
            raise CheckpointError(f"checkpoint {path}: {f.name} has {p.stat().st_size} bytes, "
                                  f"the manifest says {f.size}")
        if verify and digest(p)[0] != f.sha256:
            raise CheckpointError(f"checkpoint {path}: {f.name} does not match its SHA-256 in the manifest")
    return Checkpoint(path=path, clock=int(raw["clock"]), created=float(raw["created"]),
                      job=job_from_json(raw["job"]),
                      params={k: (v["dtype"], tuple(v["shape"])) for k, v in raw["params"].items()},
                      files=files, servers=int(raw["servers"]),
                      coordinator=dict(raw.get("coordinator") or {}), parent=raw.get("parent"),
                      depth=int(raw.get("depth", 0)))


def chain(checkpoint: Checkpoint) -> list[Checkpoint]:
    """`checkpoint` and its ancestors down to its full base, newest first, every link verified by
    SHA-256; CheckpointError naming the link's missing or damaged file (a link is never skipped)."""
    links = [load_manifest(checkpoint.path, verify=True)]
    while (name := links[-1].parent) is not None:
        child = links[-1]
        parent = child.path.parent / name
        if not _DIR.match(name) or len(links) > links[0].depth:
            raise CheckpointError(f"checkpoint {child.path}: its parent {name!r} is not a checkpoint "
                                  f"directory, or the chain is longer than the {links[0].depth} links "
                                  f"{links[0].path / MANIFEST} says")
        if not (parent / MANIFEST).is_file():
            raise CheckpointError(f"checkpoint {child.path}: its parent's manifest {parent / MANIFEST} is "
                                  "missing (the chain is broken: restore an older full checkpoint by name)")
        links.append(load_manifest(parent, verify=True))
    return links


def latest(root: Path, report: Callable[[Torn], None] | None = None) -> Checkpoint | None:
    """The newest committed checkpoint whose files all match their checksums; torn ones are reported.

    A torn checkpoint newer than the one returned is never used: it is reported and skipped.
    """
    committed, torn = scan(root)
    for t in torn:
        if report is not None:
            report(t)
    for candidate in reversed(committed):
        try:
            return load_manifest(candidate.path, verify=True)
        except CheckpointError as err:
            if report is not None:
                report(Torn(candidate.path, str(err)))
    return None


def retain(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints, and torn ones older than the
    oldest kept (a torn one newer than every committed one may still be being written);
    returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep: got {keep}, expected at least 1")
    committed, torn = scan(root)
    kept = committed[-keep:]
    if not kept:
        return []
    # The links the kept ones need stay too.
    by_name = {c.path.name: c for c in committed}
    needed = {c.path.name for c in kept}
    for c in kept:
        while c.parent is not None and c.parent in by_name:
            needed.add(c.parent)
            c = by_name[c.parent]
    floor = min(by_name[n].clock for n in needed)
    doomed = ([c.path for c in committed if c.path.name not in needed]
              + [t.path for t in torn if _clock_of(t.path) < floor])
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _clock_of(path: Path) -> int:
    m = _DIR.match(path.name)
    return int(m.group(1)) if m else -1


# ---- reading dense parameters back, by range ----

@dataclass(frozen=True)
class Piece:
    offset: int
    numel: int
    npz: Path
    meta: dict[str, Any]


class DenseReader:
    """Dense values and optimizer state of a committed checkpoint, by parameter and element range."""

    def __init__(self, checkpoint: Checkpoint, links: Sequence[Checkpoint] = ()) -> None:
        """`links`: an incremental checkpoint's chain (`chain`), whose npz files its slices may name."""
        self.checkpoint = checkpoint
        self._pieces: dict[str, list[Piece]] = {}
        self._npz: dict[Path, Any] = {}
        parts = sorted({f.name for f in checkpoint.files if re.fullmatch(r"part-\d+\.json", f.name)})
        for part in parts:
            meta = json.loads((checkpoint.path / part).read_bytes())
            own = checkpoint.path / part.replace(".json", ".npz")
            for entry in meta["slices"]:
                npz = own if "npz" not in entry else _linked(checkpoint, links, part, str(entry["npz"]))
                self._pieces.setdefault(entry["key"], []).append(
                    Piece(int(entry["offset"]), int(entry["numel"]), npz, entry))
        for key, pieces in self._pieces.items():
            pieces.sort(key=lambda p: p.offset)
            covered = 0
            for p in pieces:
                if p.offset != covered:
                    raise CheckpointError(f"checkpoint {checkpoint.path}: parameter {key!r} has a gap or "
                                          f"overlap at element {covered} (next piece starts at {p.offset})")
                covered += p.numel
            want = int(np.prod(checkpoint.params[key][1])) if key in checkpoint.params else covered
            if covered != want:
                raise CheckpointError(f"checkpoint {checkpoint.path}: parameter {key!r} covers {covered} of "
                                      f"{want} elements")

    def close(self) -> None:
        for npz in self._npz.values():
            npz.close()
        self._npz.clear()

    def __enter__(self) -> DenseReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def keys(self) -> list[str]:
        return sorted(self._pieces)

    def _array(self, piece: Piece, name: str) -> np.ndarray:
        npz = self._npz.get(piece.npz)
        if npz is None:
            npz = self._npz[piece.npz] = np.load(piece.npz, allow_pickle=False)
        return npz[f"s{piece.meta['index']}.{name}"]

    def overlapping(self, key: str, offset: int, numel: int) -> list[Piece]:
        pieces = self._pieces.get(key)
        if pieces is None:
            raise CheckpointError(f"checkpoint {self.checkpoint.path}: no parameter {key!r} "
                                  f"(it holds {self.keys[:8]})")
        return [p for p in pieces if p.offset < offset + numel and offset < p.offset + p.numel]

    def read(self, key: str, offset: int, numel: int, what: str = "value") -> np.ndarray:
        """Elements [offset, offset + numel) of `key`'s value or of its optimizer state array `what`."""
        out: list[np.ndarray] = []
        for p in self.overlapping(key, offset, numel):
            if what == "value":
                name = "value"
            else:
                names = p.meta["state_arrays"]
                if what not in names:
                    raise CheckpointError(f"checkpoint {self.checkpoint.path}: parameter {key!r} has no "
                                          f"optimizer state {what!r} (it has {names})")
                name = f"opt{names.index(what)}"
            a = self._array(p, name)
            lo, hi = max(offset, p.offset) - p.offset, min(offset + numel, p.offset + p.numel) - p.offset
            out.append(a[lo:hi])
        if sum(len(a) for a in out) != numel:
            raise CheckpointError(f"checkpoint {self.checkpoint.path}: parameter {key!r} has no elements "
                                  f"[{offset}, {offset + numel})")
        return np.concatenate(out) if len(out) != 1 else np.array(out[0], copy=True)

    def full(self, key: str) -> np.ndarray:
        """The whole value of `key`, in its parameter's shape and declared dtype."""
        dtype, shape = self.checkpoint.params[key]
        value = self.read(key, 0, int(np.prod(shape)))
        return value.astype(dtype).reshape(shape) if dtype != "bfloat16" else value.reshape(shape)


def _linked(checkpoint: Checkpoint, links: Sequence[Checkpoint], part: str, name: str) -> Path:
    """The npz of an ancestor that an incremental part's unchanged slice names, if its manifest lists it."""
    folder, _, file = name.removeprefix("../").partition("/")
    for link in links:
        if link.path.name == folder and any(f.name == file for f in link.files):
            return link.path / file
    raise CheckpointError(f"checkpoint {checkpoint.path}: {part} names {name}, which is not a file of its "
                          f"chain ({[c.path.name for c in links]}): read it with its chain")


def last_scheduled_call(checkpoint: Checkpoint) -> int:
    """The highest schedule id (pshard.coordinator) the parts hold a record of (their restored ones too),
    or below a floor they saved: 0 if none. A coordinator that restores the checkpoint numbers its calls
    above it, since the restored records would take a call of its own under one of those ids for that
    old one (a coordinator launched again with a fresh scheduler has the same registration generation,
    and so the same ids)."""
    top = 0
    for part in sorted({f.name for f in checkpoint.files if re.fullmatch(r"part-\d+\.json", f.name)}):
        for entry in json.loads((checkpoint.path / part).read_bytes())["slices"]:
            top = max([top, *map(int, entry.get("scheduled", {}))])  # older parts: none
    for part in table_parts(checkpoint):
        for _, meta in checkpoint_chain.part_tables(checkpoint.path, part).values():
            held = meta.get("scheduled") or {}
            records = [held.get("last", {}), *held.get("partitions", {}).values(),
                       *(r["calls"] for r in held.get("restored", ()))]  # held from an earlier restore
            top = max([top, int(held.get("floor", 0)) - 1, *(int(s) for r in records for s in r)])
    return top


def table_parts(checkpoint: Checkpoint) -> list[str]:
    """The names under which the parts saved tables (for ps_server.tables.files.load_tables)."""
    return sorted(f.name[: -len(".tables.json")] for f in checkpoint.files if f.name.endswith(".tables.json"))


def table_rows(checkpoint: Checkpoint, links: Sequence[Checkpoint] = ()
               ) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Every table's live rows, per part: name -> [(ids, values)] (for an export: no server needed). An
    incremental checkpoint's are folded from its `links` (`chain`)."""
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    folders = [c.path for c in links] or [checkpoint.path]
    for part in table_parts(checkpoint):
        for name in checkpoint_chain.part_tables(checkpoint.path, part):
            chunks = list(checkpoint_chain.chain_rows(checkpoint_chain.table_chain(folders, part, name),
                                                      ["values"]))
            ids = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
            values = np.concatenate([c[1]["values"] for c in chunks]) if chunks else None
            if values is None:
                sub = checkpoint_chain.part_tables(checkpoint.path, part)[name][0]
                values = np.load(sub / "values.npy")[:0]
            out.setdefault(name, []).append((ids, values))
    return out
