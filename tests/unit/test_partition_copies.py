"""Moves to a server that holds no copy of the partition (issue 20, `pshard rebalance`): the scheduler names
the copy in its views, switches the partition under one new layout version once the source reports the
target caught up, and drops the copy once the target routes by that layout. A crash before the switch rolls
back to the layout in force, one after it completes: never two owners or none (scheduler/partition_copies.py).
"""

from __future__ import annotations

import pytest
from pshard.common.cluster.loads import Counters
from pshard.common.cluster.replicas import NoInSyncCopyError
from pshard.common.cluster.view import ClusterView, PartitionCopy
from pshard.common.errors import InvalidArgumentError
from pshard.scheduler.membership import Membership

from pshard.status import MoveReport, render, summarise
from tests.unit.test_partition_moves import _job
from tests.unit.test_replicas import _all_in_sync


def _beat(members: Membership, node: str, copies: tuple[str, ...] = (), layout_version: int | None = None
          ) -> None:
    """`node` heartbeats, reporting the servers of `copies` (node ids) as holding what it sends them."""
    layout = members.layout()
    assert layout is not None
    reported = {members.node(c).address: members.node(c).generation for c in copies}
    members.heartbeat(node, members.node(node).generation, in_sync=reported,
                      in_sync_layout=layout.version if layout_version is None else layout_version)


def test_a_move_without_replicas_copies_first_then_switches_once_the_target_caught_up():
    members, clock = _job(replicas=0)
    before = members.layout()
    assert before is not None and before.owners() == (0, 1, 2, 0, 1, 2)
    generation = members.generation
    assert members.move_partition(3, "b:1", layout_version=before.version) == before  # nothing switched yet
    assert members.generation == generation + 1  # the views name the copy: the source starts it
    assert members.view().copies == (PartitionCopy(3, "a:1", "b:1"),)
    _beat(members, "ps-0")  # still copying
    assert members.layout() == before
    clock.advance(1.5)
    _beat(members, "ps-0", ("ps-1",))
    after = members.layout()
    assert after is not None and after.version == before.version + 1
    assert after.owners() == (0, 1, 2, 1, 1, 2) and after.slices == before.slices
    assert members.view().copies == (PartitionCopy(3, "a:1", "b:1", switched_at=after.version),)
    # The target routes by the switch's layout: it took its copy over; the copy leaves the views.
    _beat(members, "ps-1", layout_version=after.version)
    assert members.view().copies == ()
    members.report_load("ps-1", Counters())
    (move,) = members.moves.all()
    assert (move.partition, move.source, move.target, move.layout_version, move.done) == (
        3, "a:1", "b:1", after.version, True)
    assert move.seconds(clock.now()) == 1.5  # from the copy's start


def test_a_move_to_a_server_that_is_no_backup_of_its_own_copies_first_with_replicas_too():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    assert members.move_partition(3, "c:1") == before  # c:1 backs up b:1, not a:1
    assert members.view().copies == (PartitionCopy(3, "a:1", "c:1"),)
    _beat(members, "ps-0", ("ps-1", "ps-2"))
    after = members.layout()
    assert after is not None and after.owners()[3] == 2
    assert members.in_sync.of("c:1") == frozenset()  # its backup holds none of partition 3 yet


@pytest.mark.parametrize("who", ["ps-0", "ps-1"])
def test_a_source_or_target_gone_before_the_switch_rolls_the_move_back(who):
    members, clock = _job(replicas=0)
    before = members.layout()
    members.move_partition(3, "b:1")
    clock.advance(6)
    for node in {"ps-0", "ps-1", "ps-2"} - {who}:
        _beat(members, node)
    assert [n.node_id for n in members.expire()] == [who]
    assert members.view().copies == () and members.layout() == before
    members.register("ps", members.node(who).address, node_id=who)  # back, as a new process
    _beat(members, "ps-0", ("ps-1",))  # a report about the copy ends nothing now: it is gone
    assert members.layout() == before and members.moves.all() == ()


def test_a_target_registered_again_mid_copy_holds_nothing_of_it_and_the_move_rolls_back():
    members, _ = _job(replicas=0)
    before = members.layout()
    members.move_partition(3, "b:1")
    old = members.node("ps-1").generation
    members.register("ps", "b:1", node_id="ps-1")
    assert members.view().copies == ()
    # The source's report names the old incarnation: it switches nothing.
    members.heartbeat("ps-0", members.node("ps-0").generation, in_sync={"b:1": old},
                      in_sync_layout=before.version)
    assert members.layout() == before


