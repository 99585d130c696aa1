"""The in-flight byte budget (ps_server/transport/budget.py): admission, release, the lone-request exception,
hints;
the wasted-request tarpit: when a peer is held, for how long, and when it is read again."""

from __future__ import annotations

import pytest
from pshard.common.errors import OverloadedError
from pshard.ps_server.transport.budget import (
    MAX_RETRY_AFTER_MS,
    MIB,
    MIN_RETRY_AFTER_MS,
    InflightBudget,
    WasteTarpit,
)


def test_requests_within_the_budget_are_admitted_and_counted() -> None:
    budget = InflightBudget(10 * MIB)
    a, b = budget.reservation("a"), budget.reservation("b")
    a.add(4 * MIB)
    b.add(6 * MIB)
    assert budget.in_flight == 10 * MIB
    assert budget.peak == 10 * MIB


def test_a_request_past_the_budget_is_refused_naming_the_budget_and_what_is_in_flight() -> None:
    budget = InflightBudget(10 * MIB)
    budget.reservation("first").add(8 * MIB)
    second = budget.reservation("PushPull from 'w1'")
    with pytest.raises(OverloadedError, match=r"PushPull from 'w1': .*8\.0 MiB in flight \+ 4\.0 MiB "
                                              r"requested > --max-inflight-mb 10\.0 MiB") as caught:
        second.add(4 * MIB)
    assert caught.value.status == "RESOURCE_EXHAUSTED"
    assert caught.value.retry_after_ms is not None and caught.value.retry_after_ms >= MIN_RETRY_AFTER_MS
    assert second.held == 0
    assert budget.in_flight == 8 * MIB
    assert budget.refused == 1


def test_released_bytes_make_room_again() -> None:
    budget = InflightBudget(10 * MIB)
    with budget.reservation("first") as first:
        first.add(8 * MIB)
    assert budget.in_flight == 0
    budget.reservation("second").add(8 * MIB)  # would be refused had the first kept its bytes


def test_a_stream_releases_part_of_what_it_holds_as_slices_are_applied() -> None:
    budget = InflightBudget(10 * MIB)
    stream = budget.reservation("Exchange")
    stream.add(4 * MIB)
    stream.add(4 * MIB)
    stream.release(4 * MIB)
    assert (stream.held, budget.in_flight) == (4 * MIB, 4 * MIB)
    stream.release()
    stream.release()  # releasing twice gives back nothing twice
    assert budget.in_flight == 0


def test_a_lone_request_bigger_than_the_budget_still_completes() -> None:
    budget = InflightBudget(10 * MIB)
    declare = budget.reservation("Declare")
    for _ in range(5):
        declare.add(4 * MIB)  # nothing else in flight: admitted past the limit
    assert budget.in_flight == 20 * MIB
    with pytest.raises(OverloadedError):
        budget.reservation("another").add(1)  # while it runs, nothing else gets in
    declare.release()
    budget.reservation("another").add(1)


def test_the_retry_hint_grows_with_the_overload_and_is_capped() -> None:
    budget = InflightBudget(10 * MIB)
    budget.reservation("big").add(10 * MIB)
    hints = []
    for ask in (1, 10 * MIB, 1000 * MIB):
        with pytest.raises(OverloadedError) as caught:
            budget.reservation("x").add(ask)
        hints.append(caught.value.retry_after_ms)
    assert hints[0] == MIN_RETRY_AFTER_MS
    assert hints[0] < hints[1] <= hints[2] == MAX_RETRY_AFTER_MS


def test_bad_sizes_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="limit_bytes"):
        InflightBudget(0)
    with pytest.raises(ValueError, match="nbytes"):
        InflightBudget(1).reservation("x").add(-1)


# ---- the wasted-request tarpit ----

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def tarpit(clock: Clock, limit_bytes: int = 8 * MIB) -> WasteTarpit:
    return WasteTarpit(limit_bytes, first_hold_s=0.05, max_hold_s=0.4, max_peers=3, now=clock)


