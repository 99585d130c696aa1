"""Small value types shared by the store, the client and the codec."""

from __future__ import annotations

from typing import NamedTuple


class SliceKey(NamedTuple):
    """One slice of one parameter: `part` numbers the contiguous pieces of a big tensor."""

    key: str
    part: int = 0

    def __str__(self) -> str:
        return f"{self.key}[{self.part}]" if self.part else self.key


class Stamp(NamedTuple):
    """Who sent a push or pull, from which incarnation, at which clock."""

    worker_id: str
    generation: int
    clock: int
    # The learning rate of this clock's update (a worker's LR scheduler); None = the job's optimizer.lr.
    lr: float | None = None
    # A scheduled call's pushes (pshard.coordinator): its schedule id (0: none), the push's number within
    # the call, and the coordinator's floor (every id below it finished). The store applies each
    # (schedule, seq, slice) once, whichever worker sends it.
    schedule: int = 0
    schedule_seq: int = 0
    schedule_floor: int = 0