def test_a_target_gone_after_the_switch_leaves_the_move_complete():
    members, clock = _job(replicas=0)
    members.move_partition(3, "b:1")
    _beat(members, "ps-0", ("ps-1",))
    switched = members.layout()
    assert switched is not None and switched.owners()[3] == 1
    clock.advance(6)
    for node in ("ps-0", "ps-2"):
        _beat(members, node)
    members.expire()
    layout = members.layout()
    assert members.view().copies == () and layout is not None and layout.owners()[3] == 1


def test_a_retried_move_starts_no_second_copy_and_another_target_waits_for_the_first():
    members, _ = _job(replicas=0)
    members.move_partition(3, "b:1")
    generation = members.generation
    members.move_partition(3, "b:1")  # the operator's retry
    assert members.generation == generation and len(members.view().copies) == 1
    with pytest.raises(InvalidArgumentError, match=r"row partition 3 to 'c:1': it is moving to 'b:1' "
                                                   r"already \(copying\); wait for that move"):
        members.move_partition(3, "c:1")
    assert members.view().copies == (PartitionCopy(3, "a:1", "b:1"),)


def test_a_second_copy_between_the_same_two_servers_waits_until_the_first_is_taken_over():
    """The target keeps one replica of its source for every partition copied to it and drops it whole when
    it takes a switched copy over: a second copy begun before that lost the rows it had sent already."""
    members, _ = _job(replicas=0)
    members.move_partition(3, "b:1")
    views = members.generation
    with pytest.raises(NoInSyncCopyError, match=r"row partition 0 to 'b:1': row partition 3 is moving from "
                                                r"server 0 to server 1 already \(still copying\)"):
        members.move_partition(0, "b:1")
    _beat(members, "ps-0", ("ps-1",))  # partition 3 switches
    switched = members.layout()
    assert switched is not None and switched.owners()[3] == 1
    with pytest.raises(NoInSyncCopyError, match=r"\(switched at layout version \d+, not yet taken over\)"):
        members.move_partition(0, "b:1")
    assert members.layout() == switched and members.generation == views + 1  # nothing started
    _beat(members, "ps-1", layout_version=switched.version)  # b took partition 3 over: done
    members.move_partition(0, "b:1")
    assert members.view().copies == (PartitionCopy(0, "a:1", "b:1"),)


def test_a_failover_that_gives_a_copying_partition_elsewhere_rolls_the_copy_back():
    members, clock = _job(replicas=1)
    _all_in_sync(members)
    members.move_partition(3, "c:1")
    clock.advance(6)
    for node in ("ps-1", "ps-2"):
        _beat(members, node)
    members.expire()  # a:1 dies: b:1, its backup, serves partition 3 now
    layout = members.layout()
    assert layout is not None and layout.owners()[3] == 1 and members.view().copies == ()


def test_a_restarted_scheduler_knows_no_copy_so_the_layout_in_force_stands():
    members, _ = _job(replicas=0)
    members.move_partition(3, "b:1")
    restarted, _ = _job(replicas=0)  # soft state: a new scheduler hears of no copy, and its views name none
    assert restarted.view().copies == ()
    _beat(restarted, "ps-0", ("ps-1",))
    layout = restarted.layout()
    assert layout is not None and layout.owners()[3] == 0


def test_a_copy_in_progress_shows_its_bytes_left_as_its_source_reports_them():
    members, clock = _job(replicas=0)
    members.report_load("ps-0", Counters(partition_bytes={3: 4000}))
    members.move_partition(3, "b:1")
    clock.advance(0.5)
    members.report_load("ps-0", Counters(partition_bytes={3: 4000}), copy_bytes_left=1500)
    (copy,) = members.copies.in_progress()
    assert (copy.nbytes, copy.bytes_left, clock.now() - copy.started) == (4000, 1500, 0.5)
    _beat(members, "ps-0", ("ps-1",))
    assert members.copies.in_progress() == ()  # switched: a move in the MoveLog from now on
    (move,) = members.moves.all()
    assert move.nbytes == 4000 and not move.done
    text = render(summarise("s:1", ClusterView(3, ()), [], moves=[
        MoveReport(3, "a:1", "b:1", 0, 4000, 2500, 1500, 0.5, False)]))
    (line,) = [line for line in text.splitlines() if line.startswith("partition 3")]
    assert line.split()[:4] == ["partition", "3", "copying", "a:1"]
