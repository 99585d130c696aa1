"""Parameter layout: which server holds which slice of which parameter.

A parameter whose bytes exceed `slice_bytes` is cut into contiguous pieces of its
flattened elements, at least one per server, so one big layer is spread over all
servers instead of loading one. Each such tensor first puts one piece on every
server; the remaining slices are then placed greedily, largest first, on the server
with the fewest bytes so far (ties: lowest index) — deterministic for a given set
of (key, shape, dtype) and server list, so every worker that computes the layout
gets the same one. The scheduler stores the first proposal and hands it out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pshard.common.errors import EmptyRequestError, InvalidArgumentError, LayoutConflictError
from pshard.common.types import SliceKey
from pshard.common.wire.dtypes import DTYPES

# 4 MiB: the largest chunk the data plane sends, so every slice travels in one frame
# and the server can use it zero-copy. Small enough to spread a 32 MiB layer over servers.
DEFAULT_SLICE_BYTES = 4 * 2**20

ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}

# Row partitions a layout may hash table ids into: every layout message and every server's served set
# carries one entry per partition, and a few per server are all a move needs.
MAX_ROW_PARTITIONS = 4096


@dataclass(frozen=True)
class ParamSpec:
    key: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.key:
            raise InvalidArgumentError("param key: got '', expected a non-empty name")
        if self.dtype not in ITEMSIZE:
            raise InvalidArgumentError(f"param {self.key!r} dtype: got {self.dtype!r}, expected one of "
                                       f"{sorted(ITEMSIZE)}")
        if any(d < 0 for d in self.shape):
            raise InvalidArgumentError(f"param {self.key!r} shape: got {self.shape}, dims must be >= 0")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class LayoutSlice:
    key: str
    part: int
    server: int
    offset: int
    numel: int

    @property
    def slice_key(self) -> SliceKey:
        return SliceKey(self.key, self.part)


@dataclass(frozen=True)
class Layout:
    params: tuple[ParamSpec, ...]
    servers: tuple[str, ...]
    slice_bytes: int
    slices: tuple[LayoutSlice, ...]
    version: int = 0
    # Backups per slice (docs/architecture.md, 9 Failures): server i's slices are copied to the next
    # `replicas` live servers in ring order (pshard.common.cluster.replicas).
    replicas: int = 0
    # Sparse-table row partitions (docs/architecture.md, 9 Failures): partition p, the ids whose row
    # hash (pshard.common.sparse.server_of) is p, is served by server row_owners[p]. A failover
    # moves a dead server's partitions with its slices; () is the identity.
    row_owners: tuple[int, ...] = ()
    _by_key: dict[str, tuple[LayoutSlice, ...]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_key: dict[str, list[LayoutSlice]] = {}
        for s in self.slices:
            by_key.setdefault(s.key, []).append(s)
        self._by_key.update({k: tuple(sorted(v, key=lambda s: s.part)) for k, v in by_key.items()})

    def param(self, key: str) -> ParamSpec:
        for p in self.params:
            if p.key == key:
                return p
        raise LayoutConflictError(f"key {key!r} is not in the layout (it has {len(self.params)} params)")

    def slices_of(self, key: str) -> tuple[LayoutSlice, ...]:
        return self._by_key[key]

    @property
    def partition_count(self) -> int:
        """How many row partitions table ids are hashed into (pshard.common.sparse.server_of): one per
        server unless the layout was planned with more (so that they can move one by one)."""
        return len(self.row_owners) if self.row_owners else len(self.servers)

    def home_partitions(self, server: int) -> tuple[int, ...]:
        """The row partitions plan_layout gave server `server` (before any failover or move)."""
        n = len(self.servers)
        return tuple(p for p in range(self.partition_count) if p % n == server)

    def row_owner(self, partition: int) -> int:
        """The server serving row partition `partition` (itself unless a failover moved it)."""
        return self.row_owners[partition] if self.row_owners else partition

    def owners(self) -> tuple[int, ...]:
        """The server of every row partition, in partition order."""
        return self.row_owners or tuple(range(len(self.servers)))

    def partitions_on(self, server: int) -> tuple[int, ...]:
        """The row partitions server `server` serves."""
        return tuple(p for p, s in enumerate(self.owners()) if s == server)

    def slices_on(self, server: int) -> tuple[LayoutSlice, ...]:
        return tuple(s for s in self.slices if s.server == server)

    def bytes_per_server(self) -> list[int]:
        loads = [0] * len(self.servers)
        for s in self.slices:
            loads[s.server] += s.numel * ITEMSIZE[self.param(s.key).dtype]
        return loads

    def same_params(self, other: Layout) -> str | None:
        """None when both describe the same parameters; else what differs first."""
        mine = {p.key: p for p in self.params}
        theirs = {p.key: p for p in other.params}
        for key in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(key), theirs.get(key)
            if a != b:
                return (f"param {key!r}: stored layout has "
                        f"{(a.dtype, a.shape) if a else 'nothing'}, proposal has "
                        f"{(b.dtype, b.shape) if b else 'nothing'}")
        return None


def plan_layout(params: Sequence[ParamSpec], servers: Sequence[str],
                slice_bytes: int = DEFAULT_SLICE_BYTES, replicas: int = 0,
                row_partitions: int | None = None) -> Layout:
    """`row_partitions`: how many row partitions table ids are hashed into, partition p on server
    p mod len(servers) (None: one per server, `row_owners` left empty as in every older layout)."""
    if not servers:
        raise EmptyRequestError("servers: got none, a layout needs at least one parameter server")
    if row_partitions is not None and not len(servers) <= row_partitions <= MAX_ROW_PARTITIONS:
        raise InvalidArgumentError(f"row_partitions: got {row_partitions}, expected {len(servers)} (one per "
                                   f"server) to {MAX_ROW_PARTITIONS}")
    if slice_bytes < 64:
        raise InvalidArgumentError(f"slice_bytes: got {slice_bytes}, expected >= 64")
    if not 0 <= replicas < len(servers):
        raise InvalidArgumentError(f"replicas: got {replicas}, expected 0 to {len(servers) - 1} "
                                   f"(a backup lives on another server; there are {len(servers)})")
    seen: set[str] = set()
    for p in params:
        if p.key in seen:
            raise InvalidArgumentError(f"param key {p.key!r} appears twice")
        seen.add(p.key)
    n = len(servers)
    spread: list[list[tuple[str, int, int, int, int]]] = []  # one piece per server of each split tensor
    pieces: list[tuple[str, int, int, int, int]] = []  # (key, part, offset, numel, nbytes)
    # Sorted by key: the layout (params included) must not depend on the order they were given in.
    params = sorted(params, key=lambda p: p.key)
    for p in params:
        itemsize = ITEMSIZE[p.dtype]
        per_slice = max(1, slice_bytes // itemsize)
        parts = max(1, math.ceil(p.numel / per_slice))
        if parts > 1:
            parts = max(parts, min(n, p.numel))
        # Equal-sized parts (not full slices plus a runt) balance better across servers.
        base, extra = divmod(p.numel, parts)
        cut, offset = [], 0
        for part in range(parts):
            size = base + (1 if part < extra else 0)
            cut.append((p.key, part, offset, size, size * itemsize))
            offset += size
        if parts > 1:
            spread.append(cut[:n])
            cut = cut[n:]
        pieces.extend(cut)
    loads = [0] * n
    placed: list[LayoutSlice] = []

    def place(piece: tuple[str, int, int, int, int], server: int) -> None:
        key, part, offset, numel, nbytes = piece
        loads[server] += nbytes
        placed.append(LayoutSlice(key, part, server, offset, numel))

    # Equal pieces on distinct servers (least loaded first) add the same load to each: balance is kept.
    for first in spread:
        for piece, server in zip(first, sorted(range(n), key=lambda i: (loads[i], i)), strict=False):
            place(piece, server)
    # Largest first onto the least-loaded server: the classic LPT heuristic, within 4/3 of optimal.
    for piece in sorted(pieces, key=lambda x: (-x[4], x[0], x[1])):
        place(piece, min(range(n), key=lambda i: (loads[i], i)))
    placed.sort(key=lambda s: (s.key, s.part))
    owners = () if row_partitions in (None, n) else tuple(p % n for p in range(row_partitions or n))
    return Layout(tuple(params), tuple(servers), slice_bytes, tuple(placed), replicas=replicas,
                  row_owners=owners)
