"""A parameter server that registers for a running job joins it (issue 20, item 1): it becomes the backup of
the server before it in ring order, and once that server reports it in sync the scheduler moves the slices
plan_join takes from that server onto it under one new layout version. Before that nothing moves; a joiner
that dies first leaves the layout as it was (a roll back)."""

from __future__ import annotations

import dataclasses

import pytest
from pshard.common.cluster.layout import Layout
from pshard.common.cluster.loads import Counters
from pshard.common.cluster.moves import partition_count, plan_join
from pshard.common.cluster.replicas import joining_backups
from pshard.common.cluster.view import ManualClock, NodeState, Registration
from pshard.common.errors import LayoutConflictError
from pshard.scheduler.joins import JoinLog
from pshard.scheduler.membership import Membership

from tests.unit.test_replicas import _all_in_sync, _job, _report

JOINER = "d:1"


def _joining() -> tuple[Membership, ManualClock, Layout | None, Registration]:
    """A replicated job of three servers, each one's backup in sync, and JOINER registered for it: (the
    scheduler's membership, its clock, the layout before the join, the joiner's registration)."""
    members, clock = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    return members, clock, before, members.register("ps", JOINER)


def test_a_server_registering_for_a_running_job_takes_slices_of_the_server_it_caught_up_with():
    members, clock, before, joiner = _joining()
    assert before is not None
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
    (switched,) = members.joins.all()
    assert (switched.took, switched.done, switched.donor, switched.slices, switched.layout_version) == (
        True, False, "c:1", len(moved), after.version)
    assert switched.nbytes == expected.nbytes > 0 and switched.bytes_left == switched.nbytes
    _report(members, "ps-2", joiner.node_id)  # reported again: no second move
    assert members.layout() == after
    # Done once its backup (server 0, next in the ring) holds what it took: the moved slices are backed up.
    clock.advance(1.0)
    members.report_load(joiner.node_id, Counters(), copy_bytes_left=512)  # of the layout before: nothing
    assert members.joins.all()[0].bytes_left == switched.nbytes
    _report(members, joiner.node_id)  # it routes by the new layout, its backups copying
    members.report_load(joiner.node_id, Counters(), copy_bytes_left=512)
    assert members.joins.all()[0].bytes_left == 512 and members.moves.finished["join"] == 0
    _report(members, joiner.node_id, "ps-0")
    members.report_load(joiner.node_id, Counters())
    (done,) = members.joins.all()
    assert (done.done, done.bytes_left, done.seconds(clock.now())) == (True, 0, 2.5)
    assert members.moves.finished["join"] == 1 and members.moves.seconds_sum == 2.5  # the moves metric


def test_a_join_takes_row_partitions_of_its_donor_by_the_bytes_the_servers_report():
    """Row partitions weigh what their servers report they hold (heartbeats): a donor of big partitions
    gives some of them, whole, and nothing of another server."""
    members, _ = _job(replicas=1, row_partitions_per_server=4)
    _all_in_sync(members)
    before = members.layout()
    assert before is not None and before.partitions_on(2) == (2, 5, 8, 11)
    for i in range(3):
        members.report_load(f"ps-{i}", Counters(partition_bytes={p: 50_000 for p in before.partitions_on(i)}))
    joiner = members.register("ps", JOINER)
    _report(members, "ps-2", joiner.node_id)
    after = members.layout()
    assert after is not None and after.version == before.version + 1
    taken = set(after.partitions_on(3))
    assert taken and taken < {2, 5, 8, 11} and set(after.partitions_on(2)) == {2, 5, 8, 11} - taken
    assert all(after.row_owner(p) == before.row_owner(p) for p in range(12) if p not in taken)
    expected = plan_join(before, JOINER, [50_000] * 12, live={2})
    assert after == expected.after
    (join,) = members.joins.all()
    assert join.partitions == tuple(sorted(taken)) and join.nbytes == expected.nbytes
    # Unreported partitions weigh nothing: the same join before any report moves dense slices only.
    members, _ = _job(replicas=1, row_partitions_per_server=4)
    _all_in_sync(members)
    joiner = members.register("ps", JOINER)
    _report(members, "ps-2", joiner.node_id)
    after = members.layout()
    assert after is not None and not after.partitions_on(3) and after.slices_on(3)


