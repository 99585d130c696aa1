"""A serving worker's watch on its coordinator (worker/serve.py): it ends once the chief has left or died,
also for a worker whose first view already shows that."""

from __future__ import annotations

from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.worker.serve import CoordinatorWatch


def view(generation: int, *chief: NodeState) -> ClusterView:
    nodes = [Node("worker-0", "worker", 1, "127.0.0.1:1", NodeState.LIVE, 1)]
    nodes += [Node(f"chief-{i}", "chief", 0, "127.0.0.1:2", state, 1) for i, state in enumerate(chief)]
    return ClusterView(generation, tuple(nodes))


def test_the_watch_waits_for_a_coordinator_that_has_not_registered_yet_and_one_that_is_live() -> None:
    watch = CoordinatorWatch()
    watch.offer(view(1))
    watch.offer(view(2, NodeState.LIVE))
    assert not watch.gone.is_set()


def test_the_watch_ends_when_the_coordinator_leaves_or_is_declared_dead() -> None:
    for state in (NodeState.LEFT, NodeState.DEAD):
        watch = CoordinatorWatch()
        watch.offer(view(1, NodeState.LIVE))
        watch.offer(view(2, state))
        assert watch.gone.is_set() and watch.how == state.value


def test_a_worker_that_starts_after_its_coordinator_left_ends_at_its_first_view() -> None:
    watch = CoordinatorWatch()
    watch.offer(view(5, NodeState.LEFT))
    assert watch.gone.is_set()
