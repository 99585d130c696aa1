"""A parameter server that leaves on purpose (a drain, issue 20): what it serves goes to its in-sync
backup under a new layout version first, exactly as a failover would move it; a leave that would lose
slices or rows is refused and changes nothing."""

from __future__ import annotations

import pytest
from pshard.common.cluster.moves import NowhereToMoveError
from pshard.common.cluster.replicas import NoInSyncCopyError, fail_over
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.errors import InvalidArgumentError
from pshard.scheduler.membership import Membership

from pshard.drain_cli import pick
from tests.unit.test_replicas import SERVERS, _all_in_sync, _job, _report


def test_a_leaving_server_hands_its_slices_and_partitions_to_its_in_sync_backup():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    assert before is not None and before.slices_on(1)
    view = members.leave("ps-1", members.node("ps-1").generation)
    after = members.layout()
    expected, _ = fail_over(before, 1, {0, 2}, {2})
    assert after is not None and after.version == before.version + 1
    assert after.slices == expected.slices and after.owners() == expected.owners() == (0, 2, 2)
    assert members.node("ps-1").state is NodeState.LEFT and view.layout_version == after.version
    assert members.in_sync.changes["drained"] == 1 and members.failovers == 0
    assert members.in_sync.of(before.servers[2]) == frozenset()  # the heir's backups copy its new slices
    # Leaving again changes nothing.
    members.leave("ps-1", members.node("ps-1").generation)
    assert members.layout() == after and members.in_sync.changes["drained"] == 1


def test_a_leave_before_the_backup_holds_a_copy_is_refused_and_changes_nothing():
    members, _ = _job(replicas=1)
    _report(members, "ps-0", "ps-1")  # ps-1's own backup (ps-2) has not been reported in sync
    before, view = members.layout(), members.view()
    with pytest.raises(NoInSyncCopyError, match=r"fail over server 1: no live server holds an in-sync copy"):
        members.leave("ps-1", members.node("ps-1").generation)
    assert members.layout() == before and members.view() == view
    assert members.node("ps-1").state is NodeState.LIVE
    _report(members, "ps-1", "ps-2")
    members.leave("ps-1", members.node("ps-1").generation)  # in sync now: the retry goes through
    assert members.node("ps-1").state is NodeState.LEFT


def test_a_server_of_a_job_without_replicas_leaves_once_copies_of_all_it_serves_switched_at_once():
    members, _ = _job(replicas=0)
    before = members.layout()
    assert before is not None and before.slices_on(1)
    with pytest.raises(NoInSyncCopyError, match=r"leave of server 1 \(b:1\): the job has no replicas, so "
                                                r"its \d+ slices and row partitions are being copied to "
                                                r"a:1, c:1"):
        members.leave("ps-1", members.node("ps-1").generation)
    assert members.layout() == before and members.node("ps-1").state is NodeState.LIVE
    view = members.view()  # the views name the copies: the slices and the partition, to their targets
    assert {c.source for c in view.slice_copies} == {"b:1"} and view.copies
    moved = frozenset().union(*(c.slices for c in view.slice_copies))
    assert moved == {s.slice_key for s in before.slices_on(1)}
    assert not any(c.switched_at for c in view.slice_copies)
    _report(members, "ps-1", "ps-0")  # one target caught up: no switch yet, the leave still waits
    assert members.layout() == before
    with pytest.raises(NoInSyncCopyError, match="being copied to c:1 first"):
        members.leave("ps-1", members.node("ps-1").generation)
    _report(members, "ps-1", "ps-0", "ps-2")  # every target: ONE new layout version switches it all
    after = members.layout()
    assert after is not None and after.version == before.version + 1
    assert not after.slices_on(1) and not after.partitions_on(1) and after.servers == before.servers
    assert {s.slice_key for s in after.slices if s.server != 1} == {s.slice_key for s in before.slices}
    assert all(c.switched_at == after.version for c in members.view().slice_copies)
    members.leave("ps-1", members.node("ps-1").generation)  # it serves nothing now
    assert members.node("ps-1").state is NodeState.LEFT and members.layout() == after
    assert [d.layout_version for d in members.drains.all()] == [after.version]


def test_a_drain_without_replicas_whose_target_goes_before_the_switch_rolls_back_whole():
    members, _ = _job(replicas=0)
    before = members.layout()
    with pytest.raises(NoInSyncCopyError):
        members.leave("ps-1", members.node("ps-1").generation)
    _report(members, "ps-1", "ps-0")  # a's copy caught up, c's not yet
    members.register("ps", "c:1", node_id="ps-2")  # c restarted: its new process holds nothing of its copy
    assert members.layout() == before and members.view().slice_copies == ()  # rolled back: no copy named
    _report(members, "ps-1", "ps-0", "ps-2")  # a report of the old copies switches nothing
    assert members.layout() == before
    with pytest.raises(NoInSyncCopyError):  # the retried leave plans the drain again, from scratch
        members.leave("ps-1", members.node("ps-1").generation)
    assert {c.target for c in members.view().slice_copies} == {"a:1", "c:1"}
    _report(members, "ps-1", "ps-0", "ps-2")
    after = members.layout()
    assert after is not None and after.version == before.version + 1 and not after.slices_on(1)


def test_the_last_live_server_is_refused_at_once_not_as_a_copy_to_wait_for():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    members.leave("ps-1", members.node("ps-1").generation)
    _report(members, "ps-2", "ps-0")  # the heir's backup holds its new slices
    members.leave("ps-2", members.node("ps-2").generation)
    before = members.layout()
    with pytest.raises(NowhereToMoveError, match=r"leave of server 0 \(a:1\): it is the last live server"):
        members.leave("ps-0", members.node("ps-0").generation)
    assert members.layout() == before and members.node("ps-0").state is NodeState.LIVE


