"""The shard store: a parameter server's slices, their optimizer state and clocks.

Pure core (docs/architecture.md, 1 Layers): no grpc, no environment, no I/O. The request
handlers drive it from an asyncio loop, tests drive it from threads.

The store is the one holder of the slices' specs (declared dtype and shape) and the one place
that validates requests against them. Validation before mutation: every request is checked
completely (keys, shapes, dtypes, stamp, clocks) before anything changes, so a refused request
leaves the store byte-for-byte as it was. `check_request` validates a whole push-and-pull (the
pull part too: a push never lands when its request's pull is refused), `check_push`/`check_declare`
a request's metadata alone, for transports that must refuse a stream before its data arrives.
Reads never move a worker's fencing stamp: only writes from live members do.

At most once. Per slice and worker the store keeps the last clock pushed; a push
for a clock at or below it is a duplicate (a retry) and is dropped. A worker's
pushes to one slice therefore go in clock order, as its steps do. Every dropped
gradient counts in `pushes_dropped`; those of a clock that completed without them
(sync) also count in `late_gradients_dropped`.

Locking. Each slice has its own lock (`Slot.lock`): one update at a time per slice,
different slices in parallel. A request takes the locks of all its slices in key
order (so two requests cannot deadlock), then `_meta` briefly for the store-wide
tables (membership, generations, counters). `_meta` is never held while taking a
slice lock. Waiters are woken after the locks are released.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, TypeVar

import numpy as np
from pshard.common.chunks import ChunkPool, shared_pool
from pshard.common.compression import payload_k
from pshard.common.errors import (
    DTypeMismatchError,
    EmptyRequestError,
    InvalidArgumentError,
    LayoutConflictError,
    ShapeMismatchError,
    StaleGenerationError,
    UnknownKeyError,
    quote,
)
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire.dtypes import DTYPES, PARAM_DTYPES
from pshard.ps_server.core.optimizers import Optimizer, SliceState, make_optimizer
from pshard.ps_server.core.policies import NO_CLOCK, Aggregate, ConsistencyPolicy, Roster, Slot, make_policy
from pshard.ps_server.core.steptimes import HangReport, StepTimes, StepTimeSummary

# A slice forgets the records of finished scheduled calls once it holds this many (pshard.coordinator).
_SCHEDULED_KEPT = 256
# Slices hold floating point values only: gradients of anything else mean nothing.
FLOAT_DTYPE_NAMES = PARAM_DTYPES
_FLOAT_DTYPES = {np.dtype(name): name for name in FLOAT_DTYPE_NAMES}
# float16 slices are updated in a float32 master copy, as mixed-precision training does:
# small updates would otherwise round away to nothing.
_MASTER = {d.numpy: DTYPES[d.master].numpy for d in DTYPES.values() if d.master}

T = TypeVar("T")


class SliceMeta(NamedTuple):
    """What a request says about one slice before its data: key, logical dtype name, shape."""

    key: SliceKey
    dtype: str  # "bfloat16" included: its numpy arrays are uint16
    shape: tuple[int, ...]
    # A packed gradient's compressor ("topk", "randomk", "sign"): then dtype is uint8 and shape its bytes.
    encoding: str = ""


class SliceSpec(NamedTuple):  # a tuple: made several times per request, where a dataclass costs µs
    """A declared slice: its dtype as declared (float16 slices keep a float32 master) and shape."""

    dtype: str
    shape: tuple[int, ...]


def dtype_name(dtype: np.dtype) -> str:
    """numpy computes `dtype.name` in Python on every access (microseconds, several per request):
    the store's own dtypes are looked up instead."""
    return _FLOAT_DTYPES.get(dtype) or dtype.name


def unknown_key_error(key: SliceKey, held: int, replicated: bool = False) -> UnknownKeyError:
    held_text = (f"{held} slices are" if held else
                 # With replicas the usual way here is a server restarted at a dead primary's address
                 # before the scheduler published the failover: the sender re-routes on the new layout.
                 "it holds none yet: restarted, it rejoins as a backup; the request's layout predates "
                 "the failover" if replicated else
                 # Without: a server restarted with nothing to restore.
                 "it holds none: restarted without a checkpoint? see --checkpoint-dir")
    return UnknownKeyError(f"slice {str(key)!r} is not declared on this server ({held_text})")


@dataclass(frozen=True)
class PushOutcome:
    applied: int  # gradients accepted: applied at once, or (sync) added to the pending clock
    dropped: int  # duplicates of an accepted (worker, clock, slice), and late gradients


