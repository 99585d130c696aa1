"""Replica placement and promotion (docs/architecture.md, 9 Failures): pure, shared by the scheduler,
the servers and the tests.

Placement is per server, in ring order: the slices whose primary is server i are backed up on the
next `replicas` live servers after i in the layout's server list. A server needs nothing but the
ring and who is live to know whom it forwards to, and every server computes the same answer.

Promotion: when a primary dies, each of its slices, and its sparse-table row partitions (the ids whose
row hash maps to it, or that an earlier failover gave it), move to its first in-sync backup in ring order:
a live server its primary reported as holding a copy of every slice and row (the scheduler tracks which,
scheduler/membership.py). A backup that is still copying (it just joined, or restarted) holds only
part, and is never promoted. Nothing else moves, so the layout stays what it was except for the
failed-over slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from pshard.common.cluster.layout import Layout, LayoutSlice
from pshard.common.errors import InvalidArgumentError


class NoInSyncCopyError(InvalidArgumentError):
    """A dead primary's slices have no live in-sync copy: promotion cannot save them."""


def backups_of(primary: int, servers: int, replicas: int, live: Collection[int]) -> tuple[int, ...]:
    """The backups of server `primary`: the next `replicas` live servers after it, in ring order."""
    if not 0 <= primary < servers:
        raise InvalidArgumentError(f"primary: got {primary}, expected 0 to {servers - 1}")
    ring = [(primary + step) % servers for step in range(1, servers)]
    return tuple(s for s in ring if s in live)[:replicas]


def joining_backups(primary: int, servers: int, replicas: int, live: Collection[int],
                    placed: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`primary`'s backups while servers ranked beyond the layout's `placed` ones join (issue 20): its
    backups among the layout's servers, whose copies count (acknowledgements wait for them, a failover
    promotes them), and the joiners it also copies to, which count for neither until they caught up.

    A joiner is, by the ring over every server, the backup of the server before it (its donor), but that
    server's old backup keeps its copy until the join's switch: were it released when the joiner
    registers, a donor dying mid-copy would leave its slices with no in-sync copy. `placed` None (no
    layout yet), or no server beyond it: the ring over every server, no joiner."""
    everyone = backups_of(primary, servers, replicas, live)
    if placed is None or not 0 < placed < servers or primary >= placed:
        return everyone, ()
    # The ring over the layout's servers keeps their order: its backups are `everyone`'s below `placed`
    # and those the joiners displaced.
    kept = backups_of(primary, placed, replicas, [r for r in live if r < placed])
    return kept, tuple(r for r in everyone if r >= placed)


def backed_up_by(backup: int, servers: int, replicas: int, live: Collection[int]) -> tuple[int, ...]:
    """The primaries `backup` holds copies for (the inverse of backups_of over the live servers)."""
    return tuple(p for p in range(servers) if p != backup and p in live
                 and backup in backups_of(p, servers, replicas, live))


def fail_over(layout: Layout, dead: int, live: Collection[int],
              in_sync: Collection[int] | None = None) -> tuple[Layout, tuple[LayoutSlice, ...]]:
    """The layout with every slice and table-row partition of `dead` on its first in-sync backup,
    and the slices that moved (`moved_partitions` tells which partitions did).

    `live`: the servers alive now (`dead` excluded); `in_sync`: those holding a copy of every slice
    and table row of `dead` (None: every live one, for callers that know no better). The caller
    bumps the version. A layout without replicas, or a dead server serving nothing (no slices, no
    partitions: a failover already moved them), comes back unchanged with nothing moved.
    NoInSyncCopyError when no live server holds a copy: the slices and rows are lost.
    """
    n = len(layout.servers)
    moved = tuple(s for s in layout.slices if s.server == dead)
    partitions = layout.partitions_on(dead) if 0 <= dead < n else ()
    if layout.replicas == 0 or not (moved or partitions):
        return layout, ()
    alive = set(live) - {dead}
    if in_sync is not None:
        alive &= set(in_sync)
    [heir] = backups_of(dead, n, 1, alive) or (None,)
    if heir is None:
        raise NoInSyncCopyError(
            f"fail over server {dead}: no live server holds an in-sync copy of its {len(moved)} slices ("
            + ", ".join(str(s.slice_key) for s in moved[:8]) + (", ..." if len(moved) > 8 else "")
            + f") and table rows (partitions {list(partitions)})")
    slices = tuple(dataclasses.replace(s, server=heir) if s.server == dead else s for s in layout.slices)
    owners = tuple(heir if o == dead else o for o in layout.owners())
    return dataclasses.replace(layout, slices=slices, row_owners=owners), moved


def moved_partitions(before: Layout, after: Layout) -> dict[int, int]:
    """Row partitions whose server differs between two layouts of the same servers: partition -> its new
    server."""
    return {p: b for p, (a, b) in enumerate(zip(before.owners(), after.owners(), strict=True)) if a != b}


def heir_of(before: Layout, after: Layout, dead: int) -> int | None:
    """Where `after` put what server `dead` served in `before` (None: it served nothing)."""
    for s in before.slices_on(dead):
        return after.slices_of(s.key)[s.part].server
    for p in before.partitions_on(dead):
        return after.row_owner(p)
    return None


def index_of(layout: Layout, address: str) -> int | None:
    """The position of a server address in the layout's ring, None if it is not there."""
    try:
        return layout.servers.index(address)
    except ValueError:
        return None