def test_a_server_that_serves_nothing_leaves_as_any_node():
    members, _ = _job(replicas=1)
    extra = members.register("ps", "d:1")  # beyond the layout: it serves nothing
    before = members.layout()
    members.leave(extra.node_id, extra.generation)
    assert members.layout() == before and members.node(extra.node_id).state is NodeState.LEFT


def test_pshard_drain_names_the_server_by_node_id_or_address_and_refuses_others():
    view = ClusterView(7, (Node("ps-0", "ps", 0, "a:1", NodeState.LIVE, 1),
                           Node("ps-1", "ps", 1, "b:1", NodeState.LEFT, 2),
                           Node("worker-0", "worker", 0, "w:1", NodeState.LIVE, 3)))
    assert pick(view, "ps-0") == pick(view, "a:1") == view.nodes[0]
    with pytest.raises(InvalidArgumentError, match=r"server: got 'worker-0', the job's servers are "
                                                   r"\['ps-0 \(a:1\)', 'ps-1 \(b:1\)'\]"):
        pick(view, "worker-0")
    with pytest.raises(InvalidArgumentError, match=r"server ps-1 \(b:1\): it is left, not live"):
        pick(view, "b:1")


def test_after_a_scheduler_restart_a_server_cannot_leave_before_the_layout_is_given_back():
    """A SIGKILL of the scheduler mid-drain: the restarted one knows no layout until the chief (or
    worker-0) gives it back, and a server that registers again and leaves before that would take
    what it serves with it. Its leave is refused, changing nothing, as while its backup copies."""
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    layout = members.layout()
    assert layout is not None and layout.slices_on(1)
    restarted = Membership(heartbeat_timeout_s=5)
    restarted.register("ps", SERVERS[1], node_id="ps-1", rank_hint=1, last_generation=members.generation)
    view = restarted.view()
    with pytest.raises(NoInSyncCopyError, match=r"leave of server b:1: this scheduler restarted and has not "
                                                r"been given the job's layout back yet"):
        restarted.leave("ps-1", restarted.node("ps-1").generation)
    assert restarted.node("ps-1").state is NodeState.LIVE and restarted.view() == view
    restarted.heartbeat("ps-1", restarted.node("ps-1").generation, in_sync_layout=layout.version)
    restarted.restore_layout(layout)
    view = restarted.view()
    # The others are on their way back: not the last live server, a leave to retry.
    with pytest.raises(NoInSyncCopyError, match=r"leave of server 1 \(b:1\): this scheduler restarted and "
                                                r"servers a:1, c:1 of the layout have not registered again"):
        restarted.leave("ps-1", restarted.node("ps-1").generation)
    assert restarted.node("ps-1").state is NodeState.LIVE and restarted.view() == view
    for i in (0, 2):
        restarted.register("ps", SERVERS[i], node_id=f"ps-{i}", rank_hint=i,
                           last_generation=members.generation)
    _all_in_sync(restarted)
    restarted.leave("ps-1", restarted.node("ps-1").generation)  # handed over, as before the restart
    after = restarted.layout()
    assert after is not None and after.version == layout.version + 1 and not after.slices_on(1)
    assert restarted.node("ps-1").state is NodeState.LEFT


def test_a_server_of_a_job_that_never_had_a_layout_leaves_at_once():
    members = Membership(heartbeat_timeout_s=5)
    node = members.register("ps", SERVERS[0])
    members.leave(node.node_id, node.generation)
    assert members.node(node.node_id).state is NodeState.LEFT


def test_the_scheduler_keeps_each_drain_from_its_first_ask_to_its_hand_over():
    """What `pshard status` shows: a drain in progress while its backup copies, then done (what, from
    where, to where, how long)."""
    members, clock = _job(replicas=1)
    _report(members, "ps-0", "ps-1")
    before = members.layout()
    assert before is not None
    with pytest.raises(NoInSyncCopyError):
        members.leave("ps-1", members.node("ps-1").generation)
    (waiting,) = members.drains.all()
    assert (waiting.node_id, waiting.address, waiting.done, waiting.heir) == ("ps-1", "b:1", False, "")
    clock.advance(2.5)
    assert waiting.seconds(clock.now()) == 2.5
    with pytest.raises(NoInSyncCopyError):  # asking again keeps the first ask's start
        members.leave("ps-1", members.node("ps-1").generation)
    clock.advance(0.5)
    _report(members, "ps-1", "ps-2")
    members.leave("ps-1", members.node("ps-1").generation)
    (done,) = members.drains.all()
    after = members.layout()
    assert after is not None
    assert (done.done, done.heir, done.slices, done.partitions, done.layout_version) == (
        True, "c:1", len(before.slices_on(1)), before.partitions_on(1), after.version)
    clock.advance(7)
    assert done.seconds(clock.now()) == 3.0


def test_a_leave_refused_for_good_is_no_drain_in_progress():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    members.leave("ps-1", members.node("ps-1").generation)
    _report(members, "ps-2", "ps-0")
    members.leave("ps-2", members.node("ps-2").generation)
    with pytest.raises(InvalidArgumentError):  # the last live server
        members.leave("ps-0", members.node("ps-0").generation)
    assert [d.node_id for d in members.drains.all()] == ["ps-1", "ps-2"]
