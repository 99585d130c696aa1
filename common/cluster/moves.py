"""Live re-sharding plans (docs/architecture.md, 4 Parameter layout): which dense slices and which
table row partitions move when a server joins a running job, drains out of it, or when row partitions
are rebalanced by load. Pure: the scheduler runs a plan, the CLI shows it, the tests drive it.

Every plan moves as little as it can, because each moved byte is a catch-up copy over the network
while training goes on:
- a join only moves things *to* the joiner, from the most loaded servers, while an item fits in half
  the gap between a donor and the joiner, then while one rounds the joiner to the nearest item of
  the mean: the bytes moved are the joiner's share;
- a drain only moves things *off* the drained server, largest first onto the least loaded server
  (LPT, as plan_layout places them);
- a rebalance only moves row partitions, from the hottest server to the coolest, by the same rule,
  while the hottest is above `tolerance` times the mean.
A move never takes as much as the gap between its two servers, so it lowers the sum of squared
loads: every plan ends.

Indices in `Layout.servers` stay stable: a joiner is appended, a drained server keeps its place and
serves nothing (as a failed-over dead server does), so no slice or partition is renumbered. Row
partitions keep their count: they are the unit a table moves by, so a join writes `row_owners` out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from pshard.common.cluster.layout import ITEMSIZE, Layout, LayoutSlice
from pshard.common.errors import InvalidArgumentError
from pshard.common.types import SliceKey

# An item is a dense slice (its SliceKey) or a row partition (its number).
Item: TypeAlias = SliceKey | int


class NowhereToMoveError(InvalidArgumentError):
    """A drain of the last server that could serve: its slices and rows would have no owner."""


@dataclass(frozen=True)
class Move:
    """One dense slice or row partition changing owner: copied to `target`, then switched."""

    item: Item
    source: int
    target: int
    nbytes: int

    @property
    def what(self) -> str:
        """How the scheduler's log line and `pshard status` name it."""
        if isinstance(self.item, int):
            return f"row partition {self.item}"
        return f"slice {self.item.key}/{self.item.part}"


@dataclass(frozen=True)
class MovePlan:
    before: Layout
    after: Layout
    moves: tuple[Move, ...]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moves)

    def moves_to(self, server: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.target == server)

    def moves_from(self, server: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.source == server)


def partition_count(layout: Layout) -> int:
    """How many row partitions the layout's tables are hashed into."""
    return len(layout.owners())


def slice_nbytes(layout: Layout, s: LayoutSlice) -> int:
    return s.numel * ITEMSIZE[layout.param(s.key).dtype]


def server_loads(layout: Layout, partition_bytes: Sequence[float]) -> list[float]:
    """Bytes (or any load) per server: its slices' bytes plus its row partitions' `partition_bytes`."""
    _check_partitions(layout, partition_bytes, "partition_bytes")
    loads: list[float] = [0.0] * len(layout.servers)
    for s in layout.slices:
        loads[s.server] += slice_nbytes(layout, s)
    for p, owner in enumerate(layout.owners()):
        loads[owner] += partition_bytes[p]
    return loads


def plan_join(layout: Layout, address: str, partition_bytes: Sequence[int],
              live: Collection[int] | None = None) -> MovePlan:
    """The plan that gives server `address` its share of slices and row partitions, taken from the most
    loaded `live` servers (None: every server). `address` is appended to the servers, or, when it is
    there already serving nothing (drained or failed over before), keeps its place."""
    if not address:
        raise InvalidArgumentError("join address: got '', expected host:port")
    joiner = layout.servers.index(address) if address in layout.servers else len(layout.servers)
    if joiner < len(layout.servers) and _items_on(layout, joiner):
        raise InvalidArgumentError(
            f"join {address!r}: it is server {joiner} of the layout (version {layout.version}) and serves "
            f"{len(_items_on(layout, joiner))} slices and row partitions already; drain it first")
    grown = layout
    if joiner == len(layout.servers):
        grown = dataclasses.replace(layout, servers=(*layout.servers, address), row_owners=layout.owners())
    donors = set(range(len(layout.servers)) if live is None else live) - {joiner}
    _check_servers(layout, donors, "live")
    sizes = _sizes(grown, partition_bytes)
    owner = _owners(grown)
    loads = server_loads(grown, partition_bytes)
    moves = _balance(sizes, owner, loads, donors=donors, recipients={joiner}, tolerance=1.0)
    return _plan(layout, grown, moves, sizes)


