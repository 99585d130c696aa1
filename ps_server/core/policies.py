"""Consistency policies (docs/architecture.md, 5 Consistency) as types behind one small protocol.

The store owns the data, the locks, validation and at-most-once bookkeeping; a
policy only answers the questions where sync, async and bounded staleness differ:
is a push for this clock early, on time or late; what does an accepted gradient do
to the slice; is a pull at this clock ready, and if not, for whom is it waiting.

Every method is called with the slice's lock (`Slot.lock`) held, so a policy never locks.

Clocks: a worker's clock is the number of steps it has pushed. A push is stamped
with the clock of the step it belongs to (0, 1, 2, ...); a worker at clock c
pulls before computing step c.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pshard.common.chunks import ChunkPool, shared_pool
from pshard.common.errors import FutureClockError
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey
from pshard.ps_server.core import chunked
from pshard.ps_server.core.optimizers import Optimizer, SliceState, at_lr, fold_scale

NO_CLOCK = -1  # "has pushed nothing yet": clock 0 is then the next one


@dataclass
class Aggregate:
    """Sync mode: the gradients of the pending clock (always the slice's version), summed.

    The sum is kept in the master dtype (float32 for float16/float32 slices, float64
    for float64), as torch's DDP all-reduce does: half the memory of a float64 sum,
    and the mean of W gradients differs from a float64 mean only in the last bits
    (summation order follows arrival order). The buffer is kept between clocks so a
    4 MiB slice does not allocate (and page-fault) a new one every step.
    """

    total: np.ndarray | None = None
    contributors: set[str] = field(default_factory=set)


@dataclass
class Slot:
    """One slice: its value and everything the policies and at-most-once need about it."""

    key: SliceKey
    dtype: np.dtype  # as declared and as returned by reads
    value: np.ndarray  # master copy, updated in place: float32 for float16 slices
    optimizer: Optimizer
    opt_state: SliceState
    version: int = 0
    # worker -> last clock it pushed to this slice (duplicates are clocks <= this).
    last_clock: dict[str, int] = field(default_factory=dict)
    max_clock: int = NO_CLOCK  # largest clock pushed here by anyone
    # Scheduled calls (pshard.coordinator): schedule id -> last push number applied here, whichever
    # worker ran it; a re-dispatched call's repeats are duplicates. Ids below the floor are forgotten.
    scheduled: dict[int, int] = field(default_factory=dict)
    aggregate: Aggregate = field(default_factory=Aggregate)  # sync only
    # SSP only: worker -> clock it joined the quorum at; it is not waited for below it.
    floors: dict[str, int] = field(default_factory=dict)
    # Restored from a checkpoint and not yet caught up with the clock the workers are at.
    behind: bool = False
    # The learning rate of the step being gathered or applied, from the pushes' stamps (a worker's LR
    # scheduler); None = the job's optimizer.lr. Sync: every push of a clock carries the same one.
    step_lr: float | None = None
    # Replication (ps_server/replication/dense.py): told, before each optimizer step, what the step applies
    # (the gradient, or a sum and how many gradients it holds), so backups can take the same step.
    on_step: Callable[[Slot, np.ndarray, int], None] | None = field(default=None, repr=False, compare=False)
    # Taken by the store around every policy call: one update at a time per slice,
    # while different slices update in parallel (numpy releases the GIL on big arrays).
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # The threads a step of this slice is split over (its element-wise operations, so the same bits).
    pool: ChunkPool = field(default_factory=shared_pool, repr=False, compare=False)

    def apply(self, grad: np.ndarray) -> None:
        """One optimizer step. `grad` is only read, never kept, so it may be a read-only network buffer."""
        if self.on_step is not None:
            self.on_step(self, grad, 1)
        self._step(grad)

    def _step(self, grad: np.ndarray) -> None:
        if grad.dtype != self.value.dtype:
            grad = grad.astype(self.value.dtype)  # float16 off the wire: optimizers work in master precision
        # Unscheduled (step_lr None, the common case) steps with the job's optimizer without asking at_lr.
        optimizer = self.optimizer if self.step_lr is None else at_lr(self.optimizer, self.step_lr)
        chunked.step(self.pool, optimizer, self.value, grad, self.opt_state)
        self.version += 1
        self.behind = False  # a restored slice is back in step once it applies an update

    def apply_mean(self, total: np.ndarray, count: int) -> None:
        """One optimizer step with total / count; `total` is scratch the step may overwrite."""
        if count <= 1:
            self.apply(total)
            return
        if self.on_step is not None:
            self.on_step(self, total, count)
        optimizer = self.optimizer if self.step_lr is None else at_lr(self.optimizer, self.step_lr)
        if total.dtype == self.value.dtype and fold_scale(optimizer):
            chunked.step_scaled(self.pool, optimizer, self.value, total, 1.0 / count)  # type: ignore[arg-type]
            self.version += 1
            self.behind = False
            return
        chunked.divide(self.pool, total, count)
        self._step(total)

    def progress(self, worker: str) -> int:
        """The last clock `worker` counts as having pushed here, for SSP waiting."""
        return max(self.last_clock.get(worker, NO_CLOCK), self.floors.get(worker, NO_CLOCK))


@dataclass(frozen=True)
class Roster:
    """Who takes part. `quorum` None = not known yet (no membership from the scheduler)."""

    quorum: frozenset[str] | None
    seen: frozenset[str]  # every worker whose stamp the store accepted

    def expected(self) -> frozenset[str]:
        return self.quorum if self.quorum is not None else self.seen


class ConsistencyPolicy(Protocol):
    name: str

    def admit_push(self, slot: Slot, clock: int) -> bool:
        """True to accept a (non-duplicate) push for `clock`, False if it is late; raise if early."""
        ...

    def accept(self, slot: Slot, worker: str, clock: int, grad: np.ndarray, roster: Roster) -> None:
        """Apply or accumulate an admitted gradient. Must not keep a reference to `grad`."""
        ...

    def check_pull(self, slot: Slot, clock: int) -> None:
        """FutureClockError if a pull at `clock` could never be answered in order."""
        ...

    def waiting_for(self, slot: Slot, clock: int, roster: Roster) -> tuple[frozenset[str], int] | None:
        """None if a pull at `clock` is ready, else (the workers, the clock they have yet to push)."""
        ...

    def on_roster_change(self, slot: Slot, old: Roster, new: Roster) -> None:
        """Membership changed: release whatever no longer needs to wait."""
        ...

    def catch_up(self, slot: Slot, clock: int) -> None:
        """A slice restored from a checkpoint meets the clock the workers have reached: move its
        clocks (and, in sync mode, its version) up to it. The updates made after the checkpoint
        are lost, as when a TensorFlow parameter server restarts from its last checkpoint."""
        ...


def _future(slot: Slot, what: str, clock: int, reached: str) -> FutureClockError:
    return FutureClockError(f"key {str(slot.key)!r}: {what} at clock {clock}, but {reached}")


class _AppliesAtOnce:
    """What async and SSP share: every push is applied on arrival, one at a time per slice."""

    def admit_push(self, slot: Slot, clock: int) -> bool:
        self.check_clock(slot, "push", clock)
        return True

    def accept(self, slot: Slot, worker: str, clock: int, grad: np.ndarray, roster: Roster) -> None:
        slot.apply(grad)

    def check_pull(self, slot: Slot, clock: int) -> None:
        self.check_clock(slot, "pull", clock)

    def catch_up(self, slot: Slot, clock: int) -> None:
        slot.max_clock = max(slot.max_clock, clock - 1)

    @staticmethod
    def check_clock(slot: Slot, what: str, clock: int) -> None:
        # Nobody can be more than one clock past the furthest push: that push is the step before it.
        if clock > slot.max_clock + 1:
            raise _future(slot, what, clock, f"the largest clock pushed there is {slot.max_clock}")


class AsyncPolicy(_AppliesAtOnce):
    name = "async"

    def waiting_for(self, slot: Slot, clock: int, roster: Roster) -> tuple[frozenset[str], int] | None:
        return None

    def on_roster_change(self, slot: Slot, old: Roster, new: Roster) -> None:
        pass


class BoundedStalenessPolicy(_AppliesAtOnce):
    """SSP: a read at clock c waits until every live worker has pushed clock c - s - 1."""

    name = "ssp"

    def __init__(self, staleness: int) -> None:
        if staleness < 0:
            raise ValueError(f"staleness: got {staleness}, expected >= 0")
        self.staleness = staleness

    def waiting_for(self, slot: Slot, clock: int, roster: Roster) -> tuple[frozenset[str], int] | None:
        needed = clock - self.staleness - 1
        if needed < 0:
            return None
        behind = frozenset(w for w in roster.expected() if slot.progress(w) < needed)
        return (behind, needed) if behind else None

    def on_roster_change(self, slot: Slot, old: Roster, new: Roster) -> None:
        # A worker that joins mid-run is expected from the slowest continuing worker's clock on:
        # otherwise everybody would wait for it to replay every clock since 0. Its own pushes for
        # earlier clocks are still applied (staleness is the point of SSP), just not waited for.
        if new.quorum is None:
            return
        staying = new.quorum & old.expected()
        if not staying:
            return  # the first quorum, or everybody replaced: nobody has a clock to start from
        start = min(slot.progress(w) for w in staying)
        for worker in new.quorum - old.expected():
            if slot.progress(worker) < start:
                slot.floors[worker] = start


class SyncPolicy:
    """BSP: per slice, the gradients of clock v (= version) are averaged and applied once.

    The aggregate completes when `quorum size - backup_workers` (at least 1) members of
    the current quorum have contributed; the mean also counts gradients of workers
    that left the quorum after contributing. Without a known quorum nothing completes:
    gradients accumulate until `set_quorum` says whom to wait for.
    """

    name = "sync"

    def __init__(self, backup_workers: int = 0) -> None:
        if backup_workers < 0:
            raise ValueError(f"backup_workers: got {backup_workers}, expected >= 0")
        self.backup_workers = backup_workers

    def admit_push(self, slot: Slot, clock: int) -> bool:
        if clock > slot.version:
            raise _future(slot, "push", clock,
                          f"version is {slot.version}: clock {slot.version} has not completed yet")
        return clock == slot.version  # below: that clock was completed without this worker

    def accept(self, slot: Slot, worker: str, clock: int, grad: np.ndarray, roster: Roster) -> None:
        agg = slot.aggregate
        if not agg.contributors and self._complete({worker}, roster):
            slot.apply(grad)  # one contribution is enough (single worker, or backups): no copy
            return
        if agg.total is None:
            agg.total = np.empty_like(slot.value)
        # No zeroing pass: the clock's first gradient is copied in.
        chunked.accumulate(slot.pool, agg.total, grad, first=not agg.contributors)
        agg.contributors.add(worker)
        self._apply_if_complete(slot, roster)

    def catch_up(self, slot: Slot, clock: int) -> None:
        if clock > slot.version:
            slot.version = clock
            slot.aggregate.contributors.clear()
        slot.max_clock = max(slot.max_clock, clock - 1)

    def check_pull(self, slot: Slot, clock: int) -> None:
        if clock > slot.version + 1:
            raise _future(slot, "pull", clock,
                          f"version is {slot.version}: only clock {slot.version + 1} can be waited for")

    def waiting_for(self, slot: Slot, clock: int, roster: Roster) -> tuple[frozenset[str], int] | None:
        if slot.version >= clock:
            return None
        missing = (roster.quorum or frozenset()) - slot.aggregate.contributors
        return missing, slot.version

    def on_roster_change(self, slot: Slot, old: Roster, new: Roster) -> None:
        self._apply_if_complete(slot, new)

    def _complete(self, contributors: set[str], roster: Roster) -> bool:
        if not roster.quorum:
            return False
        needed = max(1, len(roster.quorum) - self.backup_workers)
        return len(contributors & roster.quorum) >= needed

    def _apply_if_complete(self, slot: Slot, roster: Roster) -> None:
        agg = slot.aggregate
        if not agg.contributors or not self._complete(agg.contributors, roster):
            return
        assert agg.total is not None
        slot.apply_mean(agg.total, len(agg.contributors))
        agg.contributors.clear()


def make_policy(config: JobConfig) -> ConsistencyPolicy:
    makers: dict[str, Callable[[], ConsistencyPolicy]] = {
        "sync": lambda: SyncPolicy(config.backup_workers),
        "async": AsyncPolicy,
        "ssp": lambda: BoundedStalenessPolicy(config.staleness),
    }
    return makers[config.mode]()
