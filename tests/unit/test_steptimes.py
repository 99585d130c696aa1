"""StepTimes: per-worker step times from the intervals between pushes of consecutive clocks (issue 10)."""

from __future__ import annotations

import pytest
from pshard.ps_server.core.steptimes import WINDOW, StepTimes


def test_intervals_between_consecutive_clocks_are_the_step_times() -> None:
    times = StepTimes()
    for clock, now in enumerate([0.0, 1.0, 3.0, 4.0]):
        times.record("w0", clock, now)
        times.record("w0", clock, now + 0.5)  # another slice of the same step: not a step
    summary = times.summary()["w0"]
    assert summary.steps == 3
    assert summary.p50_s == pytest.approx(1.0)
    assert summary.max_s == pytest.approx(2.0)
    assert summary.p50_s <= summary.p90_s <= summary.p99_s <= summary.max_s


def test_a_gap_of_several_clocks_is_not_a_step() -> None:
    # A worker that rejoined at the job's clock, or a late first push: no interval to time.
    times = StepTimes()
    times.record("w0", 0, 0.0)
    times.record("w0", 50, 100.0)
    assert times.summary() == {}
    times.record("w0", 51, 100.5)
    assert times.summary()["w0"].steps == 1


def test_the_window_keeps_the_recent_steps_only() -> None:
    times, now = StepTimes(), 0.0
    for clock in range(WINDOW + 11):
        times.record("slow", clock, now)
        now += 10.0 if clock < 10 else 1.0  # ten slow steps, then fast ones
    summary = times.summary()["slow"]
    assert summary.steps == WINDOW
    assert summary.max_s == pytest.approx(1.0)  # the early 10 s steps have left the window
