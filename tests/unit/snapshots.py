"""Comparing store snapshots byte for byte, for tests that check a refused request changed nothing."""

from __future__ import annotations

import numpy as np
from pshard.common.types import SliceKey
from pshard.ps_server.core.store import ShardSnapshot, ShardStore, SliceSnapshot


def snapshot_diff(mine: ShardSnapshot, other: ShardSnapshot) -> list[str]:
    """Every difference of `mine` from `other`, compared byte for byte; empty when they are equal."""
    out = [f"{name}: {a!r} != {b!r}" for name, a, b in (
        ("config", mine.config, other.config), ("generations", mine.generations, other.generations),
        ("quorum", mine.quorum, other.quorum), ("seen", mine.seen, other.seen),
        ("counters", mine.counters, other.counters),
        ("schedule_floor", mine.schedule_floor, other.schedule_floor),
        ("keys", [s.key for s in mine.slices], [s.key for s in other.slices])) if a != b]
    for a, b in zip(mine.slices, other.slices, strict=False):
        out.extend(f"{a.key}: {d}" for d in _slice_diff(a, b))
    return out


def declared_keys(store: ShardStore) -> set[SliceKey]:
    return {s.key for s in store.snapshot().slices}


def _same_array(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    return bool(a == b)  # scalars (step counts): a checkpoint may turn numpy scalars into Python ones


def _slice_diff(a: SliceSnapshot, b: SliceSnapshot) -> list[str]:
    out = [name for name in ("dtype", "version", "clocks", "floors", "contributors", "scheduled")
           if getattr(a, name) != getattr(b, name)]
    out += [name for name in ("value", "pending") if not _same_array(getattr(a, name), getattr(b, name))]
    if a.opt_state.keys() != b.opt_state.keys():
        out.append(f"opt_state keys {sorted(a.opt_state)} != {sorted(b.opt_state)}")
    else:
        out += [f"opt_state[{k!r}]" for k in a.opt_state if not _same_array(a.opt_state[k], b.opt_state[k])]
    return out
