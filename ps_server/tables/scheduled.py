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
server's table checkpoint (`state` / `load`) and a global checkpoint's part (`state`, with the count its
partitions are numbered under / `restore_part`).

A global checkpoint restores onto any partitioning, so a part's record is restored over the rows this
server took from it (`restored`: row ids and the record that holds for them; a partition's record for the
part's rows in that partition), not over partitions: each row is checked against the record of the part and
partition it came from. A row in no restored set was in no part, so no push the checkpoint holds reached
it. Folding the parts' records into one would drop a push that had reached only some servers when the
checkpoint was taken on the rows of the others. The restored records are dropped once the floor passes
every call they name (the first push of a coordinator launched again does). Until then they travel with
the rows they hold for: each replica batch carries the records over its own rows (`restored_over`), which
the backup, and an heir taking its replica over, hold (`hold_restored`). So a backup never holds a
restored row without its record, and a primary SIGKILLed after a restore leaves an heir that drops a
re-dispatched push the checkpoint holds. They also go into the server's next checkpoints (`state`, the
rows' ids as little-endian int64 in base64: compact, and nothing executable), its own table checkpoint's
and a global one's part, until their calls finish: a checkpoint taken after a restore and before the
re-dispatch, restored in its turn, holds for each row what the first one did (`load`: as saved;
`restore_part`: over the rows taken from the part).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from pshard.common.sparse import server_of

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
        # A global checkpoint's records, each over the rows restored from its part (and partition): sorted
        # ids, and schedule id -> the last push number applied to them.
        self.restored: list[tuple[np.ndarray, dict[int, int]]] = []

    def repeated(self, schedule: int, seq: int, floor: int, partition: int = ALL) -> bool:
        """Whether push `seq` of call `schedule` was applied to `partition`'s rows here already (or the call
        has finished); `floor`: the coordinator's, as the push carries it."""
        self.floor = max(self.floor, floor)
        return (schedule < self.floor or seq <= self.last.get(schedule, -1)
                or seq <= self.parts.get(partition, {}).get(schedule, -1))

    def fresh(self, schedule: int, seq: int, floor: int, partition: int | np.ndarray,
              ids: np.ndarray | None = None) -> np.ndarray | None:
        """Which rows of a push to apply, `partition` the row partition of each (one number: all of
        them), `ids` their ids: None, all; else a mask without the rows of the partitions that applied it
        already, and without the rows a restored global checkpoint holds it applied to."""
        if isinstance(partition, int):
            if self.repeated(schedule, seq, floor, partition):
                return np.zeros(0 if ids is None else len(ids), bool)
            done = None
        else:
            parts = [p for p in np.unique(partition).tolist() if self.repeated(schedule, seq, floor, p)]
            done = np.isin(partition, parts) if parts else None
        had = self._restored_had(schedule, seq, ids)
        if had is not None:
            done = had if done is None else done | had
        return None if done is None else ~done

    def _restored_had(self, schedule: int, seq: int, ids: np.ndarray | None) -> np.ndarray | None:
        """The rows of `ids` that a restored checkpoint holds push `seq` of `schedule` applied to."""
        self._forget_finished()
        if ids is None or schedule < self.floor:
            return None
        had = [rows for rows, kept in self.restored if kept.get(schedule, -1) >= seq]
        return np.isin(ids, np.concatenate(had)) if had else None

    def _forget_finished(self) -> None:
        if self.restored and all(max(kept) < self.floor for _, kept in self.restored):
            self.restored = []  # every call they name has finished: nothing of theirs can come again

    def restored_over(self, ids: np.ndarray) -> list[tuple[np.ndarray, dict[int, int]]]:
        """The restored records of the rows `ids` (a replica batch's): each record's rows among them,
        sorted. A backup holding a restored row must hold its record too, or as an heir it would apply
        a re-dispatched push the row had before the checkpoint a second time."""
        self._forget_finished()
        out = []
        ids = np.unique(np.asarray(ids, np.int64))
        for rows, kept in self.restored:
            mine = ids[_within(rows, ids)]  # by the (few) ids: a push's batch beside millions restored
            if len(mine):
                out.append((mine, dict(kept)))
        return out

    def hold_restored(self, records: list[tuple[np.ndarray, dict[int, int]]]) -> None:
        """Take restored records over rows (a replica's batch, or an heir's share of a dead primary's):
        rows under a record held already join it, so rows shipped again (after a push) add nothing."""
        self._forget_finished()  # a backup's too, once the primary's floor (`replace`) passed them
        for ids, kept in records:
            if not len(ids) or not kept or max(kept) < self.floor:
                continue
            at = next((i for i, (_, held) in enumerate(self.restored) if held == kept), None)
            ids = np.unique(np.asarray(ids, np.int64))
            if at is None:
                self.restored.append((ids, dict(kept)))
                continue
            rows = self.restored[at][0]
            new = ids[~_within(rows, ids)]  # rows shipped again after a push are held already
            if len(new):
                self.restored[at] = (np.union1d(rows, new), kept)

    def record(self, schedule: int, seq: int, partition: int | np.ndarray = ALL) -> None:
        """Push `seq` of call `schedule` was applied to the rows of `partition` (each of them)."""
        for p in [partition] if isinstance(partition, int) else np.unique(partition).tolist():
            kept = self.last if p == ALL else self.parts.setdefault(p, {})
            kept[schedule] = max(seq, kept.get(schedule, -1))
            if len(kept) > KEPT:  # amortised: the record stays bounded by the calls in flight
                for finished in [s for s in kept if s < self.floor]:
                    del kept[finished]

    def state(self, partition_count: int = 0) -> dict[str, Any]:
        """The record as json holds it (a checkpoint's table.json); keys: strings. `partition_count`: what
        its partitions are numbered under (a global checkpoint's part: restore_part needs it)."""
        state: dict[str, Any] = {"floor": self.floor, "last": _strings(self.last),
                                 "partitions": {str(p): _strings(kept) for p, kept in self.parts.items()}}
        self._forget_finished()
        if self.restored:  # held until their calls finish: a restore from this checkpoint needs them too
            state["restored"] = [{"ids": base64.b64encode(rows.astype("<i8").tobytes()).decode("ascii"),
                                  "calls": _strings(kept)} for rows, kept in self.restored]
        if partition_count:
            state["partition_count"] = partition_count
        return state

    def load(self, state: dict[str, Any] | None) -> None:
        """Fold a saved record of this server's own in (`state`: None from an older checkpoint, which has
        none; one without "partitions", from before records were kept per partition, applies to every
        partition)."""
        if not state:
            return
        parts = {int(p): _ints(kept) for p, kept in state.get("partitions", {}).items()}
        self.merge(int(state.get("floor", 0)), _ints(state.get("last", {})), parts)
        self.hold_restored(_saved_restored(state))

    def restore_part(self, state: dict[str, Any] | None, ids: np.ndarray) -> None:
        """A global checkpoint part's record (`state`: None from an older part), over the rows `ids` this
        server took from that part: its every-partition record holds for all of them, partition p's for
        those of them in partition p (numbered under the part's "partition_count"; a part without one
        but with partitions, from before it was saved, has its partitions' records fold over its rows)."""
        if not state:
            return
        self.floor = max(self.floor, int(state.get("floor", 0)))
        last = _ints(state.get("last", {}))
        parts = {int(p): _ints(kept) for p, kept in state.get("partitions", {}).items()}
        count = int(state.get("partition_count", 0))
        ids = np.unique(np.asarray(ids, np.int64))  # sorted
        if parts and count:
            of = server_of(ids, count)
            groups = [(ids[of == p], _larger(last, parts.get(p, {}))) for p in np.unique(of).tolist()]
        else:
            groups = [(ids, _larger(last, *parts.values()))]
        self.restored += [(rows, kept) for rows, kept in groups if len(rows) and kept]
        # What the part's server held from an earlier restore, for the rows of it taken here.
        self.hold_restored([(ids[_within(rows, ids)], kept) for rows, kept in _saved_restored(state)])

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


def _within(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which of `ids` are in `rows` (sorted): a binary search per id."""
    if not len(rows):
        return np.zeros(len(ids), bool)
    at = np.minimum(np.searchsorted(rows, ids), len(rows) - 1)
    return np.asarray(rows[at] == ids)


def _saved_restored(state: dict[str, Any]) -> list[tuple[np.ndarray, dict[int, int]]]:
    """The restored records a checkpoint saved (`state`'s "restored"; none in an older one), ids sorted."""
    return [(np.sort(np.frombuffer(base64.b64decode(saved["ids"], validate=True), "<i8").astype(np.int64)),
             _ints(saved["calls"])) for saved in state.get("restored", ())]


def _larger(*records: dict[int, int]) -> dict[int, int]:
    """Each call's larger push number over `records`."""
    out: dict[int, int] = {}
    for kept in records:
        for schedule, seq in kept.items():
            out[schedule] = max(seq, out.get(schedule, -1))
    return out


def _strings(kept: dict[int, int]) -> dict[str, int]:
    return {str(s): n for s, n in kept.items()}


def _ints(kept: dict[str, Any]) -> dict[int, int]:
    return {int(s): int(n) for s, n in kept.items()}