@dataclass(frozen=True)
class Waiting:
    """Why a pull is not ready: `workers` have yet to push `clock` of `keys`."""

    workers: tuple[str, ...]
    clock: int
    keys: tuple[SliceKey, ...]

    def __str__(self) -> str:
        keys = [str(k) for k in self.keys]
        if not self.workers:
            return f"waiting for clock {self.clock} of {keys}, but no quorum is known yet"
        return f"waiting for workers {list(self.workers)} to push clock {self.clock} of {keys}"


@dataclass(frozen=True)
class StoreStats:
    slices: int
    bytes_stored: int  # of the values as held (float16 slices count their float32 master copy)
    pushes_applied: int
    pushes_dropped: int  # every dropped gradient, late ones included
    late_gradients_dropped: int
    quorum: tuple[str, ...]  # live workers, sorted; empty when not known
    worker_clocks: dict[str, int]  # worker -> last clock it pushed (to any slice)
    min_version: int
    max_version: int
    nonfinite_dropped: int = 0
    # Measured, not state: a restored store starts timing afresh, hence no part of equality.
    step_times: dict[str, StepTimeSummary] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class SliceSnapshot:
    key: SliceKey
    dtype: str  # declared dtype
    value: np.ndarray  # master copy (float32 for float16 slices), so a restore loses no precision
    version: int
    opt_state: SliceState
    clocks: dict[str, int]  # worker -> last clock pushed to this slice
    floors: dict[str, int]  # SSP join clocks
    pending: np.ndarray | None  # sync: sum of the gradients of clock `version` received so far
    contributors: tuple[str, ...]  # sync: who those gradients came from
    # Scheduled calls (pshard.coordinator): schedule id -> last push number applied (Slot.scheduled).
    scheduled: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardSnapshot:
    config: JobConfig
    slices: tuple[SliceSnapshot, ...]
    generations: dict[str, int]  # worker -> highest generation seen
    quorum: dict[str, int] | None
    seen: tuple[str, ...]
    counters: dict[str, int] = field(default_factory=dict)
    schedule_floor: int = 0  # the coordinators' floor: every scheduled call below it has finished


def _copy_state(state: SliceState) -> SliceState:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in state.items()}


