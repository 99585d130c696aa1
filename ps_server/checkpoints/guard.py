"""What a global-checkpoint request may ask of this server, checked before anything is read or written.

SaveCheckpointPart and RestoreCheckpoint name a directory, ranges and a clock chosen by the caller.
Unchecked, the directory is an arbitrary file write (save) or read (restore) on the server's host,
the ranges overwrite another part's files or describe slices this server does not hold, and a clock
no slice will ever reach holds the call for its whole timeout. Here, pure and before any wait:

- the directory must lie inside the root the server was started with (`--global-checkpoint-dir`,
  the chief's root on a file system they share), after symbolic links are followed; no root
  configured refuses global checkpoints altogether (docs/architecture.md, 9 Failures);
- ranges name each slice once, inside its parameter, and (when saving) exactly the slices held;
- a part's clock is at most one past the newest slice version or clock pushed (the step being taken).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from pshard.common import checkpoint_store as ckpt
from pshard.common.checkpoint_store import CheckpointError
from pshard.common.cluster.layout import MAX_ROW_PARTITIONS
from pshard.common.errors import FutureClockError, InvalidArgumentError, PermissionDeniedError
from pshard.common.types import SliceKey

ROOT_FLAG = "--global-checkpoint-dir"
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux: a longer name cannot be opened anyway
# A part waits for at most the clock after the newest one this server has seen (the chief takes its
# checkpoints between steps: at the clock it has just pulled).
CLOCK_MARGIN = 1


def confine(root: str | None, directory: str, field: str = "directory") -> Path:
    """`directory` (absolute, or relative to the root) resolved inside `root`; refused otherwise."""
    if not root:
        raise CheckpointError(f"global checkpoints are off on this server: start it with {ROOT_FLAG} DIR "
                              "(the directory the chief's --global-checkpoint-dir names, on a file system "
                              "they share)")
    if not directory:
        raise InvalidArgumentError(f"{field}: empty; name a checkpoint directory inside {ROOT_FLAG}")
    if len(directory) > MAX_PATH_CHARS or "\x00" in directory:
        raise InvalidArgumentError(f"{field}: {directory[:80]!r}... is not a path ({len(directory)} chars, "
                                   f"at most {MAX_PATH_CHARS}, no NUL)")
    if ".." in Path(directory).parts:
        raise InvalidArgumentError(f"{field}: {directory!r} has a '..' component")
    base = Path(root).resolve()
    resolved = (base / directory).resolve()  # an absolute `directory` replaces the base; links followed
    if resolved == base or not resolved.is_relative_to(base):
        raise PermissionDeniedError(f"{field}: {directory!r} (resolved {str(resolved)!r}) is not inside this "
                                    f"server's {ROOT_FLAG} {str(base)!r}")
    return resolved


def check_ranges(ranges: Mapping[SliceKey, ckpt.Range], given: int) -> None:
    """Each slice once (`given`: how many the request listed), non-empty and inside its parameter."""
    if len(ranges) != given:
        raise InvalidArgumentError(f"ranges: {given} given, {given - len(ranges)} of them name a slice twice")
    for key, r in ranges.items():
        size = math.prod(r.shape)
        if not r.key or r.numel < 1 or r.offset + r.numel > size:
            raise InvalidArgumentError(f"ranges: slice {str(key)!r} covers elements [{r.offset}, "
                                       f"{r.offset + r.numel}) of a parameter of shape {r.shape} ({size} "
                                       "elements): it must be non-empty and inside it")


def check_held(ranges: Mapping[SliceKey, ckpt.Range], held: Mapping[SliceKey, int]) -> None:
    """The ranges name exactly the slices this server holds (slice -> its elements), at their sizes."""
    missing = sorted(str(k) for k in held.keys() - ranges.keys())
    foreign = sorted(str(k) for k in ranges.keys() - held.keys())
    if missing or foreign:
        raise InvalidArgumentError(f"ranges: do not match this server's slices (the layout's): missing "
                                   f"{missing[:8]}, not held here {foreign[:8]}")
    for key, numel in held.items():
        if ranges[key].numel != numel:
            raise InvalidArgumentError(f"ranges: slice {str(key)!r} has {ranges[key].numel} elements in the "
                                       f"request, {numel} on this server")


def check_clock(clock: int, newest_version: int, newest_clock: int) -> None:
    """FutureClockError for a clock this server cannot reach without steps nobody has pushed yet."""
    reachable = max(newest_version, newest_clock) + CLOCK_MARGIN
    if clock > reachable:
        raise FutureClockError(f"checkpoint part: clock {clock} is beyond what this server knows: its newest "
                               f"slice version is {newest_version} and the newest clock pushed to it "
                               f"{newest_clock}, so clock {reachable} is the furthest it can wait for")


def check_servers(server: int, servers: int, row_owners: Sequence[int] = ()) -> None:
    if not 0 <= server < servers:
        raise InvalidArgumentError(f"server: {server} is not an index among servers={servers}")
    bad = next((p for p, o in enumerate(row_owners) if not 0 <= o < servers), None)
    if bad is not None:
        raise InvalidArgumentError(f"row_owners[{bad}]: {row_owners[bad]} is not an index among "
                                   f"servers={servers}")
    if len(row_owners) > MAX_ROW_PARTITIONS:
        raise InvalidArgumentError(f"row_owners: got {len(row_owners)} partitions, at most "
                                   f"{MAX_ROW_PARTITIONS}")