def test_a_joiner_gone_before_it_caught_up_leaves_the_layout_as_it_was():
    members, clock, before, joiner = _joining()
    clock.advance(4)
    for node in ("ps-0", "ps-1", "ps-2"):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == [joiner.node_id]
    assert members.node(joiner.node_id).state is NodeState.DEAD
    (join,) = members.joins.all()  # what `pshard status` shows: rolled back, and why
    assert (join.took, join.done, join.rolled_back, join.layout_version) == (
        False, True, "was declared dead", 0)
    assert join.seconds(clock.now()) == 6 and members.layout() == before
    _report(members, "ps-2", "ps-0")
    assert members.layout() == before


def test_a_server_registering_for_a_job_without_replicas_serves_nothing():
    members, _ = _job(replicas=0)
    before = members.layout()
    members.register("ps", JOINER)
    assert members.joins.all() == () and members.layout() == before


def test_a_new_process_of_a_joiner_rolls_its_join_back_and_joins_again():
    """The joiner SIGKILLed mid-copy and started again: the new process holds nothing of the copy, so the
    first join is rolled back at once (not after a heartbeat timeout) and the second one switches."""
    members, clock, before, first = _joining()
    clock.advance(1)
    second = members.register("ps", JOINER, node_id=first.node_id, last_generation=first.generation)
    assert members.layout() == before  # nothing moved
    _report(members, "ps-2", first.node_id)
    after = members.layout()
    assert after is not None and after.version == before.version + 1 and after.slices_on(3)
    rolled, switched = members.joins.all()
    assert (rolled.rolled_back, rolled.took, rolled.seconds(clock.now())) == (
        "registered again (a new process holds nothing of the copy)", False, 1)
    assert (switched.node_id, switched.took, switched.layout_version, second.rank) == (
        first.node_id, True, after.version, 3)


def test_a_join_in_progress_when_the_scheduler_restarts_goes_on_once_the_layout_is_given_back():
    """A SIGKILL of the scheduler mid-join: the joiner registers again with the restarted scheduler before
    worker-0 gives the layout back. The restore must not be refused for the joiner's place beyond the
    layout (the job could never get its layout back), and the join goes on: the switch once its donor
    reports it in sync."""
    members, _, layout, joiner = _joining()
    assert layout is not None
    restarted = Membership(heartbeat_timeout_s=5)
    for i, address in enumerate((*layout.servers, JOINER)):
        reg = restarted.register("ps", address, node_id=f"ps-{i}", rank_hint=i,
                                 last_generation=members.generation)
        restarted.heartbeat(reg.node_id, reg.generation, in_sync_layout=layout.version)
    assert restarted.joins.all() == ()  # no layout: nothing to join yet
    assert restarted.restore_layout(layout) == (layout, True)
    (join,) = restarted.joins.all()
    assert (join.node_id, join.address, join.done) == (joiner.node_id, JOINER, False)
    _report(restarted, "ps-2", joiner.node_id)
    after = restarted.layout()
    assert after is not None and after.version == layout.version + 1 and after.servers[3] == JOINER
    assert after.slices == plan_join(layout, JOINER, [0] * partition_count(layout), live={2}).after.slices
    (switched,) = restarted.joins.all()
    assert switched.took and switched.layout_version == after.version


def test_a_restore_still_refuses_a_server_registered_at_another_place_of_the_layout():
    """The joiner's exception is for places beyond the list only."""
    members, _ = _job(replicas=1)
    layout = members.layout()
    assert layout is not None
    restarted = Membership(heartbeat_timeout_s=5)
    reg = restarted.register("ps", JOINER, node_id="ps-1", rank_hint=1, last_generation=members.generation)
    restarted.heartbeat(reg.node_id, reg.generation, in_sync_layout=layout.version)
    with pytest.raises(LayoutConflictError, match=rf"servers\[1\] is '{layout.servers[1]}', but 'ps-1'"):
        restarted.restore_layout(dataclasses.replace(layout))
    assert restarted.layout() is None


def test_a_join_in_progress_shows_the_bytes_its_donor_still_has_to_copy():
    """`pshard status` shows a join's copy left: its donor's heartbeats count what its backups lack."""
    members, _, _, joiner = _joining()
    members.report_load("ps-0", Counters(), copy_bytes_left=999)  # not its donor
    (join,) = members.joins.all()
    assert (join.donor, join.bytes_left) == ("", 0)
    members.report_load("ps-2", Counters(), copy_bytes_left=4096)
    (join,) = members.joins.all()
    assert (join.donor, join.bytes_left, join.done) == ("c:1", 4096, False)
    _report(members, "ps-2", joiner.node_id)
    (switched,) = members.joins.all()
    assert (switched.took, switched.done, switched.bytes_left) == (True, False, switched.nbytes)


