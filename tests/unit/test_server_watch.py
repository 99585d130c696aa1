"""ServerWatch: a parameter server the scheduler declared dead fails the job after a grace, naming
the server and what it held; one that comes back within the grace does not (issue 10)."""

from __future__ import annotations

from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.worker.server_watch import ServerWatch

SERVERS = ("127.0.0.1:7001", "127.0.0.1:7002")
LAYOUT = plan_layout([ParamSpec("fc1.weight", "float32", (64, 32)), ParamSpec("fc1.bias", "float32", (64,)),
                      ParamSpec("fc2.weight", "float32", (10, 64))], SERVERS)


def view(generation: int, ps1: NodeState) -> ClusterView:
    return ClusterView(generation, (
        Node("ps-0", "ps", 0, SERVERS[0], NodeState.LIVE, 1),
        Node("ps-1", "ps", 1, SERVERS[1], ps1, 1),
        Node("worker-0", "worker", 0, "127.0.0.1:7100", NodeState.LIVE, 1)))


def test_a_dead_server_is_lost_after_the_grace_and_the_message_names_it_and_its_slices() -> None:
    watch = ServerWatch(LAYOUT, grace_s=2.0)
    assert watch.observe(view(1, NodeState.LIVE), now=0.0) is None
    assert watch.observe(view(2, NodeState.DEAD), now=10.0) is None
    assert watch.observe(view(2, NodeState.DEAD), now=11.9) is None

    lost = watch.observe(view(2, NodeState.DEAD), now=12.0)

    assert lost is not None
    assert (lost.node_id, lost.address, lost.state) == ("ps-1", SERVERS[1], "dead")
    held = LAYOUT.slices_on(1)
    assert held  # the layout put something there
    for key in {s.key for s in held}:
        assert key in lost.message
    assert f"{len(held)} slice(s)" in lost.message
    assert "declared dead by the scheduler" in lost.message and "lost" in lost.message
    assert f"Restart it on {SERVERS[1]}" in lost.message


def test_a_server_back_within_the_grace_is_not_lost() -> None:
    watch = ServerWatch(LAYOUT, grace_s=2.0)
    assert watch.observe(view(2, NodeState.DEAD), now=0.0) is None
    assert watch.observe(view(3, NodeState.LIVE), now=1.5) is None
    # Gone again later: the grace starts over.
    assert watch.observe(view(4, NodeState.DEAD), now=5.0) is None
    assert watch.observe(view(4, NodeState.DEAD), now=6.9) is None
    assert watch.observe(view(4, NodeState.DEAD), now=7.0) is not None


def test_a_server_that_left_is_lost_too_and_says_so() -> None:
    lost = ServerWatch(LAYOUT, grace_s=0.0).observe(view(2, NodeState.LEFT), now=0.0)
    assert lost is not None and "left the cluster" in lost.message


def test_once_training_is_over_servers_may_leave_but_not_die() -> None:
    # --exit-when-done servers leave when the job is done: not a loss for a worker that has left too.
    watch = ServerWatch(LAYOUT, grace_s=0.0)
    assert watch.observe(view(2, NodeState.LEFT), now=0.0, leaving_ok=True) is None
    assert watch.observe(view(3, NodeState.DEAD), now=1.0, leaving_ok=True) is not None
