"""`pshard rebalance`'s moves in the scheduler (issue 20, items 3 and 5): a row partition moves to an in-sync
backup of its server under a new layout version, alone; a move the backup cannot take yet is refused and
changes nothing; the move is done, logged and counted once the new server's backups hold the partition
again. Moves to servers that are no backup (a catch-up copy first) are in test_partition_copies.py."""

from __future__ import annotations

import logging

import pytest
from pshard.common.cluster.loads import Counters
from pshard.common.cluster.replicas import NoInSyncCopyError
from pshard.common.cluster.view import ManualClock
from pshard.common.errors import InvalidArgumentError, LayoutConflictError
from pshard.common.metrics import SchedulerCollector
from pshard.scheduler.membership import Membership

from tests.unit.test_replicas import PARAMS, SERVERS, _all_in_sync, _report


def _job(replicas: int = 1) -> tuple[Membership, ManualClock]:
    clock = ManualClock()
    members = Membership(heartbeat_timeout_s=5, clock=clock, row_partitions_per_server=2)
    for address in SERVERS:
        members.register("ps", address)
    members.propose_layout(members.plan(PARAMS, SERVERS, 4096, replicas))
    return members, clock


def test_a_partition_moves_alone_to_the_in_sync_backup_of_its_server():
    members, _ = _job()
    _all_in_sync(members)
    before = members.layout()
    assert before is not None and before.owners() == (0, 1, 2, 0, 1, 2)
    after = members.move_partition(3, "b:1", layout_version=before.version)
    assert after.version == before.version + 1 and members.layout() == after
    assert after.owners() == (0, 1, 2, 1, 1, 2) and after.slices == before.slices
    assert members.view().layout_version == after.version
    # b:1's backups hold none of partition 3 yet; a:1 keeps its in-sync copy on b:1 for what it serves.
    assert members.in_sync.of("b:1") == frozenset() and members.in_sync.of("a:1") == {"b:1"}
    (move,) = members.moves.all()
    assert (move.partition, move.source, move.target, move.layout_version, move.done) == (
        3, "a:1", "b:1", after.version, False)


@pytest.mark.parametrize("target, partition, error, match", [
    ("a:1", 3, InvalidArgumentError, r"server 0 serves it already"),
    ("z:9", 3, InvalidArgumentError, r"got target 'z:9', the layout's servers are \['a:1', 'b:1', 'c:1'\]"),
    ("b:1", 6, InvalidArgumentError, r"got partition 6, the layout \(version 1\) has partitions 0 to 5"),
])
def test_a_move_that_cannot_be_made_is_refused_naming_why_and_changes_nothing(target, partition, error,
                                                                              match):
    members, _ = _job()
    _all_in_sync(members)
    before, view = members.layout(), members.view()
    with pytest.raises(error, match=match):
        members.move_partition(partition, target)
    assert members.layout() == before and members.view() == view and members.moves.all() == ()


def test_a_move_before_the_backup_holds_a_copy_is_refused_until_it_does():
    members, _ = _job()
    before = members.layout()
    with pytest.raises(NoInSyncCopyError, match=r"does not hold a copy of everything it serves yet; retry"):
        members.move_partition(3, "b:1")
    assert members.layout() == before
    _report(members, "ps-0", "ps-1")
    assert members.move_partition(3, "b:1").owners()[3] == 1


def test_a_move_planned_on_an_older_layout_is_refused():
    members, _ = _job()
    _all_in_sync(members)
    with pytest.raises(LayoutConflictError, match=r"planned with layout version 7, the layout is version 1"):
        members.move_partition(3, "b:1", layout_version=7)


def test_a_move_is_done_logged_and_counted_once_the_new_servers_backup_holds_it(caplog):
    members, clock = _job()
    _all_in_sync(members)
    for node in ("ps-0", "ps-1", "ps-2"):  # their loads, for the move's size
        members.report_load(node, Counters(rows={0: 0}, partition_bytes={3: 4000} if node == "ps-0" else {}))
    after = members.move_partition(3, "b:1")
    clock.advance(1.5)
    ps1 = members.node("ps-1")
    members.heartbeat("ps-1", ps1.generation, in_sync={}, in_sync_layout=after.version)
    members.report_load("ps-1", Counters(), copy_bytes_left=1000)
    (move,) = members.moves.all()
    assert (move.nbytes, move.bytes_left, move.bytes_copied, move.done) == (4000, 1000, 3000, False)
    clock.advance(0.5)
    with caplog.at_level(logging.WARNING, logger="pshard.scheduler"):
        _report(members, "ps-1", "ps-2")
        members.report_load("ps-1", Counters(), copy_bytes_left=0)
    (move,) = members.moves.all()
    assert move.done and move.seconds(clock.now()) == 2.0 and move.bytes_left == 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MOVE:")]
    assert line == (f"MOVE: row partition 3 from a:1 to b:1 in 2.00 s: switched at layout version "
                    f"{after.version}, and b:1 serves its 4000 bytes, backed up again")
    families = {f.name: f for f in SchedulerCollector(members.view, moves=members.moves.stats).collect()}
    (total,) = [s for s in families["pshard_scheduler_moves"].samples if s.labels == {"kind": "rebalance"}]
    assert total.value == 1
    seconds = {s.name: s.value for s in families["pshard_scheduler_move_seconds"].samples
               if not s.labels.get("le")}
    assert seconds == {"pshard_scheduler_move_seconds_count": 1, "pshard_scheduler_move_seconds_sum": 2.0}


def test_a_move_in_progress_shows_its_bytes_in_the_metrics_and_ends_when_its_target_dies():
    members, clock = _job()
    _all_in_sync(members)
    members.report_load("ps-0", Counters(partition_bytes={3: 4000}))
    after = members.move_partition(3, "b:1")
    members.heartbeat("ps-1", members.node("ps-1").generation, in_sync_layout=after.version)
    members.report_load("ps-1", Counters(), copy_bytes_left=2500)
    families = {f.name: f for f in SchedulerCollector(members.view, moves=members.moves.stats).collect()}
    left = {s.labels["partition"]: s.value for s in families["pshard_scheduler_move_bytes_left"].samples}
    copied = {s.labels["partition"]: s.value for s in families["pshard_scheduler_move_bytes_copied"].samples}
    assert (left, copied) == ({"3": 2500}, {"3": 1500})
    clock.advance(6)
    for node in ("ps-0", "ps-2"):
        members.heartbeat(node, members.node(node).generation)
    members.expire()
    (move,) = members.moves.all()
    assert move.done and move.bytes_left == 2500  # ended unfinished: the failover moved it on
    assert members.moves.finished["rebalance"] == 0
