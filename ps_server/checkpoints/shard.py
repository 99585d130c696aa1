"""Save and load one shard: weights, optimizer state and clocks (docs/architecture.md, 9 Failures).

This is a server's own checkpoint, restored by the same server with the same layout after a
restart. A consistent checkpoint of the whole job, which restores onto any number of servers, is a
global checkpoint (pshard.common.checkpoint_store, ps_server.checkpoints.global_part).

A checkpoint named `name` is two files in `directory`:

- `<name>.ckpt-<token>.npz`: every array (values, optimizer state arrays, pending sync
  sums), written with `np.savez` and read with `allow_pickle=False`;
- `<name>.json`: everything else (job config, keys, dtypes, versions, clocks, scheduled calls' push
  numbers and floor (pshard.coordinator), scalar optimizer state), and the name of the npz it belongs to.

Each file is written to a temporary name, fsync'ed and moved into place with
`os.replace`; the json goes last. A fresh token per save means a new npz never
overwrites the one the current json names, so a crash at any point leaves the
previous checkpoint loadable: the old json still names the old, complete npz.
Older npz files of the same name are deleted only after the new json is in place.
One save per directory and name at a time (a lock here, and the handlers queue their saves):
otherwise one save's clean-up deletes another's temporary files, or the npz its json names.

Never pickle: arrays go through npz, the rest through JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from pshard.common.checkpoint_store import sync_directory, write_atomically
from pshard.common.errors import CheckpointError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey
from pshard.ps_server.core.optimizers import SliceState
from pshard.ps_server.core.store import ShardSnapshot, SliceSnapshot

log = logging.getLogger("pshard.ps")

FORMAT = 1
_TMP_SUFFIX = ".tmp"
_SAVING: dict[tuple[str, str], threading.Lock] = {}
_SAVING_LOCK = threading.Lock()


def _save_lock(folder: Path, name: str) -> threading.Lock:
    with _SAVING_LOCK:
        return _SAVING.setdefault((str(folder.resolve()), name), threading.Lock())


def save_shard(directory: str | os.PathLike[str], snapshot: ShardSnapshot, name: str) -> Path:
    """Write `snapshot` as checkpoint `name`; returns the path of its json (the file that commits it)."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"checkpoint name: got {name!r}, expected a plain file name")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    with _save_lock(folder, name):
        return _save(folder, snapshot, name)


def _save(folder: Path, snapshot: ShardSnapshot, name: str) -> Path:
    arrays_name = f"{name}.ckpt-{uuid.uuid4().hex[:12]}.npz"
    arrays: dict[str, Any] = {}  # Any: savez's stubs type **kwds like its allow_pickle flag
    slices = [_slice_meta(i, s, arrays) for i, s in enumerate(snapshot.slices)]
    # allow_pickle=False: an object array fails here instead of turning into a pickle.
    write_atomically(folder / arrays_name, lambda f: np.savez(f, allow_pickle=False, **arrays))
    meta = {
        "format": FORMAT,
        "arrays": arrays_name,
        "saved_at": time.time(),  # logged by a restore (not read otherwise)
        "config": dataclasses.asdict(snapshot.config),
        "generations": snapshot.generations,
        "quorum": snapshot.quorum,
        "seen": list(snapshot.seen),
        "counters": snapshot.counters,
        "schedule_floor": snapshot.schedule_floor,
        "slices": slices,
    }
    encoded = json.dumps(meta, indent=1).encode()
    meta_path = folder / f"{name}.json"
    write_atomically(meta_path, lambda f: f.write(encoded))
    sync_directory(folder)
    _remove_superseded(folder, name, keep=arrays_name)
    return meta_path


# What reading a damaged checkpoint raises: a truncated or byte-flipped npz fails in zipfile (bad
# header, bad CRC), zlib or numpy's header parsing; a damaged json in json (ValueError) or in its fields.
_UNREADABLE = (OSError, ValueError, EOFError, KeyError, TypeError, AttributeError, zipfile.BadZipFile,
               zlib.error)


