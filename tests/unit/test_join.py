"""A parameter server that registers for a running job joins it (issue 20, item 1): it becomes the backup of
the server before it in ring order, and once that server reports it in sync the scheduler moves the slices
plan_join takes from that server onto it under one new layout version. Before that nothing moves; a joiner
that dies first leaves the layout as it was (a roll back)."""

from __future__ import annotations

from pshard.common.cluster.moves import partition_count, plan_join
from pshard.common.cluster.view import NodeState

from tests.unit.test_replicas import _all_in_sync, _job, _report

JOINER = "d:1"


def test_a_server_registering_for_a_running_job_takes_slices_of_the_server_it_caught_up_with():
    members, clock = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    assert before is not None
    joiner = members.register("ps", JOINER)
    assert joiner.rank == 3
    (join,) = members.joins.all()
    assert (join.node_id, join.address, join.done) == (joiner.node_id, JOINER, False)
    _report(members, "ps-0", "ps-1")  # not the joiner's donor: nothing moves
    assert members.layout() == before
    clock.advance(1.5)
    _report(members, "ps-2", joiner.node_id)  # its ring predecessor holds it in sync
    after = members.layout()
    expected = plan_join(before, JOINER, [0] * partition_count(before), live={2})
    assert after is not None and after.version == before.version + 1
    assert after.servers == (*before.servers, JOINER)
    assert after.slices == expected.after.slices and after.slices_on(3)
    moved = {a.slice_key for a, b in zip(before.slices, after.slices, strict=True) if a.server != b.server}
    assert moved == {s.slice_key for s in after.slices_on(3)}
    assert all(s.server == 2 for s in before.slices if s.slice_key in moved)  # only from the donor
    assert members.in_sync.changes["joined"] == 1
    (done,) = members.joins.all()
    assert (done.done, done.donor, done.slices, done.layout_version) == (
        True, "c:1", len(moved), after.version)
    assert done.nbytes == expected.nbytes > 0 and done.seconds(clock.now()) == 1.5
    assert members.moves.finished["join"] == 1 and members.moves.seconds_sum == 1.5  # the moves metric
    _report(members, "ps-2", joiner.node_id)  # reported again: no second move
    assert members.layout() == after


def test_a_joiner_gone_before_it_caught_up_leaves_the_layout_as_it_was():
    members, clock = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    joiner = members.register("ps", JOINER)
    clock.advance(4)
    for node in ("ps-0", "ps-1", "ps-2"):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == [joiner.node_id]
    assert members.node(joiner.node_id).state is NodeState.DEAD
    assert members.joins.all() == () and members.layout() == before
    _report(members, "ps-2", "ps-0")
    assert members.layout() == before


def test_a_server_registering_for_a_job_without_replicas_serves_nothing():
    members, _ = _job(replicas=0)
    before = members.layout()
    members.register("ps", JOINER)
    assert members.joins.all() == () and members.layout() == before
