"""The in-flight byte budget (ps_server/budget.py): admission, release, the lone-request exception, hints."""

from __future__ import annotations

import pytest
from pshard.common.errors import OverloadedError
from pshard.ps_server.budget import MAX_RETRY_AFTER_MS, MIB, MIN_RETRY_AFTER_MS, InflightBudget


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