def load_shard(directory: str | os.PathLike[str], name: str) -> ShardSnapshot | None:
    """The last completely written checkpoint `name`, or None if there is none; CheckpointError naming
    the file and why when it cannot be read. A restore logs which checkpoint it read."""
    folder = Path(directory)
    meta_path = folder / f"{name}.json"
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        return None
    except _UNREADABLE as err:
        raise CheckpointError(f"checkpoint {meta_path}: cannot read it ({_reason(err)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"checkpoint {meta_path}: got format {got!r}, expected {FORMAT}")
    arrays_path = folder / str(meta.get("arrays"))
    if not arrays_path.exists():
        raise CheckpointError(f"checkpoint {meta_path}: names {arrays_path.name}, which is missing")
    try:
        with np.load(arrays_path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except _UNREADABLE as err:
        raise CheckpointError(f"checkpoint {meta_path}: cannot read {arrays_path} ({_reason(err)})") from None
    try:
        snap = ShardSnapshot(
            config=_config_from_json(meta["config"]),
            slices=tuple(_slice_from_meta(i, m, arrays) for i, m in enumerate(meta["slices"])),
            generations={w: int(g) for w, g in meta["generations"].items()},
            quorum=None if meta["quorum"] is None else {w: int(g) for w, g in meta["quorum"].items()},
            seen=tuple(meta["seen"]),
            counters={k: int(v) for k, v in meta["counters"].items()},
            schedule_floor=int(meta.get("schedule_floor", 0)),  # absent from checkpoints of older servers
        )
    except _UNREADABLE as err:
        raise CheckpointError(f"checkpoint {meta_path}: does not match {arrays_path.name} or is damaged "
                              f"({_reason(err)})") from None
    log.info("restoring checkpoint %s (arrays %s, %s): %s", meta_path, arrays_path.name,
             _age(meta.get("saved_at")), _versions(snap))
    return snap


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _age(saved_at: object) -> str:
    if not isinstance(saved_at, (int, float)):
        return "saved at an unrecorded time"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(saved_at))
    return f"saved {stamp}, {max(0.0, time.time() - saved_at):.0f} s ago"


def _versions(snap: ShardSnapshot) -> str:
    if not snap.slices:
        return "no slices"
    low, high = min(s.version for s in snap.slices), max(s.version for s in snap.slices)
    return f"{len(snap.slices)} slices at version {low}" + (f"..{high}" if high != low else "")


# ---- one slice ----

def _slice_meta(i: int, s: SliceSnapshot, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    arrays[f"s{i}.value"] = s.value
    if s.pending is not None:
        arrays[f"s{i}.pending"] = s.pending
    state_arrays: list[str] = []
    scalars: dict[str, int | float] = {}
    for name, v in s.opt_state.items():
        if isinstance(v, np.ndarray):
            # Named by position: optimizer state names need not be valid file names inside a zip.
            arrays[f"s{i}.opt{len(state_arrays)}"] = v
            state_arrays.append(name)
        else:
            scalars[name] = v.item() if isinstance(v, np.generic) else v
    return {
        "key": s.key.key, "part": s.key.part, "dtype": s.dtype, "version": s.version,
        "clocks": s.clocks, "floors": s.floors, "contributors": list(s.contributors),
        "pending": s.pending is not None, "state_arrays": state_arrays, "state_scalars": scalars,
        "scheduled": {str(sid): seq for sid, seq in s.scheduled.items()},  # JSON keys are strings
    }


def _slice_from_meta(i: int, m: dict[str, Any], arrays: dict[str, np.ndarray]) -> SliceSnapshot:
    state: SliceState = {name: arrays[f"s{i}.opt{j}"] for j, name in enumerate(m["state_arrays"])}
    state.update(m["state_scalars"])
    return SliceSnapshot(
        key=SliceKey(m["key"], int(m["part"])), dtype=m["dtype"], value=arrays[f"s{i}.value"],
        version=int(m["version"]), opt_state=state,
        clocks={w: int(c) for w, c in m["clocks"].items()},
        floors={w: int(c) for w, c in m["floors"].items()},
        pending=arrays[f"s{i}.pending"] if m["pending"] else None,
        contributors=tuple(m["contributors"]),
        scheduled={int(sid): int(seq) for sid, seq in m.get("scheduled", {}).items()},  # older: none
    )


def _config_from_json(d: dict[str, Any]) -> JobConfig:
    opt = dict(d["optimizer"])
    opt["betas"] = tuple(opt["betas"])  # JSON has no tuples
    return JobConfig(**{**d, "optimizer": OptimizerConfig(**opt)})


# ---- files ----

def _remove_superseded(folder: Path, name: str, keep: str) -> None:
    ours = re.compile(rf"^(?:{re.escape(name)}\.ckpt-[0-9a-f]{{12}}\.npz"
                      rf"|\.{re.escape(name)}\.(?:json|ckpt-[0-9a-f]{{12}}\.npz)\.[0-9a-f]{{8}}{re.escape(_TMP_SUFFIX)})$")
    for entry in folder.iterdir():
        if entry.name != keep and ours.match(entry.name):
            entry.unlink(missing_ok=True)