def test_a_peer_is_read_until_it_has_wasted_the_limit_in_a_row() -> None:
    clock = Clock()
    pit = tarpit(clock)
    assert pit.admit("a") is None
    assert not pit.served("a", 4 * MIB, wasted=True)
    assert pit.admit("a") is None
    assert pit.served("a", 4 * MIB, wasted=True)  # 8 MiB in a row: held from now on
    assert pit.admit("a") == 0.05
    assert pit.admit("b") is None  # another connection is not concerned
    assert pit.held == 1


def test_small_mistakes_never_add_up_to_a_hold_and_a_success_forgets_the_streak() -> None:
    clock = Clock()
    pit = tarpit(clock)
    for _ in range(1000):
        pit.served("a", 1000, wasted=True)
    assert pit.admit("a") is None  # 1 MB of bad requests: under the limit
    pit.served("a", 100, wasted=False)
    pit.served("a", 7 * MIB, wasted=True)
    assert pit.admit("a") is None  # the streak started again after the success
    pit.served("a", MIB, wasted=True)
    assert pit.admit("a") == 0.05


def test_a_peer_that_comes_back_early_is_held_longer_each_time_up_to_the_cap() -> None:
    clock = Clock()
    pit = tarpit(clock)
    pit.served("a", 8 * MIB, wasted=True)
    holds = []
    for _ in range(5):
        hold = pit.admit("a")
        assert hold is not None
        holds.append(hold)
        clock.t += hold  # held, refused, and it sends again at once: early
    assert holds == [0.05, 0.1, 0.2, 0.4, 0.4]


def test_a_peer_that_waits_as_asked_is_read_again() -> None:
    clock = Clock()
    pit = tarpit(clock)
    pit.served("a", 8 * MIB, wasted=True)
    hold = pit.admit("a")
    assert hold is not None
    assert pit.retry_after_ms(hold) == 50
    clock.t += hold + hold  # held, then it waited the retry hint
    assert pit.admit("a") is None
    assert not pit.served("a", 100, wasted=False)
    assert pit.admit("a") is None


def test_a_read_request_wasted_again_holds_the_peer_longer() -> None:
    clock = Clock()
    pit = tarpit(clock)
    assert pit.served("a", 8 * MIB, wasted=True)
    clock.t += 1.0
    assert pit.admit("a") is None  # it waited: read
    assert not pit.served("a", 4 * MIB, wasted=True)  # still held, not newly
    assert pit.admit("a") == 0.1


def test_only_the_most_recent_peers_are_remembered() -> None:
    clock = Clock()
    pit = tarpit(clock)
    for peer in "abcd":
        pit.served(peer, 8 * MIB, wasted=True)
    assert pit.admit("a") is None  # forgotten: max_peers is 3
    assert all(pit.admit(peer) == 0.05 for peer in "bcd")


def test_bad_tarpit_settings_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="limit_bytes"):
        WasteTarpit(0)
    with pytest.raises(ValueError, match="max_hold_s"):
        WasteTarpit(MIB, first_hold_s=2.0, max_hold_s=1.0)


def test_a_fast_path_peer_is_not_read_for_what_is_left_of_its_hold() -> None:
    clock = Clock()
    pit = tarpit(clock)
    assert pit.hold_left("a") == 0.0  # never wasted anything
    assert not pit.served("a", 4 * MIB, wasted=True)
    assert pit.hold_left("a") == 0.0  # under the limit
    assert pit.served("a", 4 * MIB, wasted=True)
    assert pit.hold_left("a") == pytest.approx(0.05)
    clock.t += 0.03
    assert pit.hold_left("a") == pytest.approx(0.02)
    clock.t += 0.02
    assert pit.hold_left("a") == 0.0  # the hold is over: read again
    assert not pit.served("a", 4 * MIB, wasted=True)  # wasted again after it: held twice as long
    assert pit.hold_left("a") == pytest.approx(0.1)
    assert pit.held == 3
    pit.served("a", 10, wasted=False)
    assert pit.hold_left("a") == 0.0