class ShardStore:
    def __init__(self, config: JobConfig, *, quorum: Mapping[str, int] | None = None,
                 optimizer: Optimizer | None = None, now: Callable[[], float] = time.monotonic,
                 pool: ChunkPool | None = None) -> None:
        """`quorum`: worker id -> generation of the live workers; None or empty = not known yet.

        `optimizer` overrides `make_optimizer(config.optimizer)` (tests inject instrumented ones);
        `now` is the clock of the step-time and hang reports; `pool` the threads a slice's update is
        split over (None: the process's, pshard.common.chunks.shared_pool).
        """
        self.config = config
        self._pool = pool if pool is not None else shared_pool()
        self.policy: ConsistencyPolicy = make_policy(config)
        self._optimizer = optimizer if optimizer is not None else make_optimizer(config.optimizer)
        self._averaged = frozenset(config.averaged)
        self._scheduled = False  # whether a push ever carried its own lr (a slice's step_lr is not None)
        self._averaging = make_optimizer(replace(config.optimizer, name="aggregate"))
        self._meta = threading.Lock()
        self._quorum_change = threading.Lock()  # one set_quorum at a time: re-checks see old -> new in order
        self._subscribers: list[Callable[[], None]] = []
        self._slots: dict[SliceKey, Slot] = {}
        self._generations: dict[str, int] = {}
        self._quorum: dict[str, int] | None = None
        self._seen: set[str] = set()
        self._roster = Roster(None, frozenset())
        self.had_quorum = False  # whether any quorum was ever known (set_quorum, or `quorum` here)
        self._worker_clocks: dict[str, int] = {}
        # The coordinators' schedule floor: every scheduled call below it has finished (pshard.coordinator).
        self._schedule_floor = 0
        self._counters = {"pushes_applied": 0, "pushes_dropped": 0, "late_gradients_dropped": 0,
                          "nonfinite_dropped": 0}
        self._now = now
        self._step_times = StepTimes()
        # Sync: key -> (clock, when its first gradient came), for the hang report.
        self._clock_started: dict[SliceKey, tuple[int, float]] = {}
        self._on_step: Callable[[Slot, np.ndarray, int], None] | None = None  # replication
        if quorum:
            self._install_quorum(quorum)

    # ---- declaring ----

    def declare(self, items: Sequence[tuple[SliceKey, np.ndarray]]) -> list[bool]:
        """Create missing slices with copies of the values; per item, True if this call created it.

        An existing slice keeps its value (the first declaration wins) but must agree on dtype and shape.
        """
        with self._meta:
            created = self._check_declare([SliceMeta(k, dtype_name(v.dtype), v.shape) for k, v in items])
            for (key, value), new in zip(items, created, strict=True):
                if new:
                    self._slots[key] = self._new_slot(key, value)
        return created

    def check_declare(self, metas: Sequence[SliceMeta]) -> list[bool]:
        """Validate a declaration without its values; per item, True if declare() would create it."""
        with self._meta:
            return self._check_declare(metas)

    def _check_declare(self, metas: Sequence[SliceMeta]) -> list[bool]:
        if not metas:
            raise EmptyRequestError("declare: no slices")
        known = {k: SliceSpec(dtype_name(s.dtype), s.value.shape) for k, s in self._slots.items()}
        created: list[bool] = []
        for key, dtype, shape, _ in metas:
            if dtype not in FLOAT_DTYPE_NAMES:
                raise DTypeMismatchError(
                    f"key {str(key)!r}: got dtype {dtype}, the store holds {', '.join(FLOAT_DTYPE_NAMES)} "
                    "(declare bfloat16 models as float32 and set wire_dtype=bfloat16)")
            have = known.get(key)
            if have is not None:
                if tuple(shape) != have.shape:
                    raise ShapeMismatchError(
                        f"key {str(key)!r}: declared with shape {tuple(shape)}, store has {have.shape}")
                if dtype != have.dtype:
                    raise DTypeMismatchError(
                        f"key {str(key)!r}: declared with dtype {dtype}, store has {have.dtype}")
                created.append(False)
            else:
                known[key] = SliceSpec(dtype, tuple(shape))
                created.append(True)
        return created

    def specs(self, keys: Sequence[SliceKey]) -> list[SliceSpec]:
        """The declared dtype and shape of each key; UnknownKeyError for the first undeclared one."""
        return [SliceSpec(dtype_name(slot.dtype), slot.value.shape) for slot in self._lookup(keys)]

    def _new_slot(self, key: SliceKey, value: np.ndarray) -> Slot:
        dtype = np.dtype(value.dtype.name)
        master = np.array(value, dtype=_MASTER.get(dtype, dtype), order="C", copy=True)
        optimizer = self._optimizer_for(key)
        return Slot(key=key, dtype=dtype, value=master, optimizer=optimizer,
                    opt_state=optimizer.init_state(master), on_step=self._on_step, pool=self._pool)

    def average(self, keys: Iterable[str]) -> None:
        """Also average the pushes of `keys` (model buffers, JobConfig.averaged): what a server configured
        from its own flags, which name no buffers, learns from the first trainer that declares them. A
        key already declared keeps the optimizer it was declared with, so it cannot change here."""
        new = [k for k in keys if k not in self._averaged]
        with self._meta:
            held = sorted({s.key for s in self._slots if s.key in new})
            if held:
                raise LayoutConflictError(
                    f"averaged: key {quote(held[0])} is declared already with the job's optimizer "
                    f"{self.config.optimizer.name!r}; declare the buffers before training starts, on every "
                    "worker alike")
            self._averaged = self._averaged | frozenset(new)
            self.config = replace(self.config, averaged=(*self.config.averaged, *new))

    def _optimizer_for(self, key: SliceKey) -> Optimizer:
        """The job's optimizer, or, for a key the job averages (a model buffer), the mean of the pushes."""
        return self._averaging if key.key in self._averaged else self._optimizer

    # ---- replication (ps_server/replication/dense.py) ----

    def set_step_hook(self, hook: Callable[[Slot, np.ndarray, int], None] | None) -> None:
        """Call `hook(slot, update, count)` under the slice's lock before every optimizer step."""
        with self._meta:
            self._on_step = hook
            slots = list(self._slots.values())
        for slot in slots:
            with slot.lock:
                slot.on_step = hook

    def slots(self) -> list[Slot]:
        """Every slice, in key order (the replication layer reads them under their own locks)."""
        with self._meta:
            return sorted(self._slots.values(), key=lambda s: s.key)

    def holds(self, key: SliceKey) -> bool:
        with self._meta:
            return key in self._slots

    def find(self, keys: Iterable[SliceKey]) -> dict[SliceKey, Slot]:
        """The slices of `keys` held here (replication ships a batch of them: no sort of every slice)."""
        with self._meta:
            return {k: self._slots[k] for k in keys if k in self._slots}

    def adopt(self, slots: Sequence[Slot]) -> None:
        """Take over slices a backup held (a failover promoted this server to their primary).

        They keep their value, optimizer state, version and per-worker clocks; a sync clock in
        progress starts again empty (the workers resend their pushes of it, docs/architecture.md, 9).
        """
        with self._meta:
            for slot in slots:
                if slot.key in self._slots:
                    raise InvalidArgumentError(f"adopt: slice {str(slot.key)!r} is already held here")
            for slot in slots:
                slot.optimizer = self._optimizer_for(slot.key)
                slot.on_step = self._on_step
                slot.pool = self._pool
                slot.aggregate = Aggregate()
                if self.config.mode == "sync":
                    # A copy taken while a clock was in progress (a joiner's catch-up state) counts the
                    # pushes of it that waited in the primary's aggregate, which is not copied: their
                    # resends must be taken here, not dropped as duplicates (completed clocks still are).
                    slot.last_clock = {w: min(c, slot.version - 1) for w, c in slot.last_clock.items()}
                self._slots[slot.key] = slot
                for worker, clock in slot.last_clock.items():
                    self._worker_clocks[worker] = max(self._worker_clocks.get(worker, NO_CLOCK), clock)
        self._notify()

    def release(self, keys: Iterable[SliceKey]) -> int:
        """Drop the slices of `keys` held here (a failover moved them away while this server was cut off:
        it keeps a copy of them as a backup instead). Returns how many were held."""
        with self._meta:
            dropped = [self._slots.pop(k) for k in list(keys) if k in self._slots]
        if dropped:
            self._notify()
        return len(dropped)

    # ---- pushing ----

    def push(self, stamp: Stamp, grads: Mapping[SliceKey, np.ndarray]) -> PushOutcome:
        """Apply (or, in sync mode, accumulate) gradients for `stamp.clock`; each (worker, clock, slice) once.

        The arrays are only read during the call (they may be read-only views of network buffers).
        """
        worker, clock = stamp.worker_id, stamp.clock
        if not grads:
            raise EmptyRequestError(f"push from worker {worker!r} at clock {clock}: no gradients")
        if stamp.lr == self.config.optimizer.lr:
            stamp = stamp._replace(lr=None)  # the job's own lr, said out loud: the same step as unstamped
        slots = self._lookup(grads)
        for slot, grad in zip(slots, grads.values(), strict=True):
            if grad.dtype != slot.dtype or grad.shape != slot.value.shape:
                self._check_push_meta(slot, dtype_name(grad.dtype), grad.shape)
        poisoned = self._check_finite(worker, clock, grads)
        with self._locked(slots):
            with self._meta:
                self._check_stamp(stamp)
            for slot in slots:
                # Until a restored slice has applied a step of its own, the newest clock pushed to it
                # is where the workers are: after a crash they may be a clock apart (one retrying the
                # step whose reply it lost), and the slice must follow the faster one.
                if slot.behind:
                    self.policy.catch_up(slot, clock)
            # None = duplicate, False = late, True = accept; FutureClockError leaves everything as it was.
            # A scheduled push's clock means nothing (its call may run on any worker): its record decides.
            verdicts = [None if self._repeated(slot, stamp) else True if stamp.schedule
                        else self.policy.admit_push(slot, clock) for slot in slots]
            if stamp.lr is not None or self._scheduled:  # else every slice's step_lr is None too
                self._check_step_lr(stamp, slots, verdicts)
            with self._meta:
                self._record_stamp(stamp)
                roster = self._roster
            applied = late = skipped = 0
            for slot, grad, verdict in zip(slots, grads.values(), verdicts, strict=True):
                if verdict is None:
                    continue
                if verdict:
                    slot.step_lr = stamp.lr
                    self._scheduled = self._scheduled or stamp.lr is not None
                if stamp.schedule:
                    self._record_scheduled(slot, stamp)
                else:
                    slot.last_clock[worker] = clock
                slot.max_clock = max(slot.max_clock, clock)  # scheduled: 0, so a fused pull at 1 is in order
                if verdict and slot.key in poisoned:
                    skipped += 1
                    if self.config.mode == "sync":
                        # The clock must still complete: the worker contributes nothing to its mean.
                        self.policy.accept(slot, worker, clock, np.zeros_like(slot.value), roster)
                        self._note_clock(slot)
                elif verdict:
                    self.policy.accept(slot, worker, clock, grad, roster)
                    self._note_clock(slot)
                    applied += 1
                else:
                    late += 1
            dropped = len(slots) - applied
            with self._meta:
                self._counters["pushes_applied"] += applied
                self._counters["pushes_dropped"] += dropped
                self._counters["late_gradients_dropped"] += late
                self._counters["nonfinite_dropped"] += skipped
                if applied or late or skipped:
                    self._worker_clocks[worker] = max(self._worker_clocks.get(worker, NO_CLOCK), clock)
                    self._step_times.record(worker, clock, self._now())
        if applied or skipped:
            self._notify()
        return PushOutcome(applied=applied, dropped=dropped)

    def _repeated(self, slot: Slot, stamp: Stamp) -> bool:
        """A push this slice has applied already: this worker's clock again (a resend), or for a scheduled
        call's push, (schedule id, push number) again whichever worker sends it (a re-dispatch), or any
        push of a call its coordinator saw finish (a run cut off that comes back)."""
        if not stamp.schedule:
            return stamp.clock <= slot.last_clock.get(stamp.worker_id, NO_CLOCK)
        return stamp.schedule < self._schedule_floor or stamp.schedule_seq <= slot.scheduled.get(
            stamp.schedule, NO_CLOCK)

    def _record_scheduled(self, slot: Slot, stamp: Stamp) -> None:
        slot.scheduled[stamp.schedule] = stamp.schedule_seq
        if len(slot.scheduled) > _SCHEDULED_KEPT:  # amortised: the record stays bounded by calls in flight
            floor = self._schedule_floor
            for finished in [s for s in slot.scheduled if s < floor]:
                del slot.scheduled[finished]

    def _check_step_lr(self, stamp: Stamp, slots: Sequence[Slot], verdicts: Sequence[bool | None]) -> None:
        """Sync: a clock's update has one learning rate; a push that disagrees with the clock's earlier
        ones is refused whole, before anything of it lands."""
        if self.config.mode != "sync":
            return
        for slot, verdict in zip(slots, verdicts, strict=True):
            if verdict and slot.aggregate.contributors and slot.step_lr != stamp.lr:
                def shown(lr: float | None) -> str:
                    return f"{lr!r}" if lr is not None else f"the job's {self.config.optimizer.lr!r}"

                raise InvalidArgumentError(
                    f"stamp.lr: worker {stamp.worker_id!r} pushed clock {stamp.clock} of slice "
                    f"{str(slot.key)!r} with lr {shown(stamp.lr)}, the clock's earlier pushes "
                    f"({sorted(slot.aggregate.contributors)}) with {shown(slot.step_lr)}")

    def _check_finite(self, worker: str, clock: int, grads: Mapping[SliceKey, np.ndarray]) -> set[SliceKey]:
        """The keys whose gradient holds NaN or Inf, for nonfinite = skip; reject raises for the first.

        Runs before anything changes, so a rejected push applies nothing of any of its slices.
        """
        policy = self.config.nonfinite
        if policy == "allow":
            return set()
        poisoned = set()
        for key, grad in grads.items():
            # One reduction with no temporary array (5 ms per 100 MB here, a third of isfinite().all())
            # decides for almost every gradient: NaN and Inf propagate through a sum. float16 sums in
            # float32, where finite gradients cannot overflow. Only then is the first bad element looked for.
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow here is an answer, not news
                total = grad.sum(dtype=np.float32 if grad.dtype == np.float16 else None)
            if np.isfinite(total):
                continue
            bad = np.flatnonzero(~np.isfinite(grad.reshape(-1)))
            if not bad.size:
                continue  # finite values whose sum overflowed
            if policy == "reject":
                index = tuple(int(i) for i in np.unravel_index(int(bad[0]), grad.shape))
                raise InvalidArgumentError(
                    f"key {str(key)!r}: gradient from worker {worker!r} at clock {clock} holds "
                    f"{grad.reshape(-1)[bad[0]]} at index {index} ({bad.size} non-finite values); "
                    "nothing of the push was applied (job setting nonfinite=reject)")
            poisoned.add(key)
        return poisoned

    def _note_clock(self, slot: Slot) -> None:
        # Called under the slot's lock; one writer per key, so the dict needs no other lock.
        if self.config.mode != "sync":
            return
        if slot.aggregate.contributors:
            started = self._clock_started.get(slot.key)
            if started is None or started[0] != slot.version:
                self._clock_started[slot.key] = (slot.version, self._now())
        else:
            self._clock_started.pop(slot.key, None)

    def hangs(self, older_than_s: float) -> list[HangReport]:
        """Sync clocks that have had some but not all of their gradients for more than `older_than_s`
        seconds, oldest first, each with the quorum members it is still waiting for."""
        now = self._now()
        with self._meta:
            slots = list(self._slots.values())
            roster = self._roster
        reports = []
        for slot in slots:
            with slot.lock:
                started = self._clock_started.get(slot.key)
                contributors = set(slot.aggregate.contributors)
                if started is None or started[0] != slot.version or not contributors:
                    continue
                stalled = now - started[1]
                if stalled > older_than_s:
                    missing = (roster.quorum or frozenset()) - contributors
                    reports.append(HangReport(str(slot.key), slot.version, tuple(sorted(missing)), stalled))
        return sorted(reports, key=lambda r: -r.stalled_s)

    def check_request(self, stamp: Stamp, push: Sequence[SliceMeta], pull: Sequence[SliceKey]
                      ) -> list[SliceSpec]:
        """Validate a whole push-and-pull request before any part of it is applied; the specs of the
        pushed slices.

        Checks every key, each gradient's dtype and shape, the stamp (a push must come from a live
        member), every pushed clock (a duplicate is fine, a future clock is not), and that the pull
        (at `stamp.clock + 1` when pushing) could be answered once the push has landed. A request that
        passes is then only refused by a push or pull that cannot wait (the state only moves forward:
        what passes here passes later), so its push part never lands while its pull part is refused.
        """
        if not push and not pull:
            raise EmptyRequestError(f"request from worker {stamp.worker_id!r}: nothing to push or pull")
        pushed = [m.key for m in push]
        _check_unique("push", pushed)
        _check_unique("pull", pull)
        specs = self.check_push(push) if push else []
        push_slots = self._lookup(pushed)
        pull_slots = self._lookup(pull)
        with self._meta:
            self._check_stamp(stamp, writes=bool(push))
        for slot in push_slots:
            with slot.lock:
                if not slot.behind and stamp.clock > slot.last_clock.get(stamp.worker_id, NO_CLOCK):
                    self.policy.admit_push(slot, stamp.clock)  # raises, changes nothing
        # A slice this request pushes is readable at clock + 1 once its push is admitted.
        pull_clock = stamp.clock + 1 if push else stamp.clock
        own = set(pushed)
        for slot in pull_slots:
            if slot.key not in own:
                with slot.lock:
                    self.policy.check_pull(slot, pull_clock)
        return specs

    def check_push(self, metas: Sequence[SliceMeta]) -> list[SliceSpec]:
        """Validate a push's gradients by their metadata alone; the specs of their slices.

        A gradient may come in the slice's declared dtype or in the job's wire dtype (float16 or
        bfloat16 for a float32 slice); push() itself takes numpy dtypes, so a caller converts
        bfloat16 gradients to the declared dtype first.
        """
        _check_unique("push", [m.key for m in metas])
        slots = self._lookup([m.key for m in metas])
        for slot, meta in zip(slots, metas, strict=True):
            self._check_push_meta(slot, meta.dtype, meta.shape, meta.encoding)
        return [SliceSpec(dtype_name(slot.dtype), slot.value.shape) for slot in slots]

    def _check_push_meta(self, slot: Slot, dtype: str, shape: tuple[int, ...], encoding: str = "") -> None:
        if encoding:
            # Packed by a compressor: the handler unpacks it to float32 of the slice's size before push().
            if dtype != "uint8" or len(shape) != 1:
                raise DTypeMismatchError(f"key {str(slot.key)!r}: got a {encoding} gradient as {dtype} of "
                                         f"shape {tuple(shape)}, expected uint8 bytes of shape (n,)")
            payload_k(encoding, slot.value.size, shape[0], f"key {str(slot.key)!r}")
            return
        if tuple(shape) != slot.value.shape:
            raise ShapeMismatchError(
                f"key {str(slot.key)!r}: got shape {tuple(shape)}, store has {slot.value.shape}")
        wire = self.config.wire_dtype
        declared = dtype_name(slot.dtype)
        if dtype != declared and not (wire and dtype == wire):
            allowed = declared + (f" or the job's wire dtype {wire}" if wire else "")
            raise DTypeMismatchError(f"key {str(slot.key)!r}: got dtype {dtype}, store has {allowed}")

    # ---- pulling ----

    def pull_status(self, stamp: Stamp, keys: Sequence[SliceKey]) -> Waiting | None:
        """None if every key is readable at `stamp.clock`, else what the pull is waiting for."""
        if not keys:
            raise EmptyRequestError(f"pull from worker {stamp.worker_id!r} at clock {stamp.clock}: no keys")
        slots = self._lookup(keys)
        with self._meta:
            self._check_stamp(stamp, writes=False)
            roster = self._roster
            if stamp.worker_id not in roster.seen:
                roster = Roster(roster.quorum, roster.seen | {stamp.worker_id})
        waits: list[tuple[SliceKey, frozenset[str], int]] = []
        for slot in slots:
            with slot.lock:
                self.policy.check_pull(slot, stamp.clock)
                wait = self.policy.waiting_for(slot, stamp.clock, roster)
            if wait is not None:
                waits.append((slot.key, *wait))
        with self._meta:
            self._record_stamp(stamp, reads=True)
        if not waits:
            return None
        return Waiting(workers=tuple(sorted(set().union(*(w for _, w, _ in waits)))),
                       clock=min(c for _, _, c in waits), keys=tuple(k for k, _, _ in waits))

    def read(self, keys: Sequence[SliceKey]) -> list[tuple[np.ndarray, int]]:
        """(copy of the value in the declared dtype, version) per key; each slice read under its lock."""
        out = []
        for slot in self._lookup(keys):
            with slot.lock:
                # astype always copies, and for float16 slices it is the one conversion needed anyway.
                out.append((slot.value.astype(slot.dtype), slot.version))
        return out

    def read_with(self, key: SliceKey, fn: Callable[[np.ndarray, np.dtype, int], T]) -> T:
        """fn(value, declared dtype, version) under the slice's lock, for encoders that copy the value
        once, straight into their own buffer. `value` is the live master copy: fn must not keep it."""
        [slot] = self._lookup([key])
        with slot.lock:
            return fn(slot.value, slot.dtype, slot.version)

    def version(self, key: SliceKey) -> int:
        [slot] = self._lookup([key])
        return slot.version

    # ---- membership ----

    def set_quorum(self, quorum: Mapping[str, int]) -> None:
        """The live workers (id -> generation); empty = not known. Pending sync clocks are re-checked at once.

        A worker that leaves keeps what it already contributed to a pending clock and is
        not waited for from now on; a worker that joins is expected from the pending clock on.
        """
        with self._quorum_change:
            with self._meta:
                old = self._roster
                self._install_quorum(quorum)
                new = self._roster
                slots = sorted(self._slots.values(), key=lambda s: s.key)
            for slot in slots:
                with slot.lock:
                    self.policy.on_roster_change(slot, old, new)
        self._notify()

    def _install_quorum(self, quorum: Mapping[str, int]) -> None:
        self._quorum = dict(quorum) if quorum else None
        self.had_quorum = self.had_quorum or bool(quorum)
        for worker, generation in quorum.items():
            self._generations[worker] = max(self._generations.get(worker, generation), generation)
        self._roster = Roster(frozenset(self._quorum) if self._quorum is not None else None,
                              frozenset(self._seen))

    def _check_stamp(self, stamp: Stamp, writes: bool = True) -> None:
        # Fencing guards writes: an old incarnation, or a worker the scheduler declared dead, must not
        # change the model. Reads only need a current generation, so a chief that has left the quorum
        # (letting slower peers finish) can still fetch the final weights.
        worker, generation = stamp.worker_id, stamp.generation
        if stamp.clock < 0:
            raise InvalidArgumentError(f"worker {worker!r}: got clock {stamp.clock}, expected >= 0")
        newest = self._generations.get(worker)
        if newest is not None and generation < newest:
            raise StaleGenerationError(
                f"worker {worker!r}: got generation {generation}, but generation {newest} "
                f"was already seen; re-register")
        if writes and self._quorum is not None and worker not in self._quorum:
            raise StaleGenerationError(
                f"worker {worker!r} is not a live member (quorum: {sorted(self._quorum)}); re-register")
        if writes and stamp.schedule and self.config.mode != "async":
            raise InvalidArgumentError(
                f"stamp.schedule_id: worker {worker!r} pushed for scheduled call {stamp.schedule} to a "
                f"{self.config.mode} job, expected an async one (a ClusterCoordinator's)")

    def _record_stamp(self, stamp: Stamp, reads: bool = False) -> None:
        # Only a write moves a worker's fencing stamp: a read names a generation nobody checked (any
        # caller may stamp a pull with a real worker's id and generation 2**64 - 1, which would fence
        # that worker for good). Writes pass _check_stamp: from live members, when a quorum is known.
        worker = stamp.worker_id
        if not reads:
            self._generations[worker] = max(self._generations.get(worker, stamp.generation), stamp.generation)
            self._schedule_floor = max(self._schedule_floor, stamp.schedule_floor)
        if worker not in self._seen:
            self._seen.add(worker)
            self._roster = Roster(self._roster.quorum, frozenset(self._seen))

    # ---- observing ----

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` (outside every lock) after each change that may make a waiting pull ready."""
        with self._meta:
            self._subscribers.append(callback)

    def _notify(self) -> None:
        with self._meta:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback()

    def forget_incarnations(self) -> None:
        """Drop the generations restored from another job's checkpoint: its workers are not ours, and
        their stamps would fence this job's incarnations. The current quorum's stay."""
        with self._meta:
            self._generations = dict(self._quorum or {})

    def newest_generation(self) -> int:
        """The newest generation any worker has been seen with (0 for none): a restored shard's floor."""
        with self._meta:
            return max(self._generations.values(), default=0)

    def stats(self) -> StoreStats:
        with self._meta:
            slots = list(self._slots.values())
            versions = [s.version for s in slots] or [0]
            return StoreStats(
                slices=len(slots), bytes_stored=sum(s.value.nbytes for s in slots),
                pushes_applied=self._counters["pushes_applied"],
                pushes_dropped=self._counters["pushes_dropped"],
                late_gradients_dropped=self._counters["late_gradients_dropped"],
                quorum=tuple(sorted(self._quorum or ())), worker_clocks=dict(self._worker_clocks),
                min_version=min(versions), max_version=max(versions),
                nonfinite_dropped=self._counters["nonfinite_dropped"], step_times=self._step_times.summary())

    # ---- snapshots ----

    def snapshot(self) -> ShardSnapshot:
        """A consistent deep copy: every slice lock is held while copying."""
        with self._meta:
            slots = list(self._slots.values())
        with self._locked(slots), self._meta:
            return ShardSnapshot(
                config=self.config,
                slices=tuple(_slice_snapshot(s) for s in sorted(slots, key=lambda s: s.key)),
                generations=dict(self._generations),
                quorum=dict(self._quorum) if self._quorum is not None else None,
                seen=tuple(sorted(self._seen)), counters=dict(self._counters),
                schedule_floor=self._schedule_floor)

    @classmethod
    def restore(cls, snap: ShardSnapshot, *, optimizer: Optimizer | None = None,
                pool: ChunkPool | None = None) -> ShardStore:
        store = cls(snap.config, quorum=snap.quorum, optimizer=optimizer, pool=pool)
        store._generations.update(snap.generations)
        store._seen.update(snap.seen)
        store._roster = Roster(store._roster.quorum, frozenset(store._seen))
        store._counters.update(snap.counters)
        store._schedule_floor = snap.schedule_floor
        for s in snap.slices:
            value = np.array(s.value, order="C", copy=True)
            aggregate = Aggregate(None if s.pending is None else np.array(s.pending, copy=True),
                                  set(s.contributors))
            store._slots[s.key] = Slot(
                key=s.key, dtype=np.dtype(s.dtype), value=value, optimizer=store._optimizer_for(s.key),
                opt_state=_copy_state(s.opt_state), version=s.version, last_clock=dict(s.clocks),
                max_clock=max(s.clocks.values(), default=NO_CLOCK), aggregate=aggregate,
                floors=dict(s.floors), scheduled=dict(s.scheduled), behind=True, on_step=store._on_step,
                pool=store._pool)
            for worker, clock in s.clocks.items():
                store._worker_clocks[worker] = max(store._worker_clocks.get(worker, NO_CLOCK), clock)
        return store

    # ---- helpers ----

    def _lookup(self, keys: Iterable[SliceKey]) -> list[Slot]:
        with self._meta:
            try:
                return [self._slots[k] for k in keys]
            except KeyError as e:
                raise unknown_key_error(e.args[0], len(self._slots)) from None

    @staticmethod
    def _locked(slots: Sequence[Slot]) -> contextlib.AbstractContextManager[object]:
        """Hold the locks of `slots` (each once, in key order: no two requests can deadlock)."""
        if len(slots) == 1:  # a small request's one slice: its lock alone (an ExitStack costs more)
            return slots[0].lock
        stack = contextlib.ExitStack()
        for slot in sorted({id(s): s for s in slots}.values(), key=lambda s: s.key):
            stack.enter_context(slot.lock)
        return stack


def _check_unique(what: str, keys: Sequence[SliceKey]) -> None:
    """Each slice at most once per request: a repeated gradient would be applied once and counted
    twice, a repeated pull encoded and sent as many times as it is named."""
    if len(keys) > 1 and len(set(keys)) != len(keys):
        key, count = Counter(keys).most_common(1)[0]
        raise InvalidArgumentError(f"{what}: slice {str(key)!r} named {count} times, each slice at most once")


def _slice_snapshot(slot: Slot) -> SliceSnapshot:
    agg = slot.aggregate
    return SliceSnapshot(
        key=slot.key, dtype=slot.dtype.name, value=slot.value.copy(), version=slot.version,
        opt_state=_copy_state(slot.opt_state), clocks=dict(slot.last_clock), floors=dict(slot.floors),
        pending=agg.total.copy() if agg.contributors and agg.total is not None else None,
        contributors=tuple(sorted(agg.contributors)), scheduled=dict(slot.scheduled))
