"""What a primary tells the scheduler about its backups (docs/architecture.md, 9 Failures).

With every heartbeat a server reports which of its backups hold an acknowledged copy of every slice
the newest layout it knows makes it primary of, each with the generation of the backup's
incarnation, and that layout's version. The scheduler promotes only such a copy
(scheduler/in_sync.py).

A backup whose generation changes in a view is a new process at the same address: whatever its old
incarnation acknowledged is gone, so every slice is copied to it again before it counts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.view import ClusterView, ServerIncarnations
from pshard.ps_server.replication.dense import Replicator
from pshard.ps_server.replication.link import owned_slices

Report = Callable[[dict[str, int], int], None]  # (backup address -> its generation, layout version)


class InSyncReporter:
    """Lives on the server's event loop: views, layouts and reports all arrive there."""

    def __init__(self, replicator: Replicator, own_address: str, report: Report) -> None:
        self._replicator = replicator
        self._own = own_address
        self._report = report
        self._incarnations = ServerIncarnations(own_address)
        self._layout: Layout | None = None
        # The backups holding every table row too (ps_server/replication/tables.py); None: no tables.
        self.tables_in_sync: Callable[[], set[str]] | None = None
        # The targets of moves holding the row partitions they take (address -> generation), reported
        # beside the backups: the scheduler switches those partitions to them (issue 20).
        self.copies_in_sync: Callable[[], dict[str, int]] | None = None

    def on_view(self, view: ClusterView) -> None:
        """Note each server's incarnation; a backup with a new one is copied to from scratch."""
        for address in self._incarnations.restarted(view):
            self._replicator.restarted(address)
        self.report()

    def on_layout(self, layout: Layout) -> None:
        if self._layout is None or layout.version > self._layout.version:
            self._layout = layout
            self.report()

    def report(self) -> None:
        """Hand the current answer to the scheduler client (sent with its next heartbeat)."""
        layout = self._layout
        owned = owned_slices(layout, self._own) if layout is not None else None
        if layout is None or owned is None:
            self._report({}, 0)
            return
        generations = self._incarnations.generations
        copies = {a: generations[a] for a in self._replicator.in_sync(owned) if a in generations}
        if self.tables_in_sync is not None:
            rows = self.tables_in_sync()
            copies = {a: g for a, g in copies.items() if a in rows}
        if self.copies_in_sync is not None:
            copies.update(self.copies_in_sync())
        self._report(copies, layout.version)


def copies_caught_up(row_copies: Collection[str], rows_caught_up: Mapping[str, int],
                     slice_copies: Collection[str], slices_caught_up: Collection[str],
                     generations: Mapping[str, int]) -> dict[str, int]:
    """The targets of this server's copies (a drain without replicas, a rebalance) holding everything it
    copies to them, row partitions and dense slices alike, each with the generation of the incarnation the
    copy went to: a target with both kinds counts only once both caught up, since a drain switches all
    of them at once (scheduler/drain_copies.py). `rows_caught_up` carries its own generations (the
    table replication's); a dense copy's is the view's, whose change restarts the copy (`restarted`)."""
    out: dict[str, int] = {}
    for target in sorted({*row_copies, *slice_copies}):
        if target in row_copies and target not in rows_caught_up:
            continue
        if target in slice_copies and target not in slices_caught_up:
            continue
        generation = rows_caught_up.get(target, generations.get(target))
        if generation is not None:
            out[target] = generation
    return out
