"""What a parameter server does with a request, whatever transport brought it.

Handlers take decoded requests (slice keys, `WireArray`s, stamps, a job config, timeouts in
seconds) and return plain results or raise `PSError`s. They know no gRPC and no protobuf: the
gRPC servicer is one adapter over them (decode, call, encode), and a shared-memory or raw-socket
transport is another (docs/architecture.md, 11 Transports).

Here live the server's semantics above the store: fencing requests on the scheduler's view,
waiting (as coroutines, never threads) until the consistency policy lets a pull through, the
wire dtype on the way out, the encodings that sync mode shares between workers, and the
Exchange core that overlaps a push's data with the pull of what is already ready.
Requests are validated once, whole, before any part of them is applied: first against the
documented limits (common.limits: string lengths, counts, shapes, generations, clocks), then by
the store, which alone holds the slices' specs. The one exception is the Exchange stream, whose
header is validated whole first and whose slices are then applied one by one as they arrive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import numpy as np
from pshard.common.changes import ChangeSignal
from pshard.common.compression import PullPack
from pshard.common.errors import (
    EmptyRequestError,
    InvalidArgumentError,
    JobConflictError,
    LayoutConflictError,
    PermissionDeniedError,
    PullTimeoutError,
    SliceMovedError,
    StaleGenerationError,
    UnknownKeyError,
    checkpoint_write_error,
    quote,
)
from pshard.common.failpoints import failpoint
from pshard.common.job import JobConfig
from pshard.common.metrics import RequestMetrics
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import compress
from pshard.common.wire.codec import WireArray, cast
from pshard.ps_server.checkpoints.shard import load_shard, save_shard
from pshard.ps_server.core.lease import FRACTION, SchedulerLease
from pshard.ps_server.core.pull_copies import PullCopies
from pshard.ps_server.core.steptimes import HangReport
from pshard.ps_server.core.store import (
    PushOutcome,
    ShardSnapshot,
    ShardStore,
    SliceMeta,
    SliceSpec,
    StoreStats,
    dtype_name,
    unknown_key_error,
)
from pshard.ps_server.replication.api import (
    NO_ROW_REPLICATION,
    NO_SLICE_REPLICATION,
    RowReplication,
    SliceReplication,
)
from pshard.ps_server.replication.dense import ReplicaSet
from pshard.ps_server.replication.records import Record
from pshard.ps_server.replication.shm import replica_shm_dir
from pshard.ps_server.settings import ServerSettings

log = logging.getLogger("pshard.ps")

P = TypeVar("P")
# Turns a slice's value, in the wire dtype, into what a transport sends. The array may be the
# live value, read under the slice's lock: the encoder copies it (once, into its own buffer)
# and keeps no reference. Encoders must be hashable (a module-level function is): sync mode
# caches their results per encoder.
Encoder = Callable[[WireArray], P]

# A view newer than ours is on its way from the scheduler: wait this long for it at most.
_VIEW_WAIT_S = 10.0
# How long a sync pull waits for a server's first quorum before it says there is none: a registered
# worker's view reaches the servers in milliseconds (seconds on a loaded host); the session waits for
# it before clock 0, so only a worker that never joined the job gets here.
NO_QUORUM_GRACE_S = 10.0


def _metas(items: Sequence[tuple[SliceKey, WireArray]]) -> list[SliceMeta]:
    return [SliceMeta(k, w.dtype, tuple(w.array.shape), w.encoding) for k, w in items]


def _gradient(key: SliceKey, wire: WireArray, spec: SliceSpec, clock: int, metrics: RequestMetrics
              ) -> np.ndarray:
    """A pushed gradient in the slice's declared dtype: a packed one unpacked to float32 first (the
    servers aggregate in float32, whatever travelled), a wire-dtype one cast back."""
    if wire.encoding:
        started = time.perf_counter()
        dense = compress.decode(wire, math.prod(spec.shape), key, clock).reshape(spec.shape)
        metrics.record_unpack(wire.encoding, wire.array.nbytes, dense.nbytes, time.perf_counter() - started)
        wire = WireArray(dense, "float32")
    return cast(wire, spec.dtype).array


class PulledSlice(NamedTuple):
    key: SliceKey
    value: WireArray  # a copy, in the job's wire dtype
    version: int


@dataclass(frozen=True)
class PushPullResult:
    applied: int
    dropped: int
    slices: list[PulledSlice]


@dataclass(frozen=True)
class Stall:
    """Exchange: the next pulled slice is not ready; a transport sends what it has buffered."""


@dataclass(frozen=True)
class EncodedSlice(Generic[P]):
    """Exchange: one pulled slice, as the transport's encoder made it."""

    key: SliceKey
    version: int
    payload: P


@dataclass(frozen=True)
class ExchangeDone:
    """Exchange: the last event; every gradient was handed to the store."""

    versions: list[int]  # of the pulled slices, in request order
    applied: int
    dropped: int


ExchangeEvent = Stall | EncodedSlice[P] | ExchangeDone


@dataclass(frozen=True)
class ServerStats:
    job: JobConfig | None  # None until the first Declare (or a default job) configures the server
    store: StoreStats | None
    pulls_served: int
    pulls_waiting: int  # right now
    pulls_timed_out: int
    # Worker id -> the fast path ("shm", "tcp") its session uses; absent: gRPC.
    transports: Mapping[str, str] = field(default_factory=dict)
    hangs: tuple[HangReport, ...] = ()  # sync clocks stalled past the settings' hang_report_s
    # Replication (docs/architecture.md, 9 Failures): records the slowest backup has yet to acknowledge,
    # and how often this server was promoted to primary of a dead one's slices.
    replication_lag: int = 0
    failovers: int = 0


