"""Which scheduled calls' pushes a sparse table has applied (pshard.coordinator). Pure: no I/O.

A function a ClusterCoordinator scheduled may run twice: its worker was cut off or died after a push
landed, and the call was re-dispatched to another worker. Its pushes carry the call's schedule id and
the push's number within the call, the same on every run, so a table applies each (schedule id, push
number) once, whichever worker sends it: the dense store's record (ps_server/core/store.py, `_repeated`)
for table rows. A call's pushes are waited for one at a time, so the last number applied says which
came before it. Ids below the coordinator's floor have finished: a push of one is a late repeat.

The record is the table's (SparseTable.scheduled), so it travels where the rows do: to the backups with
each batch (ps_server/replication/table_rows.py), into an heir on failover (`merge`), into the server's
table checkpoint and a global checkpoint's part (`state` / `load`). An heir or a restore folding two
servers' records keeps each call's larger push number: exact when a call's pushes reached both (the
common case, one push per table per call); a push that reached one server and not the other before it
died is dropped on the other's rows when re-dispatched (docs/guide/coordinator.md, "Not yet").
"""

from __future__ import annotations

from typing import Any

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

    def state(self) -> dict[str, Any]:
        """The record as json holds it (a checkpoint's table.json)."""
        return {"floor": self.floor, "last": {str(s): n for s, n in self.last.items()}}  # keys: strings

    def load(self, state: dict[str, Any] | None) -> None:
        """Fold a saved record in (`state`: None from an older checkpoint, which has none)."""
        if state:
            self.merge(int(state.get("floor", 0)), {int(s): int(n) for s, n in state.get("last", {}).items()})

    def merge(self, floor: int, last: dict[int, int]) -> None:
        """Fold another server's record in (an heir's, a restore's): each call's larger push number."""
        self.floor = max(self.floor, floor)
        for schedule, seq in last.items():
            self.last[schedule] = max(seq, self.last.get(schedule, -1))

    def replace(self, floor: int, last: dict[int, int]) -> None:
        """Hold a primary's record as it is (a backup's replica)."""
        self.floor, self.last = floor, dict(last)
