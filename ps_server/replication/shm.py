"""Same-host replication through shared memory: the data plane of ps_server/replication/dense.py when a
primary and its backup share a host (docs/architecture.md, 9 Failures and 11 Transports).

The primary writes each slice's state (its value, then its optimizer arrays by name, each 64-byte
aligned) into segment files of the shared-memory directory; the Replicate call then carries only
where the state lies, its version and clocks. The backup maps the files read-only and its copy of a
slice is a view of the slot the last acknowledged call named. Cost per step: one memory copy of
the state on the primary, no encoding, nothing through a socket.

Each slice has two slots. The primary writes a new state into the slot the backup does not hold
(one call per backup is in flight at a time, so that slot is free), and the backup's copy moves to
it when the call is applied: a primary that dies mid-copy tears only a slot no copy points at. A
call whose outcome is unknown (it failed) leaves the primary unsure which slot the backup holds, so
it `reset`s: later states go to fresh segments. What the backup holds stays mapped by it, so it
outlives the primary's process; the primary unlinks a file once the backup has opened it (a
SIGKILLed primary's files are swept by the next server on the host, common/wire/shm.py).

Files, not memfds: a backup opens them by name, so no descriptor hand-off is needed. Primary and
backup are servers of one job that trust each other (the names travel over their authenticated
channel); a backup still opens only pshard segment names inside its own shared-memory directory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from pshard.common.types import SliceKey
from pshard.common.wire.codec import numpy_dtype
from pshard.common.wire.shm import parse_socket_name, pid_namespace
from pshard.ps_server.core.policies import Slot

_ALIGN = 64
# (array name, dtype name, shape): "" names the value; optimizer arrays follow by name.
ArraySpec = tuple[str, str, tuple[int, ...]]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def state_specs(slot: Slot) -> list[ArraySpec]:
    """The arrays of `slot`'s state in segment order."""
    specs: list[ArraySpec] = [("", slot.value.dtype.name, tuple(slot.value.shape))]
    for name in sorted(slot.opt_state):
        v = slot.opt_state[name]
        if isinstance(v, np.ndarray):
            specs.append((name, v.dtype.name, tuple(v.shape)))
    return specs


def specs_bytes(specs: Iterable[ArraySpec]) -> int:
    return sum(_aligned(int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize)
               for _, dtype, shape in specs)


def segment_name() -> str:
    # The hand-off sockets' naming (common/wire/shm.py), so that a dead primary's files are swept.
    return f"pshard-s-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}.seg"


class _Segment:
    def __init__(self, directory: Path, size: int) -> None:
        self.name = segment_name()
        self.path = directory / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now: a write to a page that a full tmpfs cannot back would be a SIGBUS; this
            # is an OSError (ENOSPC) the caller can answer by going inline.
            os.posix_fallocate(fd, 0, max(size, 1))
            self.map = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.opened = False  # the backup acknowledged a state in it (it has the file open)

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


