"""What a drain, a join and a partition move have in common for `pshard status` (issue 20): a start on the
scheduler's clock and an end once the hand-over is made, so that all report `done` and their seconds the
same way (and scheduler/history.py keeps them alike)."""

from __future__ import annotations


class Timed:
    """A mix-in for frozen dataclasses with `started: float` and `ended: float | None` (None: in progress)."""

    started: float
    ended: float | None

    @property
    def done(self) -> bool:
        return self.ended is not None

    def seconds(self, now: float) -> float:
        """From the start to the end, or to `now` while in progress."""
        return (self.ended if self.ended is not None else now) - self.started
