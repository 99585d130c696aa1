"""The scheduler's automatic rebalance (issue 20, item 3; scheduler/auto_rebalance.py, pure): one move, the
planner's first, only when the hottest live server is above the threshold, nothing else moves, the cool-down
has passed, every server has a full window of load samples, and the move takes enough off the hottest load;
and its adapter in the scheduler (scheduler/auto_rebalancer.py) on a real `Membership`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.loads import WINDOW_S, Counters, ServerLoad, partition_loads
from pshard.common.cluster.moves import plan_rebalance
from pshard.common.cluster.view import ManualClock
from pshard.common.errors import InvalidArgumentError
from pshard.common.metrics import SchedulerCollector
from pshard.scheduler.__main__ import build_parser, policy_from_args
from pshard.scheduler.auto_rebalance import RebalancePolicy, decide, still_above
from pshard.scheduler.auto_rebalancer import AutoRebalancer
from pshard.scheduler.membership import Membership
from pshard.scheduler.settings import DEFAULT_LOAD_WINDOW_S

from pshard.status import AutoRebalanceReport, render, summarise

SERVERS = ("a:1", "b:1", "c:1")
POLICY = RebalancePolicy(threshold=1.2, cooldown_s=60.0, window_s=10.0, min_gain=0.05)
NOW = 1000.0
FULL = dict.fromkeys(SERVERS, 10.0)  # a full window of samples from every server


def _layout(partitions_per_server: int = 4, servers: Sequence[str] = SERVERS) -> Layout:
    """Partition p on server p mod n, as the scheduler plans them."""
    return plan_layout([ParamSpec("bias", "float32", (4,))], servers,
                       row_partitions=len(servers) * partitions_per_server)


def _loads(layout: Layout, rates: Mapping[int, float]) -> list[ServerLoad]:
    """Each server's report: the rows/s of the partitions it serves (1 kB each)."""
    return [ServerLoad(address, rows_per_s={p: float(rates.get(p, 0.0)) for p in layout.partitions_on(i)},
                       partition_bytes=dict.fromkeys(layout.partitions_on(i), 1000))
            for i, address in enumerate(layout.servers)]


def _decide(layout: Layout, rates: Mapping[int, float], *, policy: RebalancePolicy = POLICY,
            live: Sequence[str] = SERVERS, sampled: Mapping[str, float] = FULL, busy: str = "",
            last_move_at: float | None = None, moved_at: Mapping[int, float] | None = None,
            above_since: float | None = NOW - 10.0):
    """By default the hottest server has been above the threshold for a full window already."""
    return decide(policy, layout, _loads(layout, rates), live, sampled, busy, last_move_at, moved_at or {},
                  NOW, above_since)


SKEWED = {0: 400.0, 3: 300.0, 6: 100.0, 9: 100.0, 1: 100.0, 2: 100.0}  # a:1 at 900 of a 1100 total


def test_a_hot_server_above_the_threshold_moves_the_planners_first_move():
    layout = _layout()
    decision = _decide(layout, SKEWED)
    rates, sizes = partition_loads(_loads(layout, SKEWED), [layout.servers[o] for o in layout.owners()])
    first = plan_rebalance(layout, rates, sizes, {0, 1, 2}, tolerance=1.2).moves[0]
    assert decision.move == first and decision.move.source == 0
    assert decision.ratio == pytest.approx(900 / (1100 / 3))
    assert decision.loads == {0: 900.0, 1: 100.0, 2: 100.0}


def test_a_balanced_job_moves_nothing_and_says_so():
    layout = _layout()
    decision = _decide(layout, {p: 100.0 for p in range(12)} | {0: 115.0})
    assert decision.move is None and decision.reason.startswith("balanced:")
    assert "1.2x" in decision.reason


def test_a_move_needs_the_hottest_server_above_the_threshold_for_a_full_window():
    layout = _layout()
    first = _decide(layout, SKEWED, above_since=None)
    assert first.move is None and first.reason.startswith("rising: the hottest server 0 is at 2.45x")
    since = still_above(POLICY, first, None, NOW)
    assert since == NOW
    assert _decide(layout, SKEWED, above_since=NOW - 9.0).move is None
    assert _decide(layout, SKEWED, above_since=NOW - 10.0).move is not None
    # One decision below it (or one that weighed nothing: busy, cooling down) starts the window over.
    balanced = _decide(layout, {p: 100.0 for p in range(12)})
    assert still_above(POLICY, balanced, since, NOW + 1) is None
    assert still_above(POLICY, _decide(layout, SKEWED, busy="a move"), since, NOW + 1) is None


def test_nothing_moves_while_anything_else_moves():
    decision = _decide(_layout(), SKEWED, busy="server d:1 is joining")
    assert decision.move is None and decision.reason == "waiting: server d:1 is joining"


