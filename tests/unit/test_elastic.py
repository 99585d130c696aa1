"""The elastic shard plan (worker.elastic): fixed clocks per epoch, union batches split by live trainers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.errors import ClusterConfigError
from pshard.worker.data import batches, shard
from pshard.worker.elastic import ClockPlan, Roster, roster_position


@pytest.mark.parametrize(("n", "world", "batch"), [(1437, 2, 64), (1000, 3, 32), (129, 2, 64), (50, 1, 7)])
def test_with_the_original_world_each_piece_is_the_batch_the_static_shard_had(n: int, world: int,
                                                                              batch: int) -> None:
    plan = ClockPlan(n, batch, world, epochs=2, seed=5)
    for epoch in range(2):
        clocks = plan.epoch_clocks(epoch)
        for rank in range(world):
            static = list(batches(shard(n, rank, world, epoch, 5), batch))
            for step, clock in enumerate(clocks):
                piece = plan.piece(clock, rank, world)
                if step < len(static):
                    np.testing.assert_array_equal(piece, static[step])
                else:  # a short last union batch: this rank's shard had no batch left
                    assert len(piece) == 1 and piece[0] in plan.union_batch(clock)


@pytest.mark.parametrize("members", [1, 2, 3, 5])
def test_any_number_of_members_partitions_every_union_batch(members: int) -> None:
    plan = ClockPlan(1000, 32, 2, epochs=1, seed=0)
    for clock in plan.epoch_clocks(0):
        pieces = [plan.piece(clock, i, members) for i in range(members)]
        union = plan.union_batch(clock)
        if len(union) >= members:
            np.testing.assert_array_equal(np.sort(np.concatenate(pieces)), np.sort(union))
    every = np.concatenate([plan.union_batch(c) for c in plan.epoch_clocks(0)])
    assert sorted(every.tolist()) == list(range(1000))  # an epoch is one pass, whoever trains it


def test_clocks_per_epoch_and_total_do_not_depend_on_members() -> None:
    plan = ClockPlan(1437, 64, 2, epochs=3, seed=0)
    assert plan.clocks_per_epoch == 12 and plan.total_clocks == 36
    assert list(plan.epoch_clocks(1)) == list(range(12, 24))
    capped = ClockPlan(1437, 64, 2, epochs=3, seed=0, max_steps=20)
    assert capped.total_clocks == 20
    assert list(capped.epoch_clocks(1)) == list(range(12, 20)) and len(capped.epoch_clocks(2)) == 0
    with pytest.raises(ValueError, match="clock"):
        capped.union_batch(20)
    with pytest.raises(ValueError, match="position"):
        plan.piece(0, 3, 3)


def _node(node_id: str, rank: int, state: NodeState = NodeState.LIVE, role: str = "worker") -> Node:
    return Node(node_id, role, rank, "", state, generation=1)


def test_roster_position_orders_live_trainers_by_rank_and_counts_itself() -> None:
    view = ClusterView(7, (_node("ps-0", 0, role="ps"), _node("chief-0", 0, role="chief"),
                           _node("worker-0", 1, NodeState.LEFT), _node("worker-1", 2), _node("worker-2", 3)))
    assert roster_position(view, "chief-0", 0, 3) == (0, 3)
    assert roster_position(view, "worker-2", 3, 3) == (2, 3)
    # Not live in this view yet (registered a moment ago): it counts itself, in its rank's place.
    assert roster_position(view, "worker-0", 1, 3) == (1, 4)
    assert roster_position(None, "worker-1", 2, 3) == (2, 3)


def test_a_joining_worker_may_have_an_index_beyond_the_worker_list() -> None:
    with pytest.raises(ClusterConfigError, match=r"task\.index"):
        ClusterSpec("worker", 2, chief=("c:1",), ps=("p:1",), worker=("w:1", "w:2"))
    spec = ClusterSpec("worker", 2, chief=("c:1",), ps=("p:1",), worker=("w:1", "w:2"), joining=True)
    assert (spec.node_id, spec.data_rank, spec.world_size, spec.own_address) == ("worker-2", 3, 3, None)
    assert not spec.hosts_scheduler
    with pytest.raises(ClusterConfigError, match="only a worker"):
        ClusterSpec("chief", 1, chief=("c:1",), ps=("p:1",), joining=True)


def test_pshard_worker_join_takes_the_jobs_tf_config_with_an_index_beyond_it(tmp_path: Path) -> None:
    from pshard.worker.__main__ import config_from_args

    tf_config = ('{"cluster": {"ps": ["127.0.0.1:7100"], "worker": ["127.0.0.1:7200", "127.0.0.1:7201"]}, '
                 '"task": {"type": "worker", "index": 2}}')
    env = {"TF_CONFIG": tf_config}
    data = ["--data-dir", str(tmp_path), "--insecure"]
    with pytest.raises(ClusterConfigError, match=r"task\.index: got 2"):
        config_from_args(data, env)
    cfg = config_from_args([*data, "--join"], env)
    spec = cfg.spec
    assert (spec.node_id, spec.joining, spec.world_size, cfg.is_chief) == ("worker-2", True, 2, False)
    with pytest.raises(SystemExit):  # the CTR model's click-log shards are static
        config_from_args([*data, "--join", "--model", "ctr"], env)


# ---- the view that splits a clock: issue 23, item 11 ----

def _positions(views: list[ClusterView]) -> list[tuple[int, int]]:
    """(position, members) of worker-0 and worker-1 when each splits by its own view."""
    return [roster_position(view, f"worker-{rank}", rank, 2) for rank, view in enumerate(views)]


def test_workers_re_registering_after_a_scheduler_restart_split_alike() -> None:
    """worker-0 has re-registered with the restarted scheduler and worker-1 not yet: their latest views
    differ (worker-1 is missing from worker-0's), but the split does not."""
    before = ClusterView(7, (_node("worker-0", 0), _node("worker-1", 1)))
    restarted = ClusterView(9, (_node("worker-0", 0),))  # the new scheduler knows only worker-0 so far
    rosters = [Roster(), Roster()]
    for roster in rosters:
        roster.offer(before, now=0.0)
    rosters[0].offer(restarted, now=1.0)

    assert _positions([restarted, before]) == [(0, 1), (1, 2)]  # the latest views: worker-0 takes it all
    split = [roster.view(now=1.1, grace_s=10.0) for roster in rosters]
    assert _positions(split) == [(0, 2), (1, 2)]


def test_a_node_missing_past_the_grace_is_dropped_and_a_dead_one_at_once() -> None:
    roster = Roster()
    roster.offer(ClusterView(1, (_node("worker-0", 0), _node("worker-1", 1), _node("worker-2", 2))), now=0.0)
    roster.offer(ClusterView(3, (_node("worker-0", 0), _node("worker-2", 2, NodeState.DEAD))), now=1.0)

    assert roster_position(roster.view(now=5.0, grace_s=10.0), "worker-0", 0, 3) == (0, 2)
    assert roster_position(roster.view(now=11.5, grace_s=10.0), "worker-0", 0, 3) == (0, 1)
    roster.offer(ClusterView(2, ()), now=12.0)  # an older view changes nothing
    assert roster.view(now=12.0, grace_s=10.0) == ClusterView(3, (_node("worker-0", 0),
                                                                  _node("worker-2", 2, NodeState.DEAD)))
    assert Roster().view(now=0.0, grace_s=1.0) is None