def plan_drain(layout: Layout, server: int, partition_bytes: Sequence[int],
               live: Collection[int] | None = None) -> MovePlan:
    """The plan that moves everything `server` serves onto the other `live` servers (None: every
    server), largest first onto the least loaded. A server serving nothing gets an empty plan."""
    _check_servers(layout, {server}, "drain server")
    recipients = set(range(len(layout.servers)) if live is None else live) - {server}
    _check_servers(layout, recipients, "live")
    sizes = _sizes(layout, partition_bytes)
    mine = _items_on(layout, server)
    if mine and not recipients:
        raise NowhereToMoveError(
            f"drain server {server} ({layout.servers[server]}): no other live server to take its "
            f"{len(mine)} slices and row partitions (servers {list(layout.servers)}, live "
            f"{sorted(live) if live is not None else 'all'})")
    loads = server_loads(layout, partition_bytes)
    moves: list[Move] = []
    for item in sorted(mine, key=lambda i: (-sizes[i], _order(i))):
        target = min(recipients, key=lambda r: (loads[r], r))
        loads[server] -= sizes[item]
        loads[target] += sizes[item]
        moves.append(Move(item, server, target, int(sizes[item])))
    return _plan(layout, layout, moves, sizes)


def plan_rebalance(layout: Layout, partition_load: Sequence[float], partition_bytes: Sequence[int],
                   live: Collection[int] | None = None, tolerance: float = 1.2,
                   max_moves: int | None = None) -> MovePlan:
    """The plan that moves row partitions from the hottest `live` servers to the coolest, by
    `partition_load` (rows/s each partition serves), until the hottest is within `tolerance` times
    the mean load or no move lowers it. Dense slices stay: their load follows their bytes, which
    joins and drains balance already. `partition_bytes` sizes each move."""
    if not tolerance >= 1.0:
        raise InvalidArgumentError(f"rebalance tolerance: got {tolerance}, expected >= 1.0 (times the mean)")
    if max_moves is not None and max_moves < 0:
        raise InvalidArgumentError(f"rebalance max_moves: got {max_moves}, expected >= 0")
    _check_partitions(layout, partition_load, "partition_load")
    if any(x < 0 for x in partition_load):
        raise InvalidArgumentError(f"partition_load: got {list(partition_load)}, expected loads >= 0")
    servers = set(range(len(layout.servers)) if live is None else live)
    _check_servers(layout, servers, "live")
    sizes: dict[Item, float] = {p: float(x) for p, x in enumerate(partition_load)}
    owner: dict[Item, int] = {p: o for p, o in enumerate(layout.owners())}
    loads = [0.0] * len(layout.servers)
    for p, o in enumerate(layout.owners()):
        loads[o] += partition_load[p]
    moves = _balance(sizes, owner, loads, donors=servers, recipients=servers, tolerance=tolerance,
                     max_moves=max_moves)
    nbytes = _sizes(layout, partition_bytes)
    return _plan(layout, layout, [dataclasses.replace(m, nbytes=int(nbytes[m.item])) for m in moves], nbytes)


# ---- the pure pieces ----

def _balance(sizes: dict[Item, float], owner: dict[Item, int], loads: list[float], *,
             donors: Collection[int], recipients: Collection[int], tolerance: float,
             max_moves: int | None = None) -> list[Move]:
    """Moves from donors to recipients, each taking from the most loaded donor that has an item no
    larger than half its gap to the least loaded recipient, the largest such item (fewest moves).
    Half the gap first, not the whole: a pairwise-best move let a joiner overshoot (two servers of
    707 kB each, two 300 kB partitions among 64 kB slices: it took both partitions and ended at
    600 kB against their 407). Stops when no item fits (_best_move), when the most loaded donor is
    within `tolerance` of the mean over donors and recipients, or after max_moves."""
    moves: list[Move] = []
    counted = sorted(set(donors) | set(recipients))
    mean = sum(loads[s] for s in counted) / len(counted) if counted else 0.0
    held: dict[int, list[Item]] = {}
    for item, s in sorted(owner.items(), key=lambda kv: _order(kv[0])):
        held.setdefault(s, []).append(item)
    while max_moves is None or len(moves) < max_moves:
        if tolerance > 1.0 and max(loads[d] for d in donors) <= tolerance * mean:
            break
        move = _best_move(sizes, held, loads, donors, recipients, mean)
        if move is None:
            break
        item, source, target = move
        # An item moves once a plan: a second move of it is never better than one straight to its last
        # server, and an item too small to change a load in floating point (1e-300 beside 1000) moved to
        # and fro for ever.
        held[source].remove(item)
        loads[source] -= sizes[item]
        loads[target] += sizes[item]
        owner[item] = target
        moves.append(Move(item, source, target, int(sizes[item])))
    return moves