def test_the_cool_down_after_the_last_move_holds_the_next():
    layout = _layout()
    held = _decide(layout, SKEWED, last_move_at=NOW - 59.0)
    assert held.move is None and held.reason.startswith("cooling down: 1.0 s left")
    assert _decide(layout, SKEWED, last_move_at=NOW - 60.0).move is not None


@pytest.mark.parametrize("sampled", [{"a:1": 10.0, "b:1": 10.0, "c:1": 9.5}, {"a:1": 10.0, "b:1": 10.0}])
def test_no_move_without_a_full_window_of_samples_from_every_live_server(sampled):
    decision = _decide(_layout(), SKEWED, sampled=sampled)
    assert decision.move is None and decision.reason.startswith("sampling: server 2 (c:1)")


def test_a_dead_server_is_neither_weighed_nor_waited_for():
    layout = _layout()
    rates = {0: 400.0, 3: 300.0, 1: 100.0}  # c:1 (dead) reports nothing
    decision = _decide(layout, rates, live=("a:1", "b:1"), sampled={"a:1": 10.0, "b:1": 10.0})
    assert decision.move is not None and (decision.move.source, decision.move.target) == (0, 1)


def test_a_partition_moved_within_the_cool_down_stays_put():
    layout = _layout()
    first = _decide(layout, SKEWED).move
    assert first is not None
    decision = _decide(layout, SKEWED, moved_at={int(first.item): NOW - 30.0})
    assert decision.move is None and "stays put" in decision.reason


def test_a_move_that_takes_too_little_off_the_hottest_is_not_made():
    layout = _layout()
    # a:1 at 550 rows/s, 1.22x the mean: its 100 rows/s partition to b:1 leaves b:1 the hottest at 500.
    rates = {p: 100.0 for p in range(12)} | {0: 150.0, 3: 150.0, 6: 150.0}
    made = _decide(layout, rates).move
    assert made is not None and (made.item, made.target) == (9, 1)
    strict = _decide(layout, rates, policy=RebalancePolicy(1.2, min_gain=0.5))
    assert strict.move is None and "below the minimum 0.5" in strict.reason


def test_one_partition_too_hot_to_move_alone_is_left_where_it_is():
    layout = _layout()
    decision = _decide(layout, {0: 1000.0, 1: 10.0, 2: 10.0})  # moving it would only move the hot spot
    assert decision.move is None and decision.reason.startswith("no single partition move")


def test_an_idle_job_moves_nothing():
    decision = _decide(_layout(), {})
    assert decision.move is None and decision.reason.startswith("idle")


@pytest.mark.parametrize(("field", "kwargs"), [("threshold", {"threshold": 0.9}),
                                               ("cooldown_s", {"threshold": 1.2, "cooldown_s": -1.0}),
                                               ("window_s", {"threshold": 1.2, "window_s": 0.0}),
                                               ("min_gain", {"threshold": 1.2, "min_gain": -0.1})])
def test_a_bad_policy_is_refused_naming_the_field_and_the_value(field, kwargs):
    with pytest.raises(InvalidArgumentError, match=rf"rebalance policy {field}: got {kwargs[field]}"):
        RebalancePolicy(**kwargs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 1000.0), min_size=12, max_size=12), st.floats(1.0, 2.0), st.floats(0.01, 0.3))
def test_repeated_decisions_settle_and_never_raise_the_hottest_load(rates, threshold, min_gain):
    """The loads stay as they are (each partition's rows/s follows it): each move takes at least min_gain
    of the mean off the hottest server, so the policy settles within (ratio - 1) / min_gain moves and never
    moves a partition back and forth."""
    layout = _layout()
    policy = RebalancePolicy(threshold, cooldown_s=0.0, window_s=1.0, min_gain=min_gain)
    by_partition = dict(enumerate(rates))
    total = sum(rates)
    bound = int((max(sum(rates[p] for p in layout.partitions_on(i)) for i in range(3)) * 3 / total - 1)
                / min_gain) + 1 if total > 0 else 0
    hottest = float("inf")
    for _ in range(bound + 1):
        decision = decide(policy, layout, _loads(layout, by_partition), SERVERS, FULL, "", None, {}, NOW,
                          NOW - 1.0)
        if decision.move is None:
            break
        assert decision.loads is not None and max(decision.loads.values()) <= hottest
        hottest = max(decision.loads.values())
        owners = list(layout.owners())
        owners[int(decision.move.item)] = decision.move.target  # type: ignore[call-overload]
        layout = Layout(layout.params, layout.servers, layout.slice_bytes, layout.slices,
                        version=layout.version + 1, row_owners=tuple(owners))
    else:
        pytest.fail(f"still moving after {bound + 1} decisions")


# ---- the scheduler's flags ----