class ParameterServerHandlers:
    def __init__(self, settings: ServerSettings, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: where the handlers run (default: the running one); the store may notify from any thread."""
        self._settings = settings
        self._limits = settings.limits
        self._changes = ChangeSignal(loop)
        self._store: ShardStore | None = None
        self._quorum: dict[str, int] | None = dict(settings.static_quorum) if settings.static_quorum else None
        self._config_lock = asyncio.Lock()
        # One save at a time: concurrent saves of one shard would race on its files (and each
        # snapshot is a copy of the shard, so queueing them also bounds the memory they take).
        self._checkpoint_lock = asyncio.Lock()
        # Sync mode: every worker pulls the same version of a slice, so its encoding is made once
        # and shared: (encoder, slice) -> (version, payload). Costs one copy of the shard.
        self._encoded: dict[tuple[Hashable, SliceKey], tuple[int, object]] = {}
        # Compressed pulls (issue 19): per (worker, slice), the copy that worker holds. A new job, or a
        # slice moved away, drops them (the worker's next pull is refused and comes whole).
        self.pull_copies = PullCopies()
        # Generation of the newest scheduler view applied; None when no scheduler is followed.
        self._view_generation: int | None = None
        self.pulls_served = 0
        self.pulls_timed_out = 0
        # Set by the fast-path transports, so that stats show what each worker uses.
        self.transport_report: Callable[[], Mapping[str, str]] = dict
        # Run after each checkpoint of the shard (service.py: the sparse tables' own checkpoint).
        self.after_checkpoint: Callable[[], Awaitable[object]] | None = None
        # Bytes, latency and refusals per transport, filled by the servicer and the fast paths.
        self.requests = RequestMetrics()
        # A restored checkpoint until the first Declare says which job this is (see _claim).
        self._restored_unclaimed = False
        # The restored checkpoint's newest slice version, until the first stamped request is compared
        # with it: a worker's clock past it means the server restarted from an older checkpoint than
        # the one it trained to, which is said once (the steps in between are lost).
        self._restored_version: int | None = None
        # Replication (docs/architecture.md, 9 Failures): the copies this server holds as a backup,
        # and what forwards its own slices' steps to its backups (ps_server/replication/api.py: a no-op
        # until follower.py enables replication, which a job without --replicas never does).
        self.replica_shm_dir = replica_shm_dir(settings.transport, settings.shm_dir)
        self.replica_set = ReplicaSet(self.replica_shm_dir)
        self.replication: SliceReplication = NO_SLICE_REPLICATION
        # Table rows' replication (ps_server/replication/tables.py): its Replicate batches land there.
        self.table_replication: RowReplication = NO_ROW_REPLICATION
        self.promotions = 0  # slices this server took over as primary after a failover
        self.failovers = 0  # times it did (each a role change, logged): pshard_failovers_total
        # The newest layout's slices of this server (replicas only; None: not known, nothing checked).
        self._owned: tuple[int, frozenset[SliceKey]] | None = None
        self._gained: frozenset[SliceKey] = frozenset()  # what later layouts moved here (failovers)
        self._released: frozenset[SliceKey] = frozenset()  # moved away, then held only as a backup
        # Replicas only (follow_scheduler arms it): past it this server may have been failed over, and
        # takes no write (ps_server/core/lease.py).
        self.lease: SchedulerLease | None = None
        self._lease_timers: list[asyncio.TimerHandle] = []
        if settings.checkpoint_dir:
            snap = load_shard(Path(settings.checkpoint_dir), settings.shard_name)
            if snap is not None:
                self._install(ShardStore.restore(snap))
                self._restored_unclaimed = True
                self._restored_version = max((s.version for s in snap.slices), default=0)
                log.info("restored %d slices from %s (job %r)", len(snap.slices), settings.checkpoint_dir,
                         snap.config.job_id)
        if self._store is None and settings.default_job is not None:
            self._install(ShardStore(settings.default_job, quorum=self._quorum))

    # ---- state ----

    def _install(self, store: ShardStore) -> None:
        if self._quorum is not None:
            store.set_quorum(self._quorum)
        store.subscribe(self._changes.notify)
        self._store = store
        self.pull_copies.forget()
        self.replication.attach(store)
        self._changes.notify()  # wakes wait_configured

    # ---- replication ----

    @property
    def replicas_setting(self) -> int:
        return self._settings.replicas

    def enable_replication(self, replication: SliceReplication) -> None:
        """Forward this server's steps to its backups before acknowledging (follower.py wires it)."""
        self.replication = replication
        if self._store is not None:
            replication.attach(self._store)

    def replicate(self, config: JobConfig, records: Sequence[Record], primary: str = "",
                  release: bool = False, segments: Sequence[str] = ()) -> list[SliceKey]:
        """Backup side of a Replicate call: replay a primary's records; the slices it must resend whole.

        A slice this server took over as primary is refused: its sender was declared dead and is still
        running (a false suspicion), and must not acknowledge steps the new primary never sees.
        """
        store = self._store
        if store is not None:
            self._release_moved([r.key for r in records], primary)
            taken = next((r.key for r in records if store.holds(r.key)), None)
            if taken is not None:
                raise StaleGenerationError(f"replicate: slice {str(taken)!r} has this server as its primary "
                                           "since a failover; the sender was declared dead")
        if release:
            dropped = self.replica_set.release(primary)
            log.info("replication: %s no longer forwards here; dropped its %d copies", primary, dropped)
            return []
        if records:
            # A test's SIGKILL lands here: the copy (a joiner's catch-up, say) is on its way, not applied.
            failpoint("ps.before_replica_apply")
        return self.replica_set.apply(config, records, primary, segments)

    def set_ownership(self, version: int, owned: frozenset[SliceKey]) -> None:
        """Layout `version` makes this server primary of `owned` (follower.py, with replicas)."""
        if self._owned is not None and version <= self._owned[0]:
            return
        held = [s.key for s in self._store.slots()] if self._store is not None else []
        lost = [k for k in held if k not in owned and (self._owned is None or k in self._owned[1])]
        if lost:
            log.warning("FAILOVER: layout version %d moved %d slices held here to their backups (this server "
                        "was declared dead); requests for them are refused from now on", version, len(lost))
        if self._owned is not None:
            self._gained = self._gained | (owned - self._owned[1])
        self._owned = (version, owned)
        # Take a failover's slices over now rather than at their first request: their copies start
        # replicating to this server's backups at once, so they count as in sync again sooner (a
        # stalled job would otherwise leave them with no in-sync copy; docs/architecture.md, 9).
        store = self._store
        copies = [k for k in sorted(owned)
                  if self.replica_set.holds(k) and (store is None or not store.holds(k))]
        if copies:
            self._promote(copies)
        self._changes.notify()  # pulls parked on slices that moved away are refused now (_wait_readable)

    def _release_moved(self, keys: Sequence[SliceKey], primary: str) -> None:
        """Slices a failover moved away from this server while it was cut off, now copied to it by their
        new primary: its own frozen ones go, and it holds them as that primary's backup from now on."""
        owned, store = self._owned, self._store
        if owned is None or store is None:
            return
        moved = [k for k in keys if k not in owned[1] and store.holds(k)]
        self.pull_copies.forget(keys=moved)
        if moved and store.release(moved):
            self._released |= frozenset(moved)
            log.warning("ROLE: %d slices moved away from this server by layout version %d are dropped here; "
                        "it holds them as a backup of %s from now on", len(moved), owned[0],
                        primary or "their primary")

    def renew_lease(self, sent_at: float, timeout_s: float) -> None:
        """The scheduler answered a heartbeat sent at `sent_at` (on the event loop, after the views that
        answer brought: a new layout's ownership is in place before writes are taken again)."""
        if self.lease is None:
            self.lease = SchedulerLease(time.monotonic)
        if self.lease.renew(sent_at, timeout_s):
            log.warning("FENCE: the scheduler answers again; taking writes (%d refused while fenced)",
                        self.lease.fenced)
        self._changes.notify()  # writes waiting for the renewal go on
        for timer in self._lease_timers:
            timer.cancel()
        loop = asyncio.get_running_loop()
        ends, lapses = self.lease.expires_at, self.lease.lapses_at
        assert ends is not None and lapses is not None
        # Said at the lease's end; at its lapse the waiting pulls are woken: no clock can complete here.
        self._lease_timers = [loop.call_later(max(0.0, at - time.monotonic()) + 0.001, self._lease_ended)
                              for at in (ends, lapses)]

    def _lease_ended(self) -> None:
        if self.lease is not None and self.lease.expired() and not self.lease.lapsed():
            log.warning("FENCE: no heartbeat answered by the scheduler within %.0f%% of its timeout; this "
                        "server may be failed over and takes no write until it is answered again",
                        100 * FRACTION)
        self._changes.notify()

    async def _await_lease(self, stamp: Stamp, timeout_s: float | None) -> None:
        """Let `stamp`'s push through only while the lease holds (`await_lease`). Its deadline and the words
        of a refusal are made only when the lease has expired: every push asks (issue 18's latency drift)."""
        lease = self.lease
        if lease is None or not lease.expired():
            return
        await self.await_lease(f"push by {stamp.worker_id!r} at clock {stamp.clock}",
                               self._deadline(timeout_s))

    async def await_lease(self, what: str, deadline: float) -> None:
        """Let a write through only while the lease holds; one that finds it expired waits for a
        renewal until the lease lapses (a late answer on a loaded host), then is refused. Sparse tables'
        pushes ask here too (ps_server.handlers.tables.WriteFence)."""
        lease = self.lease
        if lease is None or not lease.expired():
            return
        lapses_at = lease.lapses_at
        assert lapses_at is not None
        await self._changes.wait_for(lambda: True if not lease.expired() else None, min(deadline, lapses_at))
        lease.check(what)

    def _check_lapsed(self, what: str) -> None:
        if self.lease is not None and self.lease.lapsed():
            self.lease.check(what)

    def _check_owned(self, keys: Iterable[SliceKey]) -> None:
        """Refuse slices a failover moved away from this server (it was declared dead and came back):
        the worker re-routes to their primary instead of updating a copy nobody replicates."""
        owned, store = self._owned, self._store
        if owned is None or store is None:
            return
        for key in keys:
            if key not in owned[1] and (store.holds(key) or key in self._released):
                raise SliceMovedError(f"slice {quote(str(key))} moved: layout version {owned[0]} has it on "
                                      "another server (a failover); re-route", key=str(key),
                                      layout_version=owned[0])

    def _check_kept(self, before: tuple[int, frozenset[SliceKey]] | None, keys: Iterable[SliceKey],
                    what: str) -> None:
        """Refuse a request whose slices a layout switch (a drain, a join) moved away while it waited for
        its copies to settle (`before`: the ownership it started under), as a table's `kept` does: the
        step may have reached the new owner's copy or not, so it is never acknowledged here; the worker
        re-routes and sends it again, and the new owner drops what it has already."""
        now = self._owned
        if now is None or now is before:
            return
        for key in keys:
            if key not in now[1] and (before is None or key in before[1]):
                raise SliceMovedError(f"{what}: slice {quote(str(key))} moved to another server by layout "
                                      f"version {now[0]} while it was applied here; re-route", key=str(key),
                                      layout_version=now[0])

    def check_adds_nothing(self, metas: Sequence[SliceMeta], who: str) -> None:
        """Once the job is set, only the chief adds parameters (docs/architecture.md, 13 Security):
        PermissionDeniedError naming the first slice `who`'s declaration would create, one this server
        neither holds nor backs up. Checked on the declaration's header, before its bytes are read."""
        store = self._store
        if store is None:
            return
        new = [m.key for m, creates in zip(metas, store.check_declare(metas), strict=True)
               if creates and not self.replica_set.holds(m.key)]
        if new:
            raise PermissionDeniedError(
                f"Declare: {who} may not add parameters once the job is set: slice {str(new[0])[:256]!r} "
                f"is not on this server ({len(new)} new slices); only the chief may declare new ones")

    def _promote(self, keys: Iterable[SliceKey]) -> None:
        """Take over, as primary, the slices of `keys` this server holds only as a backup: a worker
        routes here for them only once the scheduler's layout made this server their primary."""
        if not self._gained and self.replica_set.empty:
            return  # the common case, and every request of a job without replicas: nothing to look up
        store = self._store
        keys = list(keys)
        wanted = [k for k in keys if (store is None or not store.holds(k)) and self.replica_set.holds(k)]
        lost = [k for k in keys
                if k in self._gained and k not in wanted and (store is None or not store.holds(k))]
        if lost and self._owned is not None:  # the scheduler chose this server as heir, but no copy is here
            raise UnknownKeyError(
                f"slice {str(lost[0])!r}: layout version {self._owned[0]} makes this server its primary "
                f"after a failover, but it holds no copy of it ({len(lost)} such slices): the dead "
                "primary's backup was not in sync (docs/architecture.md, 9 Failures); its updates are lost")
        if not wanted:
            return
        slots = self.replica_set.take(wanted)
        if not slots:
            return
        if store is None:
            store = ShardStore(self.replica_set.config or JobConfig(), quorum=self._quorum)
            store.adopt(slots)
            self._install(store)
        else:
            store.adopt(slots)
            self.replication.seed([s.key for s in slots])
        self.promotions += len(slots)
        self.failovers += 1
        log.warning("FAILOVER: promoted to primary of %d slices (%s%s) at versions %d..%d",
                    len(slots), ", ".join(str(s.key) for s in slots[:3]), ", ..." if len(slots) > 3 else "",
                    min(s.version for s in slots), max(s.version for s in slots))

    async def _settle(self, keys: Iterable[SliceKey], deadline: float) -> None:
        """Wait until every step of `keys` so far is on every backup (at once without replicas).

        Past the lease's lapse the wait ends with FencedError: the backup that stopped acknowledging
        may be the new primary (it refuses a declared-dead sender), and the worker must send the step
        to it rather than wait for its deadline."""
        keys = list(keys)
        while True:
            lapses_at = self.lease.lapses_at if self.lease is not None else None
            until = deadline if lapses_at is None else min(deadline, lapses_at)
            try:
                await self.replication.settle(keys, until)
                return
            except PullTimeoutError:
                if self.lease is None or time.monotonic() >= deadline:
                    raise
                if self.lease.lapsed():
                    self.lease.check(f"replication of {len(keys)} slices to the backups")

    @property
    def store(self) -> ShardStore:
        if self._store is None:
            raise LayoutConflictError("no parameters declared yet: call Declare (with the job config) first")
        return self._store

    @property
    def has_store(self) -> bool:
        return self._store is not None

    async def wait_configured(self, deadline: float) -> bool:
        """Wait until a Declare configured this server (a worker waits for the chief); False at deadline."""
        return bool(await self._changes.wait_for(lambda: True if self._store is not None else None, deadline))

    def _store_holding(self, keys: Sequence[SliceKey]) -> ShardStore:
        """The store, or (none yet) the error a request for `keys` gets from a server holding nothing."""
        if self._store is None and keys:
            raise unknown_key_error(keys[0], 0, replicated=self._settings.replicas > 0)
        return self.store

    @property
    def quorum(self) -> dict[str, int] | None:
        """The live workers as last known (worker id -> generation); None: not known yet."""
        return dict(self._quorum) if self._quorum is not None else None

    def follow_views(self) -> None:
        """From now on membership comes from scheduler views (see _await_view)."""
        self._view_generation = self._view_generation or 0

    def set_quorum(self, quorum: Mapping[str, int], generation: int | None = None) -> None:
        """Membership changed (scheduler view): only live workers are waited for."""
        self._quorum = dict(quorum)
        # A worker that left takes its pull copies' memory with it (back, it pulls whole: no copy here).
        self.pull_copies.forget(workers=self.pull_copies.workers - set(quorum))
        if generation is not None:
            self._view_generation = max(generation, self._view_generation or 0)
        if self._store is not None:
            self._store.set_quorum(self._quorum)
        self._changes.notify()

    async def _await_view(self, stamp: Stamp, deadline: float) -> None:
        """A stamp newer than our view means the view is on its way (a worker that just
        registered can reach us before the scheduler's Watch does): wait for it rather than
        refuse the worker as a non-member. A generation the scheduler has still not handed out
        by then is refused: no state may move on a generation nobody vouched for."""
        if self._view_generation is None or stamp.generation <= self._view_generation:
            return
        await self._changes.wait_for(
            lambda: True if (self._view_generation or 0) >= stamp.generation else None,
            min(deadline, time.monotonic() + _VIEW_WAIT_S))
        if stamp.generation > self._view_generation:
            raise StaleGenerationError(
                f"worker {stamp.worker_id!r}: got generation {stamp.generation}, but the newest view "
                f"from the scheduler is generation {self._view_generation}; register first")

    def _check_limits(self, what: str, stamp: Stamp | None, push: Sequence[SliceMeta],
                      pull: Sequence[SliceKey]) -> None:
        """The documented limits (common.limits), before the store or a wait sees the request."""
        limits = self._limits
        if stamp is not None:
            limits.check_stamp(stamp.worker_id, stamp.generation, stamp.clock)
            if self._restored_version is not None:  # once, after a restore: not a call per request
                self._compare_with_restored(stamp)
        limits.check_count(what, len(push))
        limits.check_count(what, len(pull))
        limits.check_keys(what, (m.key.key for m in push))
        limits.check_keys(what, (k.key for k in pull))
        for meta in push:
            limits.check_shape(lambda key=meta.key: f"slice {quote(str(key))}", meta.shape)

    def _compare_with_restored(self, stamp: Stamp) -> None:
        restored, self._restored_version = self._restored_version, None
        if restored is not None and stamp.clock > restored:
            log.warning("worker %s is at clock %d, but the checkpoint restored at start (in %s) is at "
                        "version %d: this server restarted from an older checkpoint than it trained to, and "
                        "the steps trained after version %d are lost", quote(stamp.worker_id), stamp.clock,
                        self._settings.checkpoint_dir, restored, restored)

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (timeout_s if timeout_s is not None else self._settings.pull_timeout_s)

    def _to_wire(self, value: WireArray) -> WireArray:
        wire = self._store.config.wire_dtype if self._store is not None else ""
        return cast(value, wire) if wire else value

    # ---- declare ----

    async def declare(self, job: JobConfig | None, items: Sequence[tuple[SliceKey, WireArray]]
                      ) -> tuple[list[bool], list[WireArray]]:
        """Create the slices not declared yet (the first declaration wins); per item, whether this
        call created it, and the slice's value (in the wire dtype). The first Declare configures
        the server with `job` (None: the default job)."""
        self._check_limits("declare", None, _metas(items), [])
        # A slice a failover moved here is its copy, never a fresh one: a worker restarted mid-job
        # declaring its initial values must get the trained ones (docs/architecture.md, 9 Failures).
        self._check_owned([k for k, _ in items])
        self._promote([k for k, _ in items])
        async with self._config_lock:
            store = self._claim(job)
            if store is None:
                store = ShardStore(job or JobConfig(), quorum=self._quorum)
            elif job is not None and job != store.config:
                self._adopt_other_job(store, job)
            store.check_declare([SliceMeta(k, w.dtype, tuple(w.array.shape)) for k, w in items])
            created = store.declare([(k, w.array) for k, w in items])
            if self._store is None:  # installed only once it holds the request's slices
                self._install(store)
                log.info("configured: %s", store.config)
        # A slice is declared once its backups hold it too.
        self.replication.seed([k for k, _ in items])
        await self._settle([k for k, _ in items], self._deadline(None))
        values = store.read([k for k, _ in items])
        return created, [self._to_wire(WireArray(v, dtype_name(v.dtype))) for v, _ in values]

    def _adopt_other_job(self, store: ShardStore, job: JobConfig) -> None:
        """A Declare whose config differs from the running one: another job (refused, naming both, unless
        the server was started with --resume), or the same job with other settings (refused)."""
        ours, theirs = job.job_id, store.config.job_id
        running = store.config
        if ours == theirs and not running.averaged and job.averaged \
                and dataclasses.replace(job, averaged=()) == running:
            # The same job, its trainer averaging model buffers that this server's flags could not name
            # (pshard ps --mode ... has no flag for them): they are the declaration's to add.
            store.average(job.averaged)
            log.info("averaging the pushes of %d model buffers the job declares (e.g. %s)",
                     len(job.averaged), job.averaged[0])
            return
        if ours == theirs:
            raise LayoutConflictError(f"config: got {job}, this server runs {store.config}")
        if not self._settings.resume or dataclasses.replace(job, job_id=theirs) != store.config:
            stats = store.stats()
            raise JobConflictError(
                f"job {ours!r}: this server holds the parameters of job {theirs!r} (slice versions "
                f"{stats.min_version}..{stats.max_version}), which a new job would silently continue. Start "
                f"job {ours!r} on servers of its own (or stop these), or restart these with --resume to "
                f"continue job {theirs!r}'s weights under the new id")
        log.warning("RESUMING ANOTHER JOB (--resume): this server holds job %r's parameters; job %r "
                    "continues its weights, optimizer state and clocks", theirs, ours)
        store.config = dataclasses.replace(store.config, job_id=ours)
        store.forget_incarnations()

    def _claim(self, job: JobConfig | None) -> ShardStore | None:
        """The store a Declare of `job` configures: a restored checkpoint only if it is of the same job.

        Re-running a job with the same --checkpoint-dir must not mix two runs (their generations fenced
        the new workers, or the old weights were silently resumed): another job's checkpoint is set
        aside (the next save replaces it) unless the server was started with --resume.
        """
        store = self._store
        if not self._restored_unclaimed or store is None or job is None:
            return store
        self._restored_unclaimed = False
        where = self._settings.checkpoint_dir
        ours, theirs = job.job_id, store.config.job_id
        if ours == theirs:
            log.warning("job %r resumes from its checkpoint in %s (slice versions %d..%d)", ours, where,
                        store.stats().min_version, store.stats().max_version)
            return store
        if self._settings.resume:
            log.warning("RESUMING ANOTHER JOB (--resume): the checkpoint in %s is of job %r, this is job %r; "
                        "continuing its weights, optimizer state and clocks", where, theirs, ours)
            store.config = dataclasses.replace(store.config, job_id=ours)
            store.forget_incarnations()
            return store
        log.warning("NOT RESTORING: the checkpoint in %s is of job %r, not of this job %r; starting fresh "
                    "(the next checkpoint replaces it). Start the server with --resume to continue it",
                    where, theirs, ours)
        self._store = None
        return None

    # ---- push / pull ----

    def _push_now(self, store: ShardStore, stamp: Stamp, items: Sequence[tuple[SliceKey, WireArray]],
                  specs: Sequence[SliceSpec] | None = None) -> PushOutcome:
        if specs is None:
            specs = store.check_push(_metas(items))
        # Wire-dtype gradients become the declared dtype (bfloat16 has no numpy dtype of its own).
        return store.push(stamp, {k: _gradient(k, w, spec, stamp.clock, self.requests)
                                  for (k, w), spec in zip(items, specs, strict=True)})

    async def _wait_readable(self, stamp: Stamp, keys: Sequence[SliceKey], deadline: float) -> None:
        store = self.store
        started = time.monotonic()
        if store.pull_status(stamp, keys) is None:  # validates; raises on bad keys or clocks
            return
        if store.policy.name == "sync" and not store.had_quorum:
            await self._await_first_quorum(store, stamp, keys, min(deadline, started + NO_QUORUM_GRACE_S))
        def readable() -> bool | None:
            # A layout that moved the slices away (a join, a drain, a failover) ends the wait at once with
            # the re-route error: the clock now completes on their new primary, never here.
            self._check_owned(keys)
            if store.pull_status(stamp, keys) is None:
                return True
            # Fenced for good: no push can complete the clock here any more; the worker re-routes.
            self._check_lapsed(f"pull by {stamp.worker_id!r} at clock {stamp.clock}")
            return None

        ready = await self._changes.wait_for(readable, deadline)
        if ready is None:
            self.pulls_timed_out += 1
            waiting = store.pull_status(stamp, keys)
            if waiting is None:
                return
            raise PullTimeoutError(
                f"pull by {stamp.worker_id!r} at clock {stamp.clock} timed out after "
                f"{time.monotonic() - started:.1f}s waiting for workers {list(waiting.workers)} "
                f"to reach clock {waiting.clock} (slices {[str(k) for k in waiting.keys][:5]})")

    async def _await_first_quorum(self, store: ShardStore, stamp: Stamp, keys: Sequence[SliceKey],
                                  deadline: float) -> None:
        """A sync clock completes only when the quorum has pushed it; a server that never knew one (no
        --workers, and no scheduler view with a live worker) would hold the pull to its deadline
        "waiting for workers []". Say why, and what to do, within seconds instead."""
        known = await self._changes.wait_for(
            lambda: True if store.had_quorum or store.pull_status(stamp, keys) is None else None, deadline)
        if known is None:
            self.pulls_timed_out += 1
            raise PullTimeoutError(
                f"pull by {stamp.worker_id!r} at clock {stamp.clock}: this server has no sync quorum after "
                f"{NO_QUORUM_GRACE_S:g}s, so no clock can complete. Its quorum is the live workers of the "
                "job's scheduler, and none has registered there: a worker joins by registering (PSTrainer("
                "model, job=...) with no client, or 'pshard worker'). A server without a scheduler needs "
                "--workers ID,ID,... naming the workers")

    async def push(self, stamp: Stamp, items: Sequence[tuple[SliceKey, WireArray]]) -> PushOutcome:
        """Apply (sync: accumulate) the gradients of `stamp.clock`, all or none."""
        if not items:
            raise EmptyRequestError(f"push from {stamp.worker_id!r}: no gradients given")
        result = await self.push_pull(stamp, items, [])
        return PushOutcome(result.applied, result.dropped)

    async def pull(self, stamp: Stamp, keys: Sequence[SliceKey], timeout_s: float | None = None
                   ) -> list[PulledSlice]:
        """The slices' values once the consistency policy lets a read at `stamp.clock` through."""
        if not keys:
            raise EmptyRequestError(f"pull from {stamp.worker_id!r}: no slices given")
        return (await self.push_pull(stamp, [], keys, timeout_s)).slices

    async def push_pull(self, stamp: Stamp, items: Sequence[tuple[SliceKey, WireArray]],
                        keys: Sequence[SliceKey], timeout_s: float | None = None,
                        packs: Sequence[PullPack] = ()) -> PushPullResult:
        """Push (the whole request atomically), then pull at the next clock (or at `stamp.clock`
        when nothing was pushed). `timeout_s` None: the server's pull timeout. `packs`: empty, or how
        each of `keys` comes back (compressed pulls, core/pull_copies.py)."""
        if not items and not keys:
            raise EmptyRequestError(f"push-pull from {stamp.worker_id!r}: nothing to push or pull")
        metas = _metas(items)
        self._check_limits("push-pull", stamp, metas, keys)
        if items and self.lease is not None:  # first: the ownership checked next may change with the renewal
            await self._await_lease(stamp, timeout_s)
        pushed = [k for k, _ in items]
        touched = [*pushed, *keys]
        self._check_owned(touched)
        owned = self._owned
        self._promote(touched)
        store = self._store_holding(pushed or keys)
        store.specs(keys)
        deadline = self._deadline(timeout_s)
        await self._await_view(stamp, deadline)
        # The whole request, push and pull part, before any of it lands: a refused request changes nothing.
        specs = store.check_request(stamp, metas, keys)
        if packs:  # compressed pulls only: a plain step makes no call here
            self._check_packs(store, stamp, keys, packs)
        outcome = self._push_now(store, stamp, items, specs) if items else PushOutcome(0, 0)
        if not keys:
            await self._settle(pushed, deadline)  # acknowledged once on every backup
            self._check_kept(owned, pushed, f"push by {stamp.worker_id!r} at clock {stamp.clock}")
            return PushPullResult(outcome.applied, outcome.dropped, [])
        after = Stamp(stamp.worker_id, stamp.generation, stamp.clock + 1) if items else stamp
        await self._wait_readable(after, keys, deadline)
        if packs and any(p.packed for p in packs):
            pulled = [PulledSlice(k, *(self._read_packed(store, after, k, p) if p.packed
                                       else self._read_whole(store, k)))
                      for k, p in zip(keys, packs, strict=True)]
        else:
            pulled = [PulledSlice(k, self._to_wire(WireArray(v, dtype_name(v.dtype))), version)
                      for k, (v, version) in zip(keys, store.read(keys), strict=True)]
        await self._settle(touched, deadline)  # the versions read live on the backups
        self._check_kept(owned, touched, f"push-pull by {stamp.worker_id!r} at clock {stamp.clock}")
        self.pulls_served += 1
        return PushPullResult(outcome.applied, outcome.dropped, pulled)

    def _read_whole(self, store: ShardStore, key: SliceKey) -> tuple[WireArray, int]:
        [(value, version)] = store.read([key])
        return self._to_wire(WireArray(value, dtype_name(value.dtype))), version

    def _check_packs(self, store: ShardStore, stamp: Stamp, keys: Sequence[SliceKey],
                     packs: Sequence[PullPack]) -> None:
        """A compressed pull's packing, whole, before anything of the request applies: float32 slices
        only (the copies add in float32), and bases that are this server's."""
        if not packs:
            return
        specs = store.specs(keys)
        for key, pack, spec in zip(keys, packs, specs, strict=False):
            if pack.packed and spec.dtype != "float32":
                raise InvalidArgumentError(f"pull_packing of slice {quote(str(key))}: got encoding "
                                           f"{pack.encoding!r} for a {spec.dtype} slice, expected a float32 "
                                           "one (compressed pulls add in float32)")
        self.pull_copies.check(stamp.worker_id, keys, packs, [math.prod(spec.shape) for spec in specs])

    def _read_packed(self, store: ShardStore, stamp: Stamp, key: SliceKey, pack: PullPack
                     ) -> tuple[WireArray, int]:
        """(what `stamp.worker_id` is sent of `key`, its version): the change since its copy, packed, with
        the server's copy moved on under the slice's lock; never shared between workers."""
        def packed(value: np.ndarray, dtype: np.dtype, version: int) -> tuple[WireArray, int]:
            # Sync mode: every worker reads the same versions, so workers with the same history share the
            # packing (async versions are each worker's own: not worth remembering).
            shared = version if self._store is not None and self._store.config.mode == "sync" else -1
            return self.pull_copies.serve(stamp.worker_id, key, value, pack, stamp.clock, shared), version

        return store.read_with(key, packed)

    # ---- Exchange: a push streamed in, overlapped with the pull streamed out ----

    async def exchange(self, stamp: Stamp, push: Sequence[SliceMeta], pull: Sequence[SliceKey],
                       gradients: AsyncIterator[tuple[int, WireArray]], encode: Encoder[P],
                       timeout_s: float | None = None, packs: Sequence[PullPack] = ()
                       ) -> AsyncIterator[ExchangeEvent[P]]:
        """Push the gradients announced in `push` as they arrive and pull `pull` (at the next clock
        when pushing), yielding each pulled slice as soon as it is ready.

        The announcement is validated whole before any gradient is read. `gradients` yields
        (index into `push`, value) and must end after the last one; it is only read while
        iterating. A slice this request pushes is pulled only after its own gradient landed.
        Events: a Stall before each wait, an EncodedSlice per pulled slice, then ExchangeDone.
        """
        if not push and not pull:
            raise EmptyRequestError(f"exchange from {stamp.worker_id!r}: nothing to push or pull")
        self._check_limits("exchange", stamp, push, pull)
        if push and self.lease is not None:  # first: the ownership checked next may change with the renewal
            await self._await_lease(stamp, timeout_s)
        self._check_owned([*(m.key for m in push), *pull])
        owned = self._owned
        self._promote([*(m.key for m in push), *pull])
        store = self._store_holding([m.key for m in push] or pull)
        store.check_push(push)
        store.specs(pull)
        deadline = self._deadline(timeout_s)
        await self._await_view(stamp, deadline)
        store.check_request(stamp, push, pull)  # the header, whole, before any gradient is read
        if packs:
            self._check_packs(store, stamp, pull, packs)
        # The worker pushed step `clock`; what it pulls back is for its next step.
        pull_stamp = stamp._replace(clock=stamp.clock + 1) if push else stamp
        counts = [0, 0]
        # Set once this request's own gradient for the slice has been handed to the store: the pull
        # must not be checked (or read) before it, or an async pull at clock + 1 looks like a read from
        # the future, a bad push's error loses to a pull error, and the read misses the worker's own update.
        pushed = {m.key: asyncio.Event() for m in push}

        async def consume() -> None:
            async for index, wire in gradients:
                key = push[index].key
                outcome = self._push_now(store, stamp, [(key, wire)])
                counts[0] += outcome.applied
                counts[1] += outcome.dropped
                pushed[key].set()
                await self.replication.hand_off()  # its senders copy this slice while the next applies

        reader = asyncio.ensure_future(consume())
        try:
            versions: list[int] = []
            for key in pull:
                own = pushed.get(key)
                if (own is not None and not own.is_set()) or store.pull_status(pull_stamp, [key]) is not None:
                    yield Stall()
                    await self._wait_ready_or_failed(pull_stamp, key, deadline, reader, own)
                pack = packs[len(versions)] if packs else None
                if pack is not None and pack.packed:
                    wire, version = self._read_packed(store, pull_stamp, key, pack)
                    payload = encode(wire)
                else:
                    version, payload = self._encode(store, key, encode)
                await self._settle([key], deadline)  # the version sent lives on the backups
                versions.append(version)
                yield EncodedSlice(key, version, payload)
            await reader  # the push side must be complete (and its errors raised) before the summary
            await self._settle([m.key for m in push], deadline)
            self._check_kept(owned, [*(m.key for m in push), *pull],
                             f"exchange by {stamp.worker_id!r} at clock {stamp.clock}")
            self.pulls_served += bool(pull)
            yield ExchangeDone(versions, counts[0], counts[1])
        finally:
            if not reader.done():
                reader.cancel()

    async def _wait_ready_or_failed(self, stamp: Stamp, key: SliceKey, deadline: float,
                                    reader: asyncio.Future[None], own: asyncio.Event | None) -> None:
        """Wait for the request's own push of `key` (if any), then for `key` to be readable;
        a failed push side ends the wait with its error at once."""
        async def ready() -> None:
            if own is not None:
                try:
                    await asyncio.wait_for(own.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise PullTimeoutError(f"exchange from {stamp.worker_id!r}: the gradient of slice "
                                           f"{quote(str(key))} did not arrive before the request's deadline"
                                           ) from None
            await self._wait_readable(stamp, [key], deadline)

        waiter = asyncio.ensure_future(ready())
        try:
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            await waiter
        finally:
            waiter.cancel()

    def _encode(self, store: ShardStore, key: SliceKey, encode: Encoder[P]) -> tuple[int, P]:
        """(version, encode(value in the wire dtype)): the value is copied once, under the slice's
        lock, by the encoder itself; in sync mode the result is shared by every worker's pull."""
        cached = self._encoded.get((encode, key))
        if cached is not None and cached[0] == store.version(key):
            return cached  # type: ignore[return-value]

        def encode_value(value: np.ndarray, dtype: np.dtype, version: int) -> tuple[int, P]:
            if value.dtype != dtype:  # a float16 slice's float32 master
                value = value.astype(dtype)
            return version, encode(self._to_wire(WireArray(value, dtype_name(dtype))))

        result = store.read_with(key, encode_value)
        if store.config.mode == "sync":
            self._encoded[(encode, key)] = result
        return result

    def forget_encoder(self, encode: Hashable) -> None:
        """Drop what sync mode cached for `encode` (a transport session that ended)."""
        for entry in [e for e in self._encoded if e[0] == encode]:
            del self._encoded[entry]

    # ---- operations ----

    def stats(self) -> ServerStats:
        store = self._store
        return ServerStats(job=store.config if store else None, store=store.stats() if store else None,
                           pulls_served=self.pulls_served, pulls_waiting=self._changes.waiting,
                           pulls_timed_out=self.pulls_timed_out, transports=self.transport_report(),
                           hangs=tuple(store.hangs(self._settings.hang_report_s))
                           if store and self._settings.hang_report_s > 0 else (),
                           replication_lag=self.replication.lag(),
                           failovers=self.failovers)

    async def snapshot_at(self, at_version: int, timeout_s: float | None = None) -> ShardSnapshot:
        """A copy of the shard once every slice reached `at_version` (a global checkpoint's part)."""
        store = await self._await_min_version(at_version, timeout_s, f"checkpoint at clock {at_version}")
        return store.snapshot()

    async def _await_min_version(self, at_version: int, timeout_s: float | None, what: str) -> ShardStore:
        """The store, once every slice reached `at_version`; PullTimeoutError naming `what` if not in time."""
        store = self.store
        timeout_s = timeout_s if timeout_s is not None else self._settings.pull_timeout_s
        ok = await self._changes.wait_for(
            lambda: True if store.stats().min_version >= at_version else None, time.monotonic() + timeout_s)
        if ok is None:
            raise PullTimeoutError(f"{what}: slices are still at "
                                   f"version {store.stats().min_version} after {timeout_s:.1f}s")
        return store

    async def install_restored(self, make: Callable[[], ShardStore]) -> bool:
        """Configure the server with `make()` (a restored global checkpoint) unless a Declare or an
        earlier restore already did (or the server restored its own shard checkpoint: it is newer);
        True if installed. `make` runs under the config lock, so a Declare racing a restore waits for
        it and then finds the restored slices; build anything slow beforehand."""
        async with self._config_lock:
            if self._store is not None:
                return False
            self._install(make())
            return True

    async def checkpoint(self, at_version: int = 0, timeout_s: float | None = None) -> tuple[Path, int]:
        """Save the shard once every slice reached `at_version`; (path, the slices' min version)."""
        if not self._settings.checkpoint_dir:
            raise InvalidArgumentError("checkpoint: this server was started without --checkpoint-dir")
        store = await self._await_min_version(at_version, timeout_s, f"checkpoint at version {at_version}")
        folder = Path(self._settings.checkpoint_dir)
        async with self._checkpoint_lock:
            snap = store.snapshot()
            try:
                path = await asyncio.get_running_loop().run_in_executor(
                    None, save_shard, folder, snap, self._settings.shard_name)
                if self.after_checkpoint is not None:  # the sparse tables join the shard's checkpoint
                    await self.after_checkpoint()
            except OSError as err:  # a full or read-only disk: its errno, not UNKNOWN
                raise checkpoint_write_error(err, folder) from None
        return path, min(s.version for s in snap.slices) if snap.slices else 0
