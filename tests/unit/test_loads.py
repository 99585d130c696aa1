"""Each server's load from its heartbeat counters, and the moves log (issue 20, items 3 and 5): rates over
the injected clock, restarts, bad input refused, partitions read from the server that owns them, and
moves that finish only once the new server's backups hold the partition."""

from __future__ import annotations

import pytest
from pshard.common.cluster.loads import Counters, LoadMeter, ServerLoad, partition_loads
from pshard.common.errors import InvalidArgumentError
from pshard.scheduler.partition_moves import DRAIN, REBALANCE, MoveLog


def test_rates_are_the_growth_of_the_counters_over_the_reports_kept():
    meter = LoadMeter(window_s=10)
    assert meter.load("a:1") == ServerLoad("a:1")  # nothing reported: no load
    meter.report("a:1", Counters(1000, 500, {0: 10, 3: 0}, {0: 4096, 3: 64}), now=0.0)
    assert meter.load("a:1").rows_per_s == {0: 0.0, 3: 0.0}  # one report: no rate yet
    meter.report("a:1", Counters(3000, 1500, {0: 110, 3: 20}, {0: 8192, 3: 64}), now=2.0)
    load = meter.load("a:1")
    assert (load.bytes_in_per_s, load.bytes_out_per_s) == (1000.0, 500.0)
    assert load.rows_per_s == {0: 50.0, 3: 10.0} and load.partition_bytes == {0: 8192, 3: 64}


def test_a_rate_spans_the_window_not_the_last_two_heartbeats():
    meter = LoadMeter(window_s=4)
    for t in range(11):  # 100 rows/s, but one heartbeat saw none and the next twice as many
        rows = 100 * t if t != 5 else 400
        meter.report("a:1", Counters(rows={1: rows}), now=float(t))
    assert meter.load("a:1").rows_per_s[1] == pytest.approx(100.0)


def test_a_partition_new_to_a_server_is_rated_from_its_first_report_not_from_zero():
    meter = LoadMeter(window_s=10)
    meter.report("a:1", Counters(rows={0: 5}), now=0.0)
    meter.report("a:1", Counters(rows={0: 5, 7: 10_000}), now=1.0)  # 7 moved here, counted before
    meter.report("a:1", Counters(rows={0: 5, 7: 10_040}), now=3.0)
    assert meter.load("a:1").rows_per_s[7] == pytest.approx(20.0)


def test_counters_that_went_down_are_a_restarted_server_whose_reports_start_over():
    meter = LoadMeter(window_s=10)
    meter.report("a:1", Counters(10_000, 10_000, {0: 1000}), now=0.0)
    meter.report("a:1", Counters(20_000, 20_000, {0: 2000}), now=1.0)
    meter.report("a:1", Counters(100, 100, {0: 10}), now=2.0)  # a new process at the same address
    assert meter.load("a:1").bytes_in_per_s == 0.0
    meter.report("a:1", Counters(300, 100, {0: 30}), now=4.0)
    assert meter.load("a:1").bytes_in_per_s == 100.0 and meter.load("a:1").rows_per_s == {0: 10.0}


def test_a_report_naming_a_partition_beyond_any_layout_is_refused_and_changes_nothing():
    meter = LoadMeter()
    meter.report("a:1", Counters(rows={0: 1}), now=0.0)
    with pytest.raises(InvalidArgumentError, match=r"server a:1 load: got row partitions \[5000\], "
                                                   r"expected 0 to 4095"):
        meter.report("a:1", Counters(rows={0: 9, 5000: 1}), now=1.0)
    assert meter.load("a:1").rows_per_s == {0: 0.0}
    with pytest.raises(InvalidArgumentError, match=r"window_s: got 0, expected > 0"):
        LoadMeter(window_s=0)


def test_each_partition_is_read_from_the_server_the_layout_gives_it():
    loads = [ServerLoad("a:1", rows_per_s={0: 5.0, 2: 9.0}, partition_bytes={0: 100, 2: 300}),
             ServerLoad("b:1", rows_per_s={1: 7.0, 2: 1.0}, partition_bytes={1: 200, 2: 50})]
    # Partition 2 just moved to b:1; a:1 still reported it from before it knew.
    assert partition_loads(loads, ["a:1", "b:1", "b:1", "c:1"]) == ([5.0, 7.0, 1.0, 0.0], [100, 200, 50, 0])


def test_a_move_is_done_once_the_new_servers_backup_holds_it_again():
    moves = MoveLog()
    moves.switched(3, "a:1", "b:1", layout_version=5, nbytes=1000, now=10.0)
    assert [(m.bytes_left, m.done) for m in moves.all()] == [(1000, False)]
    # b:1 still routes by layout 4: its report says nothing of the move.
    assert moves.progress("b:1", 4, bytes_left=0, backed_up=True, now=10.5) == []
    assert moves.progress("b:1", 5, bytes_left=400, backed_up=False, now=11.0) == []
    (move,) = moves.all()
    assert (move.bytes_copied, move.bytes_left, move.seconds(12.0)) == (600, 400, 2.0)
    assert moves.progress("c:1", 5, bytes_left=0, backed_up=True, now=11.5) == []  # another server
    (done,) = moves.progress("b:1", 5, bytes_left=0, backed_up=True, now=12.5)
    assert (done.partition, done.done, done.bytes_copied, done.seconds(99.0)) == (3, True, 1000, 2.5)
    assert moves.finished == {REBALANCE: 1} and moves.seconds_sum == 2.5
    assert dict(moves.cumulative())["2.5"] == 1.0 and dict(moves.cumulative())["1.0"] == 0.0


def test_moves_whose_target_is_gone_end_unfinished_and_drains_count_as_moves():
    moves = MoveLog(keep_done=1)
    moves.switched(1, "a:1", "b:1", 5, 10, now=0.0)
    moves.switched(2, "a:1", "c:1", 6, 10, now=0.0)
    (ended,) = moves.gone("b:1", now=1.0)
    assert ended.partition == 1 and ended.done and ended.bytes_left == 10
    assert [m.partition for m in moves.all()] == [2, 1]  # in progress first
    moves.progress("c:1", 6, 0, True, now=3.0)
    assert [m.partition for m in moves.all()] == [2]  # one done move kept
    moves.drained(0.3)
    assert moves.finished == {REBALANCE: 1, DRAIN: 1}
    assert dict(moves.cumulative())["+Inf"] == 2.0


def test_moves_ended_by_their_targets_death_count_toward_the_done_moves_kept():
    moves = MoveLog(keep_done=1)
    for partition in range(3):
        moves.switched(partition, "a:1", "b:1", 5 + partition, 10, now=0.0)
    assert len(moves.gone("b:1", now=1.0)) == 3
    assert [m.partition for m in moves.all()] == [2]
