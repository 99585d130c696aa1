"""Which scheduled calls' pushes a sparse table has applied (pshard.coordinator). Pure: no I/O.

A function a ClusterCoordinator scheduled may run twice: its worker was cut off or died after a push
landed, and the call was re-dispatched to another worker. Its pushes carry the call's schedule id and
the push's number within the call, the same on every run, so a table applies each (schedule id, push
number) once, whichever worker sends it: the dense store's record (ps_server/core/store.py, `_repeated`)
for table rows. A call's pushes are waited for one at a time, so the last number applied says which
came before it. Ids below the coordinator's floor have finished: a push of one is a late repeat.
"""

from __future__ import annotations

# A table forgets the records of finished calls once it holds this many (as the dense store does).
KEPT = 1024


class ScheduledPushes:
    """One table's record on one server: schedule id -> the last push number applied."""

    def __init__(self) -> None:
        self.floor = 0  # every schedule id below it has finished on the coordinator
        self.last: dict[int, int] = {}

    def repeated(self, schedule: int, seq: int, floor: int) -> bool:
        """Whether push `seq` of call `schedule` was applied here already (or the call has finished);
        `floor`: the coordinator's, as the push carries it."""
        self.floor = max(self.floor, floor)
        return schedule < self.floor or seq <= self.last.get(schedule, -1)

    def record(self, schedule: int, seq: int) -> None:
        self.last[schedule] = seq
        if len(self.last) > KEPT:  # amortised: the record stays bounded by the calls in flight
            for finished in [s for s in self.last if s < self.floor]:
                del self.last[finished]
