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

Pure: no asyncio, no grpc. ps_server.table_handlers drives it.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

Update = tuple[np.ndarray, np.ndarray, int]  # distinct ids, mean gradients, clock


class SyncClocks:
    def __init__(self) -> None:
        self.applied: int | None = None  # clocks below it are applied; None: nothing pushed yet
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
