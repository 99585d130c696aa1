"""The quorum a server installs from cluster views: deaths and departures at once, a scheduler's
amnesia (a restart forgets everyone) bridged for a grace period."""

from __future__ import annotations

from pshard.common.cluster.view import ClusterView, ManualClock, Node, NodeState
from pshard.ps_server.core.quorum import QuorumFollower

GRACE_S = 5.0


def view(generation: int, **workers: NodeState) -> ClusterView:
    nodes = tuple(Node(name, "worker", rank, f"127.0.0.1:{7200 + rank}", state, generation)
                  for rank, (name, state) in enumerate(workers.items()))
    return ClusterView(generation, (Node("ps-0", "ps", 0, "127.0.0.1:7100", NodeState.LIVE, 1), *nodes))


def follower(clock: ManualClock) -> QuorumFollower:
    return QuorumFollower(GRACE_S, clock.now)


def test_live_workers_form_the_quorum_with_their_generations() -> None:
    quorum = follower(ManualClock()).apply(view(3, w0=NodeState.LIVE, w1=NodeState.LIVE))

    assert quorum == {"w0": 3, "w1": 3}


def test_a_dead_or_departed_worker_leaves_the_quorum_at_once() -> None:
    f = follower(ManualClock())
    f.apply(view(3, w0=NodeState.LIVE, w1=NodeState.LIVE, w2=NodeState.LIVE))

    quorum = f.apply(view(4, w0=NodeState.LIVE, w1=NodeState.DEAD, w2=NodeState.LEFT))

    assert quorum == {"w0": 4}
    assert f.next_deadline() is None


def test_a_worker_a_restarted_scheduler_forgot_is_kept_until_it_re_registers() -> None:
    clock = ManualClock()
    f = follower(clock)
    f.apply(view(3, w0=NodeState.LIVE, w1=NodeState.LIVE))

    after_restart = f.apply(view(9, w0=NodeState.LIVE))  # w1 has not re-registered yet
    clock.advance(1.0)
    back = f.apply(view(10, w0=NodeState.LIVE, w1=NodeState.LIVE))

    assert after_restart == {"w0": 9, "w1": 3}
    assert back == {"w0": 10, "w1": 10}
    assert f.next_deadline() is None


def test_a_forgotten_worker_that_never_comes_back_is_dropped_when_its_grace_ends() -> None:
    clock = ManualClock()
    f = follower(clock)
    f.apply(view(3, w0=NodeState.LIVE, w1=NodeState.LIVE))
    f.apply(view(9, w0=NodeState.LIVE))
    assert f.next_deadline() == GRACE_S

    clock.advance(GRACE_S - 0.1)
    assert f.apply() == {"w0": 9, "w1": 3}
    clock.advance(0.2)
    assert f.apply() == {"w0": 9}
    assert f.next_deadline() is None


def test_no_view_yet_means_no_quorum() -> None:
    assert follower(ManualClock()).apply() == {}
