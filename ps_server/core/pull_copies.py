"""Compressed pulls on the server: per (worker, slice), a copy of what that worker holds.

A worker that pulls a slice compressed (issue 19; docs/guide/compression.md, Compressed pulls) is sent
`pack(value - copy)`, the change since what it holds, packed as a pushed gradient is (top-k or scaled
sign); both sides then add the unpacked change to their copy, the same float32 additions in the same
order, so the server's copy is the worker's bit for bit. What was not sent stays in `value - copy`, the
server-side residual: the next pull's change starts from it (error feedback on the server), so nothing
is dropped for good, only delayed. The slice's value itself is never touched: the server's state stays
exact, the workers' copies are an approximation of it.

Each copy carries a count of the pulls that made it, which the worker names as the request's base: a
reply lost on the way (the server added a change the worker never saw) or a server with no copy (a
restart, a failover's heir) is refused before anything of the request applies (PullBaseLostError), and
the worker pulls the slice whole, which starts a new copy.

Workers with the same history share one copy: in sync mode every worker pulls the same versions, so
after a whole pull at the same version their copies stay equal, and the change is packed once per slice
and version for all of them (as sync mode shares a whole pull's encoding), not once per worker. A copy
still held by another worker is copied before it moves on (copy on write): a worker that diverged (a
lost reply, a rejoin, async mode's own versions) gets its own.

Memory: one float32 copy of each compressed slice per distinct history: in sync mode about one, so a
server holding S bytes of compressed parameters keeps S more (at most S per worker, async).

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from pshard.common.compression import PullPack
from pshard.common.errors import InvalidArgumentError, PullBaseLostError, quote
from pshard.common.types import SliceKey
from pshard.common.wire import compress
from pshard.common.wire.codec import WireArray

_PULL_ENCODINGS = ("", "topk", "sign")


class _Copy:
    """A copy of a slice as some workers hold it: `count` pulls made it; `users` workers hold it; `next`,
    the one step taken from it so far ((version, encoding, k), the copy after it, what was sent), which
    a worker with the same history takes without packing again."""

    __slots__ = ("count", "next", "users", "values")

    def __init__(self, values: np.ndarray, count: int = 1) -> None:
        self.values = values
        self.count = count
        self.users = 0
        self.next: tuple[tuple[int, str, int], _Copy, WireArray] | None = None


class PullCopies:
    """The copies of every (worker, slice) pulled compressed on this server."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, SliceKey], _Copy] = {}
        # Per slice, the newest whole pull's copy and the version it was read at, for the next worker
        # that pulls the slice whole at that version to share.
        self._roots: dict[SliceKey, tuple[int, _Copy]] = {}

    def check(self, worker: str, keys: Sequence[SliceKey], packs: Sequence[PullPack],
              numels: Sequence[int]) -> None:
        """Refuse a request whose packing is malformed (InvalidArgumentError naming the slice and the
        values) or whose bases are not this server's (PullBaseLostError naming the first such slice).
        Called before anything of the request applies."""
        if not packs:
            return
        if len(packs) != len(keys):
            raise InvalidArgumentError(f"pull_packing: got {len(packs)} entries for {len(keys)} pulled "
                                       "slices, expected one per pulled slice (or none)")
        for key, pack, numel in zip(keys, packs, numels, strict=True):
            if pack.encoding not in _PULL_ENCODINGS:
                raise InvalidArgumentError(f"pull_packing of slice {quote(str(key))}: got encoding "
                                           f"{pack.encoding!r}, expected topk or sign (or none)")
            if pack.encoding == "topk" and not 1 <= pack.k <= numel:
                raise InvalidArgumentError(f"pull_packing of slice {quote(str(key))}: got k={pack.k}, the "
                                           f"slice has {numel} elements (expected 1 to {numel})")
            if pack.encoding != "topk" and pack.k:
                raise InvalidArgumentError(f"pull_packing of slice {quote(str(key))}: got k={pack.k} with "
                                           f"encoding {pack.encoding or 'none'!r}, which takes none")
            if not pack.packed or pack.base == 0:
                continue
            have = self._copies.get((worker, key))
            if have is None or have.count != pack.base:
                held = "no copy" if have is None else f"a copy after {have.count} pulls"
                raise PullBaseLostError(f"compressed pull of slice {quote(str(key))} by {worker!r}: the "
                                        f"worker applied {pack.base} pulls of it, this server holds {held}; "
                                        "pull it whole")

    def serve(self, worker: str, key: SliceKey, value: np.ndarray, pack: PullPack, clock: int,
              version: int = -1) -> WireArray:
        """What to send of `value` (the slice, float32, flat; read under its lock, at `version`; -1: never
        shared) to `worker`, and the server's copy moved on with it. `check` has passed for this request.
        The result may be shared with other workers: it must not be changed."""
        value = np.asarray(value, dtype=np.float32).reshape(-1)
        if pack.base == 0:  # `value` is the live slice: the copy kept and the one sent are both new
            root = self._roots.get(key)
            if root is None or root[0] != version or version < 0 or root[1].count != 1 or root[1].users == 0:
                root = (version, _Copy(value.copy()))
                self._roots[key] = root
            self._hold(worker, key, root[1])
            return WireArray(value.copy(), "float32")
        held = self._copies[(worker, key)]
        step = (version, pack.encoding, pack.k)
        taken = held.next
        # The step's copy must not have moved on since (its only holder may take the next step in place).
        if version >= 0 and taken is not None and taken[0] == step and taken[1].count == held.count + 1:
            self._hold(worker, key, taken[1])  # another worker with this history packed it already
            return taken[2]
        change = value - held.values  # the residual: the change since, plus what earlier pulls left
        wire = compress.pack_topk(change, pack.k) if pack.encoding == "topk" else compress.pack_sign(change)
        if held.users == 1:  # this worker's alone: moved on in place
            _add_sent(held.values, wire, change, key, clock)
            held.count += 1
            held.next = None
            return wire
        after = _Copy(held.values.copy(), held.count + 1)  # copy on write: the others still hold it
        _add_sent(after.values, wire, change, key, clock)
        held.next = (step, after, wire) if version >= 0 else None
        self._hold(worker, key, after)
        return wire

    def _hold(self, worker: str, key: SliceKey, copy: _Copy) -> None:
        old = self._copies.get((worker, key))
        if old is copy:
            return
        if old is not None:
            old.users -= 1
            if old.users == 0:
                old.next = None  # nobody holds it: what it led to is reachable through its holders only
        copy.users += 1
        self._copies[(worker, key)] = copy

    def residual(self, worker: str, key: SliceKey, value: np.ndarray) -> np.ndarray | None:
        """`value - copy`: what `worker` has not been sent of the slice yet (None: no copy)."""
        held = self._copies.get((worker, key))
        return None if held is None else np.asarray(value, dtype=np.float32).reshape(-1) - held.values

    def copy_of(self, worker: str, key: SliceKey) -> np.ndarray | None:
        held = self._copies.get((worker, key))
        return None if held is None else held.values.copy()

    def forget(self, keys: Iterable[SliceKey] | None = None, workers: Iterable[str] | None = None) -> None:
        """Drop the copies of `keys` (moved away), of `workers` (gone), or all (both None)."""
        if keys is None and workers is None:
            self._copies.clear()
            self._roots.clear()
            return
        drop_keys, drop_workers = set(keys or ()), set(workers or ())
        for entry in [e for e in self._copies if e[1] in drop_keys or e[0] in drop_workers]:
            held = self._copies.pop(entry)
            held.users -= 1
            if held.users == 0:
                held.next = None
        for key in drop_keys:
            self._roots.pop(key, None)

    @property
    def workers(self) -> set[str]:
        return {worker for worker, _ in self._copies}

    @property
    def nbytes(self) -> int:
        """The copies' bytes (each shared copy once), and what the last steps keep for lagging workers."""
        unique = {id(c): c for c in self._copies.values()}
        for c in list(unique.values()):
            if c.next is not None:
                unique[id(c.next[1])] = c.next[1]
        return sum(c.values.nbytes for c in unique.values())


def _add_sent(held: np.ndarray, wire: WireArray, change: np.ndarray, key: SliceKey, clock: int) -> None:
    """held += what the worker will unpack of `wire`. Sign's unpacked values are +scale where the change is
    >= 0 and -scale elsewhere (NaN included), which `where` gives from the change in two passes instead of
    unpacking the bits (the same float32 values, so the same sums as the worker's)."""
    if wire.encoding == "sign":
        scale = np.asarray(wire.array).reshape(-1).view(np.uint8)[:4].view("<f4")[0]
        held += np.where(change >= 0, scale, -scale)
        return
    compress.add_sent(held, wire, key, clock)