def test_a_joiner_registering_twice_at_one_clock_reading_keeps_both_joins_listed():
    log = JoinLog()
    log.registered("ps-3", JOINER, 5.0)
    log.registered("ps-3", JOINER, 5.0)  # a coarse clock: a key by time would have merged them
    rolled, current = log.all()
    assert (rolled.done, rolled.took, bool(rolled.rolled_back)) == (True, False, True)
    assert log.in_progress("ps-3") is current and not current.done


def test_a_joiner_copies_beside_its_donors_backup_which_keeps_its_copy_until_the_switch():
    """The ring over every server makes the joiner its predecessor's backup; the predecessor's backup
    among the layout's servers stays one until the switch (issue 20: a join never leaves the donor
    without a copy)."""
    assert joining_backups(2, 4, 1, {0, 1, 2, 3}, placed=3) == ((0,), (3,))  # the donor
    assert joining_backups(0, 4, 1, {0, 1, 2, 3}, placed=3) == ((1,), ())
    assert joining_backups(3, 4, 1, {0, 1, 2, 3}, placed=3) == ((0,), ())  # the joiner itself
    assert joining_backups(1, 4, 1, {0, 1, 3}, placed=3) == ((0,), (3,))  # server 2 dead: 1 donates
    assert joining_backups(2, 4, 2, {0, 1, 2, 3}, placed=3) == ((0, 1), (3,))
    assert joining_backups(2, 4, 1, {0, 1, 2, 3}, placed=4) == ((3,), ())  # switched: no joiner
    assert joining_backups(2, 4, 1, {0, 1, 2, 3}, placed=None) == ((3,), ())  # no layout yet


def test_a_donor_declared_dead_mid_join_fails_over_to_its_old_backup_and_the_join_starts_again():
    members, clock, before, joiner = _joining()
    assert before is not None
    _report(members, "ps-2", "ps-0")  # the donor's old backup still reported in sync: it still counts
    assert members.in_sync.of("c:1") == {"a:1"}
    clock.advance(4)
    for node in ("ps-0", "ps-1", joiner.node_id):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == ["ps-2"]
    after = members.layout()
    assert after is not None and after.version == before.version + 1
    assert {s.slice_key for s in after.slices_on(0)} == {
        s.slice_key for s in (*before.slices_on(0), *before.slices_on(2))}  # a failover, not a loss
    assert members.in_sync.changes["lost"] == 0 and members.view().lost == ()
    rolled, again = members.joins.all()
    assert (rolled.rolled_back, rolled.took) == ("lost its donor: c:1 was declared dead", False)
    assert (again.node_id, again.done) == (joiner.node_id, False)
    _report(members, "ps-1", joiner.node_id)  # its predecessor in the ring now, and its new donor
    switched = members.layout()
    assert switched is not None and switched.version == after.version + 1 and switched.slices_on(3)
    moved = {a.slice_key for a, b in zip(after.slices, switched.slices, strict=True) if a.server != b.server}
    assert moved and all(s.server == 1 for s in after.slices if s.slice_key in moved)  # from the new donor
    assert members.joins.all()[-1].took


def test_a_donor_restarted_mid_join_fails_over_at_once_and_the_switch_releases_the_old_backup():
    members, _, before, joiner = _joining()
    assert before is not None
    donor = members.node("ps-2")
    members.register("ps", "c:1", node_id="ps-2", last_generation=donor.generation)  # a new process
    after = members.layout()
    assert after is not None and after.version == before.version + 1 and not after.slices_on(2)
    assert members.in_sync.changes["lost"] == 0
    rolled, again = members.joins.all()
    assert rolled.rolled_back == "lost its donor: c:1 registered again (a new process holds nothing)"
    assert not again.done
    # A join that switches releases its donor's old backup: the joiner is the donor's backup now.
    members, _, _, joiner = _joining()
    _report(members, "ps-2", "ps-0", joiner.node_id)
    assert members.joins.all()[0].took and members.in_sync.of("c:1") == {JOINER}


def test_a_joiner_declared_dead_while_backing_up_ends_its_join_without_a_roll_back():
    """After the switch the joiner serves what it took: a death then is a failover of it, not a roll back,
    and the join ends there (took, done, not rolled back)."""
    members, clock, _, joiner = _joining()
    _report(members, "ps-2", joiner.node_id)
    switched = members.layout()
    assert switched is not None and members.joins.all()[0].backing_up
    clock.advance(4)
    for node in ("ps-0", "ps-1", "ps-2"):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == [joiner.node_id]
    (ended,) = members.joins.all()
    assert (ended.took, ended.done, ended.rolled_back, ended.layout_version) == (
        True, True, "", switched.version)
    assert members.moves.finished["join"] == 0  # not counted as a finished join
