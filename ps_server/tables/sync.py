"""Sync mode of a sparse table: the pushes of one clock from every quorum member, applied as one update.

Like the dense parameters in sync mode (docs/architecture.md, 5 Consistency), clock c of a table is
applied once every worker of the quorum has pushed its gradients for c, as the mean over the
workers of their (already coalesced) row gradients, a row that a worker did not touch counting as
zero from it. Two workers on halves of a batch then make the update one worker makes on the whole
batch (union-batch equivalence). A pull at clock c sees clocks below c applied.

A worker pushes every clock, also when its batch touched no row of the table (an empty push), or
the clock never completes. A repeated push of a (worker, clock) is dropped, so retries are safe; a
push for a clock already applied is dropped too. A table starts at the first clock pushed to it,
so a job that resumes at clock 500 does not wait for clocks 0 to 499.

With replicas, the clocks are kept per row partition (`PartitionClocks`): a server serves one
partition until a failover gives it the dead primary's too, whose applied clock comes with the
replica's rows, and whose pending pushes the workers send again (docs/architecture.md, 9
Failures). A push is split by partition, an empty part counting as the worker's push for that
partition; a partition applies clock c once every quorum member pushed c to it, and a pull waits
only for the partitions of the ids it reads.

Pure: no asyncio, no grpc. ps_server.handlers.tables drives it.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

Update = tuple[np.ndarray, np.ndarray, int]  # distinct ids, mean gradients, clock


class SyncClocks:
    def __init__(self, applied: int | None = None) -> None:
        self.applied = applied  # clocks below it are applied; None: nothing pushed yet
        self._pending: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}

    def push(self, clock: int, worker: str, ids: np.ndarray, grads: np.ndarray,
             quorum: Collection[str]) -> list[Update]:
        """Record `worker`'s push of `clock`; the updates that became complete, in clock order."""
        if self.applied is None:
            self.applied = clock
        if clock < self.applied:
            return []
        parts = self._pending.setdefault(clock, {})
        if worker not in parts:
            parts[worker] = (ids.copy(), grads.copy())
        return self.ready(quorum)

    def ready(self, quorum: Collection[str]) -> list[Update]:
        """The complete clocks (also after the quorum shrank), applied in order; empty if none."""
        out: list[Update] = []
        while self.applied is not None and self.applied in self._pending:
            parts = self._pending[self.applied]
            if not quorum or not set(quorum) <= set(parts):
                break
            del self._pending[self.applied]
            members = [parts[w] for w in quorum]
            ids = np.concatenate([i for i, _ in members])
            unique, inverse = np.unique(ids, return_inverse=True)
            dim = members[0][1].shape[1]
            summed = np.zeros((len(unique), dim), members[0][1].dtype)
            np.add.at(summed, inverse, np.concatenate([g for _, g in members]))
            summed /= summed.dtype.type(len(members))
            out.append((unique, summed, self.applied))
            self.applied += 1
        return out

    def waiting_for(self, clock: int, quorum: Collection[str]) -> list[str]:
        """Quorum members whose push of `clock` has not arrived."""
        parts = self._pending.get(clock, {})
        return sorted(w for w in quorum if w not in parts)


# The partition key of a server that knows no layout yet: its own partition, whatever its number.
OWN = -1


class PartitionClocks:
    """A sync table's clocks per row partition (an id's partition: pshard.common.sparse.server_of)."""

    def __init__(self) -> None:
        self.parts: dict[int, SyncClocks] = {}

    def push(self, clock: int, worker: str, ids: np.ndarray, grads: np.ndarray, partition: int | np.ndarray,
             served: Collection[int], quorum: Collection[str]) -> list[Update]:
        """Record `worker`'s push of `clock` in every partition of `served`: the ids of each (their
        partitions: `partition`, one number when all are in one), none for the others. The updates
        that became complete."""
        out: list[Update] = []
        for p in sorted(served):
            if isinstance(partition, int):
                mine = ids if p == partition else ids[:0]
                part = (mine, grads if p == partition else grads[:0])
            else:
                mask = partition == p
                part = (ids[mask], grads[mask])
            out += self.parts.setdefault(p, SyncClocks()).push(clock, worker, *part, quorum)
        return out

    def ready(self, quorum: Collection[str]) -> list[Update]:
        return [u for p in sorted(self.parts) for u in self.parts[p].ready(quorum)]

    def behind(self, clock: int, partitions: Collection[int]) -> tuple[int, int] | None:
        """(partition, its applied clock) of one of `partitions` that has not applied every clock
        below `clock`; None: all have (a partition nothing was pushed to waits for nothing)."""
        for p in sorted(partitions):
            sync = self.parts.get(p)
            if sync is not None and sync.applied is not None and sync.applied < clock:
                return p, sync.applied
        return None

    def waiting_for(self, partition: int, clock: int, quorum: Collection[str]) -> list[str]:
        sync = self.parts.get(partition)
        return sorted(quorum) if sync is None else sync.waiting_for(clock, quorum)

    def applied(self) -> dict[int, int]:
        """Each partition's first clock not applied (those with a clock pushed to them)."""
        return {p: s.applied for p, s in self.parts.items() if s.applied is not None and p != OWN}

    def adopt(self, applied: dict[int, int]) -> None:
        """Serve these partitions from their replicated applied clock on (a failover moved them here):
        what their old primary held pending comes again from the workers."""
        for p, clock in applied.items():
            self.parts[p] = SyncClocks(clock)

    def number_own(self, partition: int) -> None:
        """The server learnt its own partition's number: the clocks kept as OWN are that partition's."""
        if OWN in self.parts and partition not in self.parts:
            self.parts[partition] = self.parts.pop(OWN)
