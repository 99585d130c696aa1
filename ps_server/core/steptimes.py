"""Straggler and hang reports (docs/architecture.md, 9 Failures): per-worker step times and sync clocks
that have stopped advancing.

The server measures step time itself, as the interval between a worker's pushes of consecutive clocks:
it needs nothing from the worker, and what a straggler costs the others is exactly that interval.
Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

# Enough steps for a stable p99, little enough memory per worker.
WINDOW = 256


@dataclass(frozen=True)
class StepTimeSummary:
    steps: int  # intervals in the window
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float


@dataclass(frozen=True)
class HangReport:
    key: str
    clock: int  # the clock that cannot complete
    waiting_for: tuple[str, ...]  # quorum members whose gradient for it has not come
    stalled_s: float  # since its first gradient arrived


class StepTimes:
    """Per worker, the last `WINDOW` intervals between pushes of clock c and c + 1.

    A gap of more than one clock (a worker that rejoined, or a restored server) is not a step time and
    is not recorded. Not thread-safe: the store calls it under its own lock.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}
        self._intervals: dict[str, deque[float]] = {}

    def record(self, worker: str, clock: int, now: float) -> None:
        last = self._last.get(worker)
        if last is not None and clock <= last[0]:
            return  # another slice of a step already timed
        if last is not None and clock == last[0] + 1:
            self._intervals.setdefault(worker, deque(maxlen=WINDOW)).append(now - last[1])
        self._last[worker] = (clock, now)

    def summary(self) -> dict[str, StepTimeSummary]:
        out = {}
        for worker, intervals in self._intervals.items():
            values = np.fromiter(intervals, dtype=np.float64, count=len(intervals))
            p50, p90, p99 = np.percentile(values, (50, 90, 99))
            out[worker] = StepTimeSummary(len(values), float(p50), float(p90), float(p99),
                                          float(values.max()))
        return out