def test_the_scheduler_flags_parse_once_into_the_policy_which_is_off_by_default():
    parser = build_parser()
    assert policy_from_args(parser, parser.parse_args([])) is None
    args = parser.parse_args(["--rebalance-auto", "1.3", "--rebalance-cooldown", "30",
                              "--load-window-s", "5"])
    assert policy_from_args(parser, args) == RebalancePolicy(1.3, cooldown_s=30.0, window_s=5.0)
    default = policy_from_args(parser, parser.parse_args(["--rebalance-auto", "1.3"]))
    assert default is not None and (default.cooldown_s, default.window_s) == (60.0, 10.0)
    assert "--rebalance-auto THRESHOLD" in parser.format_help() and "default 60" in parser.format_help()


def test_the_scheduler_default_load_window_is_the_load_meters():
    assert DEFAULT_LOAD_WINDOW_S == WINDOW_S == RebalancePolicy(1.2).window_s


@pytest.mark.parametrize(("argv", "error"), [
    (["--rebalance-auto", "0.9"], "--rebalance-auto: got '0.9', expected a number >= 1"),
    (["--rebalance-cooldown", "30"], "--rebalance-cooldown: got 30, but the automatic rebalance is off"),
])
def test_bad_rebalance_flags_are_usage_errors_naming_the_flag(argv, error, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_:
        policy_from_args(parser, parser.parse_args(argv))
    assert exit_.value.code == 2 and error in capsys.readouterr().err


# ---- the adapter, on the scheduler's membership table ----


def _job(policy: RebalancePolicy = POLICY) -> tuple[Membership, ManualClock, AutoRebalancer]:
    clock = ManualClock()
    members = Membership(heartbeat_timeout_s=30, clock=clock, row_partitions_per_server=4, load_window_s=10.0)
    for address in SERVERS:
        members.register("ps", address)
    members.propose_layout(members.plan([ParamSpec("bias", "float32", (4,))], SERVERS, 4096))
    return members, clock, AutoRebalancer(members, policy)


def _run(members: Membership, clock: ManualClock, rates: Mapping[int, float], seconds: int) -> None:
    """Every server heartbeats once a second for `seconds`, its partitions pulled at `rates` rows/s."""
    layout = members.layout()
    assert layout is not None
    for _ in range(seconds):
        clock.advance(1.0)
        t = clock.now()
        for i in range(len(SERVERS)):
            node = f"ps-{i}"
            members.heartbeat(node, members.node(node).generation, in_sync_layout=layout.version)
            rows = {p: int(rates.get(p, 0.0) * t) for p in layout.partitions_on(i)}
            members.report_load(node, Counters(rows=rows, partition_bytes=dict.fromkeys(rows, 1000)))


def test_the_scheduler_starts_one_move_off_a_hot_server_logs_counts_and_shows_it(caplog):
    members, clock, rebalancer = _job()
    _run(members, clock, SKEWED, 5)
    assert not rebalancer.tick() and rebalancer.status().reason.startswith("sampling:")
    _run(members, clock, SKEWED, 6)
    assert not rebalancer.tick() and rebalancer.status().reason.startswith("rising:")
    _run(members, clock, SKEWED, 10)
    before = members.layout()
    with caplog.at_level(logging.WARNING, logger="pshard.scheduler"):
        assert rebalancer.tick()
    (line,) = [r.getMessage() for r in caplog.records if "AUTO-REBALANCE" in r.getMessage()]
    (copy,) = members.copies.in_progress()  # no replicas: a catch-up copy, then the switch
    assert before is not None and before.row_owner(copy.partition) == 0 and copy.source == "a:1"
    assert f"row partition {copy.partition} from server 0 (a:1)" in line and "threshold 1.2x" in line
    assert "0: 900.0" in line  # the loads before
    assert not rebalancer.tick() and rebalancer.status().reason.startswith("waiting: row partition")
    status = rebalancer.status()
    assert (status.moves, status.last_move, status.eligible_in_s) == (
        1, f"row partition {copy.partition} from a:1 to {copy.target}", 60.0)
    assert members.moves.stats().automatic == 1
    metrics = {m.name: m for m in SchedulerCollector(members.view, moves=members.moves.stats).collect()}
    assert [s.value for s in metrics["pshard_scheduler_auto_rebalance_moves"].samples] == [1]
    report = AutoRebalanceReport(**dataclasses.asdict(status))
    assert "AUTO-REBALANCE  on" in render(summarise("s:1", members.view(), [], auto_rebalance=report))


def test_a_balanced_job_makes_the_scheduler_move_nothing():
    members, clock, rebalancer = _job()
    _run(members, clock, {p: 100.0 for p in range(12)}, 12)
    assert not rebalancer.tick() and rebalancer.status().reason.startswith("balanced:")
    assert members.layout().version == 1 and not members.copies.in_progress()  # type: ignore[union-attr]