class SegmentWriter:
    """Primary side, one per backup: where each slice's two slots are, and which one the backup holds.
    Calls in flight at once must carry different slices (the caller sees to it); the copies run
    unlocked, in the callers' threads."""

    def __init__(self, directory: str | Path) -> None:
        self._dir = Path(directory)
        self._segments: list[_Segment] = []
        self._slots: dict[SliceKey, tuple[_Segment, tuple[int, int]]] = {}
        self._held: dict[SliceKey, int] = {}  # which slot the backup's copy is (acknowledged)
        self._written: dict[SliceKey, int] = {}  # the slot of the call in flight
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        with self._lock:
            return [s.name for s in self._segments]

    def reserve(self, slots: Sequence[Slot]) -> None:
        """Give every slice of `slots` without room two slots, in one new segment (OSError if the
        directory cannot hold it: nothing is reserved then)."""
        with self._lock:
            missing = [s for s in slots if s.key not in self._slots]
            if not missing:
                return
            sizes = [specs_bytes(state_specs(s)) for s in missing]
            segment = _Segment(self._dir, 2 * sum(sizes))
            self._segments.append(segment)
            offset = 0
            for slot, size in zip(missing, sizes, strict=True):
                self._slots[slot.key] = (segment, (offset, offset + size))
                offset += 2 * size

    def write(self, slot: Slot) -> tuple[str, int]:
        """Copy `slot`'s state (the caller holds its lock) into the slot the backup does not hold:
        (segment name, offset) for the record."""
        with self._lock:
            segment, offsets = self._slots[slot.key]  # KeyError after a reset: the call fails
            which = 1 - self._held.get(slot.key, 1)
            self._written[slot.key] = which
        offset = offsets[which]
        position = offset
        for name, _, _ in state_specs(slot):
            source = slot.value if name == "" else slot.opt_state[name]
            assert isinstance(source, np.ndarray)
            count = source.size
            target = np.frombuffer(segment.map, dtype=source.dtype, count=count, offset=position)
            np.copyto(target, source.reshape(-1))
            position += _aligned(source.nbytes)
        return segment.name, offset

    def acknowledged(self, keys: Iterable[SliceKey]) -> None:
        """The backup applied the states last written for `keys`: their slots flip; a segment it has
        now opened is unlinked (its pages live on in both mappings)."""
        with self._lock:
            for key in keys:
                which = self._written.pop(key, None)
                if which is None:
                    continue
                self._held[key] = which
                segment = self._slots[key][0]
                if not segment.opened:
                    segment.opened = True
                    segment.unlink()

    def reset(self) -> None:
        """Forget every slot (a call failed: the backup may hold either one); later states go to new
        segments. The backup's copies stay valid in its own mappings."""
        with self._lock:
            for segment in self._segments:
                segment.unlink()
            self._segments, self._slots, self._held, self._written = [], {}, {}, {}

    close = reset


class SegmentMaps:
    """Backup side: the segments each primary writes, mapped read-only."""

    def __init__(self, directory: str | Path) -> None:
        self._dir = Path(directory)
        self._maps: dict[str, dict[str, mmap.mmap]] = {}  # primary -> segment name -> mapping
        self._lock = threading.Lock()

    def keep(self, primary: str, names: Iterable[str]) -> None:
        """Forget `primary`'s segments other than `names` (the copies that are views of them keep
        their pages mapped until they are replaced)."""
        wanted = set(names)
        with self._lock:
            maps = self._maps.get(primary, {})
            for name in [n for n in maps if n not in wanted]:
                del maps[name]

    def drop(self, primary: str | None = None) -> None:
        with self._lock:
            if primary is None:
                self._maps.clear()
            else:
                self._maps.pop(primary, None)

    def arrays(self, primary: str, name: str, offset: int, specs: Sequence[ArraySpec]
               ) -> dict[str, np.ndarray]:
        """Read-only views of a state's arrays (name -> array; "" is the value). OSError if the
        segment cannot be opened here (another host), ValueError if the arrays lie outside it."""
        mapping = self._open(primary, name)
        out: dict[str, np.ndarray] = {}
        position = offset
        for array_name, dtype, shape in specs:
            count, kind = int(np.prod(shape, dtype=np.int64)), numpy_dtype(dtype)
            out[array_name] = np.frombuffer(mapping, dtype=kind, count=count, offset=position).reshape(shape)
            position += _aligned(count * kind.itemsize)
        return out

    def _open(self, primary: str, name: str) -> mmap.mmap:
        with self._lock:
            mapping = self._maps.get(primary, {}).get(name)
            if mapping is not None:
                return mapping
        if "/" in name or not name.endswith(".seg") or parse_socket_name(name) is None:
            raise OSError(f"not a pshard segment name: {name!r}")
        fd = os.open(self._dir / name, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._lock:
            self._maps.setdefault(primary, {})[name] = mapping
        return mapping


def replica_shm_dir(transport: str, shm_dir: str) -> str | None:
    """Where a server's replication segments live: its shared-memory directory when it offers shared
    memory at all (transport auto or shm), else None (replication then moves its bytes over gRPC)."""
    return shm_dir if transport in ("auto", "shm") else None