def _best_move(sizes: dict[Item, float], held: dict[int, list[Item]], loads: list[float],
               donors: Collection[int], recipients: Collection[int], mean: float
               ) -> tuple[Item, int, int] | None:
    """The next move: an item within half its pair's gap, else (rounding to the nearest) one that
    still lowers the pair's larger load and leaves the recipient less than half of it above the mean
    (twelve 1 kB partitions and a 1 kB slice on three servers: the joiner stopped at 2 kB without it)."""
    pairs = []
    for source in sorted(donors, key=lambda d: (-loads[d], d)):
        target = min((r for r in recipients if r != source), key=lambda r: (loads[r], r), default=None)
        if target is not None:
            pairs.append((source, target, loads[source] - loads[target]))
    for within_half in (True, False):
        for source, target, gap in pairs:
            fits = [i for i in held.get(source, ()) if 0 < sizes[i] < gap and (
                sizes[i] <= gap / 2 if within_half else loads[target] + sizes[i] / 2 <= mean)]
            if fits:
                return min(fits, key=lambda i: (-sizes[i], _order(i))), source, target
    return None


def _plan(before: Layout, base: Layout, moves: Sequence[Move], sizes: dict[Item, float]) -> MovePlan:
    """`base` with the moves applied, under the next layout version."""
    to = {m.item: m.target for m in moves}
    slices = tuple(dataclasses.replace(s, server=to[s.slice_key]) if s.slice_key in to else s
                   for s in base.slices)
    owners = tuple(to.get(p, o) for p, o in enumerate(base.owners()))
    identity = owners == tuple(range(len(base.servers)))
    after = dataclasses.replace(base, slices=slices, row_owners=() if identity else owners,
                                version=before.version + 1)
    return MovePlan(before, after, tuple(moves))


def _sizes(layout: Layout, partition_bytes: Sequence[float]) -> dict[Item, float]:
    _check_partitions(layout, partition_bytes, "partition_bytes")
    if any(x < 0 for x in partition_bytes):
        raise InvalidArgumentError(f"partition_bytes: got {list(partition_bytes)}, expected sizes >= 0")
    sizes: dict[Item, float] = {s.slice_key: float(slice_nbytes(layout, s)) for s in layout.slices}
    sizes.update({p: float(b) for p, b in enumerate(partition_bytes)})
    return sizes


def _owners(layout: Layout) -> dict[Item, int]:
    owner: dict[Item, int] = {s.slice_key: s.server for s in layout.slices}
    owner.update({p: o for p, o in enumerate(layout.owners())})
    return owner


def _items_on(layout: Layout, server: int) -> list[Item]:
    return [*(s.slice_key for s in layout.slices_on(server)), *layout.partitions_on(server)]


def _order(item: Item) -> tuple[int, str, int]:
    """A total order over items: row partitions by number, then slices by key and part."""
    return (0, "", item) if isinstance(item, int) else (1, item.key, item.part)


def _check_partitions(layout: Layout, values: Sequence[float], name: str) -> None:
    if len(values) != partition_count(layout):
        raise InvalidArgumentError(f"{name}: got {len(values)} values, the layout (version {layout.version}) "
                                   f"has {partition_count(layout)} row partitions")


def _check_servers(layout: Layout, servers: Collection[int], name: str) -> None:
    bad = sorted(s for s in servers if not 0 <= s < len(layout.servers))
    if bad:
        raise InvalidArgumentError(f"{name}: got servers {bad}, the layout (version {layout.version}) has "
                                   f"servers 0 to {len(layout.servers) - 1}")
