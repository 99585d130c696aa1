"""Which scheduled calls' pushes a sparse table has applied (pshard.coordinator). Pure: no I/O.

A function a ClusterCoordinator scheduled may run twice: its worker was cut off or died after a push
landed, and the call was re-dispatched to another worker. Its pushes carry the call's schedule id and
the push's number within the call, the same on every run, so a table applies each (schedule id, push
number) once, whichever worker sends it: the dense store's record (ps_server/core/store.py, `_repeated`)
for table rows. A call's pushes are waited for one at a time, so the last number applied says which
came before it. Ids below the coordinator's floor have finished: a push of one is a late repeat.

The record is kept per row partition, as the push-key log is (ps_server/replication/tables.py, `fresh`):
a call's push may reach one server and not another before one of them dies, so the heir, serving both
partitions, must apply the re-dispatch to the rows of the partition that never had it and only to those.
A record without a partition (`last`: written before the server knew its layout, or by an older
checkpoint) applies to every partition. The record is the table's (SparseTable.scheduled), so it travels
where the rows do: to the backups with each batch (ps_server/replication/table_rows.py), into an heir on
failover (`merge`: partitions differ between servers, so nothing is folded across them), into the
server's table checkpoint and a global checkpoint's part (`state` / `load`; a global checkpoint restores
onto any partitioning, so its records are folded over partitions: docs/guide/coordinator.md, "Not yet").
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The record that applies to every partition (ps_server.tables.sync.OWN: no layout known yet).
ALL = -1

# A table forgets the records of finished calls once it holds this many (as the dense store does).
KEPT = 1024


class ScheduledPushes:
    """One table's record on one server: per row partition, schedule id -> the last push number applied."""

    def __init__(self) -> None:
        self.floor = 0  # every schedule id below it has finished on the coordinator
        self.last: dict[int, int] = {}  # every partition's (ALL)
        self.parts: dict[int, dict[int, int]] = {}  # partition -> its own

    def repeated(self, schedule: int, seq: int, floor: int, partition: int = ALL) -> bool:
        """Whether push `seq` of call `schedule` was applied to `partition`'s rows here already (or the call
        has finished); `floor`: the coordinator's, as the push carries it."""
        self.floor = max(self.floor, floor)
        return (schedule < self.floor or seq <= self.last.get(schedule, -1)
                or seq <= self.parts.get(partition, {}).get(schedule, -1))

    def fresh(self, schedule: int, seq: int, floor: int, partition: int | np.ndarray) -> np.ndarray | None:
        """Which rows of a push to apply, `partition` the row partition of each (one number: all of
        them): None, all; else a mask without the rows of the partitions that applied it already."""
        if isinstance(partition, int):
            return np.zeros(0, bool) if self.repeated(schedule, seq, floor, partition) else None
        done = [p for p in np.unique(partition).tolist() if self.repeated(schedule, seq, floor, p)]
        return ~np.isin(partition, done) if done else None

    def record(self, schedule: int, seq: int, partition: int | np.ndarray = ALL) -> None:
        """Push `seq` of call `schedule` was applied to the rows of `partition` (each of them)."""
        for p in [partition] if isinstance(partition, int) else np.unique(partition).tolist():
            kept = self.last if p == ALL else self.parts.setdefault(p, {})
            kept[schedule] = max(seq, kept.get(schedule, -1))
            if len(kept) > KEPT:  # amortised: the record stays bounded by the calls in flight
                for finished in [s for s in kept if s < self.floor]:
                    del kept[finished]

    def state(self) -> dict[str, Any]:
        """The record as json holds it (a checkpoint's table.json); keys: strings."""
        return {"floor": self.floor, "last": _strings(self.last),
                "partitions": {str(p): _strings(kept) for p, kept in self.parts.items()}}

    def load(self, state: dict[str, Any] | None, partitioned: bool = True) -> None:
        """Fold a saved record in (`state`: None from an older checkpoint, which has none; one without
        "partitions", from before records were kept per partition, applies to every partition).
        `partitioned`: False when the saved partitions may not be this cluster's (a global checkpoint
        restores onto any partitioning): each call's larger push number then applies to every partition,
        which drops a push that reached one partition only (rather than apply any twice)."""
        if not state:
            return
        parts = {int(p): _ints(kept) for p, kept in state.get("partitions", {}).items()}
        last = _ints(state.get("last", {}))
        if not partitioned:
            for kept in parts.values():
                for schedule, seq in kept.items():
                    last[schedule] = max(seq, last.get(schedule, -1))
            parts = {}
        self.merge(int(state.get("floor", 0)), last, parts)

    def merge(self, floor: int, last: dict[int, int], parts: dict[int, dict[int, int]] | None = None) -> None:
        """Fold another server's record in (an heir's, a restore's). Its partitions are not this
        server's, so each keeps its own record; only the all-partition ones meet (each call's larger)."""
        self.floor = max(self.floor, floor)
        for p, kept in [(ALL, last), *(parts or {}).items()]:
            into = self.last if p == ALL else self.parts.setdefault(p, {})
            for schedule, seq in kept.items():
                into[schedule] = max(seq, into.get(schedule, -1))

    def replace(self, floor: int, last: dict[int, int],
                parts: dict[int, dict[int, int]] | None = None) -> None:
        """Hold a primary's record as it is (a backup's replica)."""
        self.floor, self.last = floor, dict(last)
        self.parts = {p: dict(kept) for p, kept in (parts or {}).items()}


def _strings(kept: dict[int, int]) -> dict[str, int]:
    return {str(s): n for s, n in kept.items()}


def _ints(kept: dict[str, Any]) -> dict[int, int]:
    return {int(s): int(n) for s, n in kept.items()}
