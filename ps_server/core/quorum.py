"""The sync quorum a parameter server installs from the scheduler's cluster views. Pure: clock injected.

A running scheduler never just drops a worker: it marks it DEAD (silent too long) or LEFT
(finished), and the quorum follows at once. A worker that is simply absent from a view was
forgotten by a restarted scheduler (its state is soft) and will re-register within a few
heartbeats. Until then, or until `grace_s` has passed, it stays in the quorum: otherwise the
steps in that window would average fewer workers' gradients than training on the union batch
does. A worker killed while the scheduler was down is dropped when its grace ends, so nobody
waits for it for long.
"""

from __future__ import annotations

from collections.abc import Callable

from pshard.common.cluster.view import TRAINER_ROLES, ClusterView, NodeState


class QuorumFollower:
    def __init__(self, grace_s: float, now: Callable[[], float]) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s: got {grace_s}, expected >= 0")
        self.grace_s = grace_s
        self._now = now
        self._quorum: dict[str, int] = {}
        self._vanished_at: dict[str, float] = {}  # worker -> when it went missing from the views
        self._last: ClusterView | None = None

    def apply(self, view: ClusterView | None = None) -> dict[str, int]:
        """The quorum to install for `view` (or, with no argument, re-evaluated for the last one)."""
        view = view if view is not None else self._last
        if view is None:
            return {}
        self._last = view
        live = view.live_workers()
        accounted = set(live) | {n.node_id for n in view.nodes
                                 if n.role in TRAINER_ROLES and n.state is not NodeState.LIVE}
        now = self._now()
        quorum = dict(live)
        for worker, generation in self._quorum.items():
            if worker in accounted:
                self._vanished_at.pop(worker, None)
                continue
            since = self._vanished_at.setdefault(worker, now)
            if now - since < self.grace_s:
                quorum[worker] = generation
            else:
                self._vanished_at.pop(worker, None)
        for worker in list(self._vanished_at):
            if worker not in quorum:
                self._vanished_at.pop(worker)
        self._quorum = quorum
        return dict(quorum)

    def next_deadline(self) -> float | None:
        """When the quorum must be re-evaluated (a kept worker's grace ends), on the injected clock."""
        if not self._vanished_at:
            return None
        return min(self._vanished_at.values()) + self.grace_s
