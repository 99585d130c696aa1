"""Shard replication (docs/architecture.md, 9 Failures): a primary makes every optimizer step it
takes reach its backups before it acknowledges.

What travels is the slice's state after its newest step (value, optimizer state, version, per-worker
clocks, SSP floors, scheduled calls' push numbers), taken under the slice's lock: the backup's copy is
the primary's bytes, so it is bit-identical, and a worker that resends after a failover, or a
coordinator's call re-dispatched to another worker, is deduplicated by it exactly as by the primary.
Steps taken while a state is on its way coalesce into the next one (async and SSP pushes are batched
that way), and a backup that restarted or joined just gets every slice's state: a copy that catches up
while training goes on.

Where the bytes go is each backup's link (ps_server/replication/backends.py): with a backup on the
same host, into shared-memory segments both map, so a call carries only metadata; with one that
cannot map them, as the data of a frame on a raw TCP link to the backup's fast-path listener, else,
or when it breaks, as Replicate calls with the bytes inline. The sender sees only the link. Backups
also still replay step records (ps_server/replication/records.py `step_record`: an update and how
many gradients it sums, run through the same element-wise optimizer), the form of older primaries.

Per backup one sender task: it ships the due slices in the order they became due (batches up to
its link's `batch_bytes`, one Replicate call at a time, retried until acknowledged or the backup
leaves the view), so the first slices of a sync clock are acknowledged while later ones are still applied.
Steps get one global sequence number; a request is acknowledged once every current backup holds a
state of each of its slices at least as new as the request's steps (`settle`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pshard.common.errors import PullTimeoutError
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey
from pshard.common.wire import codec
from pshard.ps_server.core.optimizers import Optimizer, SliceState, make_optimizer
from pshard.ps_server.core.policies import NO_CLOCK, Slot
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.replication.backends import Backend, Links, Send, link_to
from pshard.ps_server.replication.records import Record
from pshard.ps_server.replication.shm import SegmentMaps, specs_bytes, state_specs

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.replication")

_IN_FLIGHT = 2  # calls per backup at once (on different slices)
_RETRY_S = (0.05, 1.0)  # first and longest wait between attempts to reach a backup


class ReplicaSet:
    """Backup side: copies of other servers' slices, replayed from their records; promoted on failover."""

    def __init__(self, shm_dir: str | None = None) -> None:
        self.config: JobConfig | None = None
        # Same-host primaries' segments (ps_server/replication/shm.py); None: states come inline only.
        self._segments = SegmentMaps(shm_dir) if shm_dir is not None else None
        self._optimizer: Optimizer | None = None
        self._slots: dict[SliceKey, Slot] = {}
        self._origin: dict[SliceKey, str] = {}  # which primary each copy came from
        self._where: dict[SliceKey, str] = {}  # the segment a copy is a view of ("": its own arrays)
        self._lock = threading.Lock()
        self.records_applied = 0

    def release(self, primary: str) -> int:
        """Drop the copies `primary` sent (it forwards elsewhere now); how many. A stale copy kept would
        cost memory, and could be promoted after a second failure instead of failing loudly."""
        with self._lock:
            keys = [k for k, origin in self._origin.items() if origin == primary]
            for key in keys:
                self._slots.pop(key, None)
                self._where.pop(key, None)
                del self._origin[key]
            if self._segments is not None:
                self._segments.drop(primary)
            return len(keys)

    def apply(self, config: JobConfig, records: Iterable[Record], primary: str = "",
              segments: Sequence[str] = ()) -> list[SliceKey]:
        """Replay `records` in order; the slices whose history has a gap, or whose state lies in shared
        memory this server cannot map (their state is needed inline). `segments`: the shared-memory
        segments `primary` writes now."""
        with self._lock:
            if self.config != config:
                self.config, self._optimizer = config, make_optimizer(config.optimizer)
                self._slots.clear()
                self._origin.clear()  # another job's (or a reconfigured) copies mean nothing now
                self._where.clear()
                if self._segments is not None:
                    self._segments.drop()
            need: list[SliceKey] = []
            for r in records:
                if r.key in need:
                    continue
                slot = self._slots.get(r.key)
                if r.segment:
                    mapped = self._mapped(r, primary)
                    if mapped is None:
                        need.append(r.key)
                        continue
                    r = mapped
                if r.state:
                    # Another primary's copy (one that went, whose slices this one took over) is replaced
                    # whatever its version: this server holds what its primary now has, never a newer
                    # state the old one never got acknowledged.
                    if slot is None or r.version >= slot.version or self._origin.get(r.key) != primary:
                        self._slots[r.key] = self._from_state(r)
                        self._origin[r.key] = primary
                        self._where[r.key] = r.segment
                        self.records_applied += 1
                    continue
                if slot is None or slot.version < r.version - 1 or not slot.value.flags.writeable:
                    need.append(r.key)
                    continue
                if slot.version >= r.version:
                    continue  # already replayed (a batch resent after a lost reply)
                # The primary's very step; a sum is scratch to it (divided in place), one gradient only read.
                slot.apply_mean(np.array(r.value, copy=True) if r.summed > 1 else r.value, r.summed)
                slot.last_clock = dict(r.clocks)
                slot.scheduled.update(r.scheduled or {})  # an older primary's step record has none
                slot.max_clock = max(slot.max_clock, max(r.clocks.values(), default=NO_CLOCK))
                self.records_applied += 1
            if self._segments is not None:  # unmap what neither a copy nor the primary uses any more
                used = {self._where.get(k, "") for k, origin in self._origin.items() if origin == primary}
                self._segments.keep(primary, used | set(segments))
            return need

    def _mapped(self, r: Record, primary: str) -> Record | None:
        """`r` with its arrays as views of `primary`'s segment; None if this server cannot map it."""
        try:
            if self._segments is None:
                raise OSError("no shared-memory directory")
            arrays = self._segments.arrays(primary, r.segment, r.offset, r.specs)
        except (OSError, ValueError) as e:
            log.warning("replication: cannot map %s's segment %s (%s); asking for the state inline",
                        primary, r.segment, e)
            return None
        opt: SliceState = {**(r.opt_state or {}), **{n: a for n, a in arrays.items() if n}}
        return r._replace(value=arrays[""], opt_state=opt)

    def _from_state(self, r: Record) -> Slot:
        assert self._optimizer is not None and r.opt_state is not None
        return Slot(key=r.key, dtype=np.dtype(r.dtype), value=np.ascontiguousarray(r.value),
                    optimizer=self._optimizer, opt_state=r.opt_state, version=r.version,
                    last_clock=dict(r.clocks), max_clock=max(r.clocks.values(), default=NO_CLOCK),
                    floors=dict(r.floors or {}), scheduled=dict(r.scheduled or {}))

    def holds(self, key: SliceKey) -> bool:
        with self._lock:
            return key in self._slots

    @property
    def empty(self) -> bool:
        return not self._slots  # a racy read is fine: a request routed here after a failover finds them

    def take(self, keys: Iterable[SliceKey]) -> list[Slot]:
        """Hand over the copies of `keys` (those held) to become this server's own slices: arrays of
        their own (a copy may be a read-only view of its old primary's shared memory)."""
        with self._lock:
            for key in keys:
                self._origin.pop(key, None)
                self._where.pop(key, None)
            slots = [self._slots.pop(k) for k in keys if k in self._slots]
        for slot in slots:
            if not slot.value.flags.writeable:
                slot.value = slot.value.copy()
                slot.opt_state = {n: v.copy() if isinstance(v, np.ndarray) else v
                                  for n, v in slot.opt_state.items()}
        return slots

    def keys(self) -> list[SliceKey]:
        with self._lock:
            return sorted(self._slots)


@dataclass
class _Backup:
    address: str
    link: Backend  # how batches reach it (ps_server/replication/backends.py): where it falls back to
    # Slices whose newest step this backup lacks, in the order they became due (the send order).
    pending: dict[SliceKey, None] = field(default_factory=dict)
    need: dict[SliceKey, int] = field(default_factory=dict)  # the newest sequence number it must hold
    acked: dict[SliceKey, int] = field(default_factory=dict)  # the sequence number its copy is at
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    task: asyncio.Task[None] | None = None
    failing_since: float | None = None
    # Bumped when the backup is a new process: a reply of the old one acknowledges nothing, and the
    # segments it mapped mean nothing to the new one (the sender resets its link before its next call).
    incarnation: int = 0
    link_incarnation: int = 0
    flying: set[SliceKey] = field(default_factory=set)  # slices of the calls in flight
    failed: bool = False  # a call failed: reset and wait before the next
    # A joiner (issue 20) copying beyond this server's backups: acknowledgements wait for it only once it
    # holds every slice (`holds`), so a joiner that is slow, held or killed mid-copy stalls no step.
    joining: bool = False
    holds: bool = True  # acknowledgements wait for it (always for a backup; for a joiner once caught up)
    # A targeted copy's target (issue 20, a drain without replicas): it takes only these slices, as a
    # joiner does (None: a backup, which takes every slice).
    slices: frozenset[SliceKey] | None = None

    def takes(self, key: SliceKey) -> bool:
        return self.slices is None or key in self.slices

    def due(self, key: SliceKey, seq: int) -> None:
        self.need[key] = seq
        self.pending.setdefault(key, None)

    def behind(self, targets: dict[SliceKey, int]) -> bool:
        return any(self.acked.get(k, 0) < min(t, self.need.get(k, 0)) for k, t in targets.items())


class Replicator:
    """Primary side: ships the state of each slice that took a step to its backups, and tracks their acks.

    `send(address, request)` is a blocking Replicate call (run in a thread); `own` names this
    server in the requests; `shm_dir`: try shared memory with each backup first (None: none);
    `links`: without shared memory, the raw TCP links to try before gRPC (None: gRPC only).
    Lives on the server's event loop; the store hook may run on any thread.
    """

    def __init__(self, own: str, send: Send, loop: asyncio.AbstractEventLoop,
                 shm_dir: str | None = None, links: Links | None = None) -> None:
        self.own = own
        self._send = send
        self._links = links
        self._loop = loop
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._seq = 0
        self._last_seq: dict[SliceKey, int] = {}
        self._sizes: dict[SliceKey, int] = {}  # bytes of a slice's state
        self._backups: dict[str, _Backup] = {}
        # What the scheduler's view asks for: the backups (ring order), the joiners among them, and the
        # targeted copies (target -> the slices it takes); `_reconcile` makes `_backups` of them.
        self._wanted: list[str] = []
        self._catching_up: frozenset[str] = frozenset()
        self._copies: dict[str, frozenset[SliceKey]] = {}
        self._switched: frozenset[str] = frozenset()  # copy targets the layout switched their slices to
        self._store: ShardStore | None = None
        # Requests waiting for acknowledgements: what each needs, and the future to resolve (True: held).
        self._waiters: list[tuple[dict[SliceKey, int], asyncio.Future[bool]]] = []
        self._config_cache: tuple[JobConfig, pb.JobConfig] | None = None

    # ---- wiring ----

    def attach(self, store: ShardStore) -> None:
        """Replicate `store`'s slices from now on (the server's store, once configured)."""
        self._store = store
        store.set_step_hook(self._on_step)
        self.seed([s.key for s in store.slots()])

    def set_backups(self, addresses: Sequence[str], catching_up: Collection[str] = ()) -> None:
        """The backups this server forwards to now (from the scheduler's view, ring order); those in
        `catching_up` are joiners, which acknowledgements wait for only once they hold every slice."""
        self._wanted, self._catching_up = list(dict.fromkeys(addresses)), frozenset(catching_up)
        self._reconcile()

    def set_copies(self, copies: Mapping[str, Collection[SliceKey]], switched: Collection[str] = ()) -> None:
        """The slices this server copies to each target now, a server that is not a backup of it (issue 20:
        a drain without replicas): a catch-up copy of their states, then each of their steps, as to a
        joiner. Acknowledgements wait for a target only once it holds them all, so a slow or dead target
        stalls no step; from then on they do, which makes it a copy the scheduler can switch them to. A
        backup takes every slice already: a copy to it adds nothing. `switched`: the targets the layout
        gave their slices to (the views name those copies until the targets took them over); their copies
        are theirs, never released from here."""
        self._copies = {a: frozenset(k) for a, k in copies.items() if k and a != self.own}
        self._switched |= frozenset(switched) & frozenset(self._copies)
        self._reconcile()

    def _reconcile(self) -> None:
        """Peers for the backups and the copies wanted now: new ones start with a copy, gone ones stop."""
        wanted: dict[str, frozenset[SliceKey] | None] = dict(self._copies)
        wanted.update((a, None) for a in self._wanted)
        catching_up = self._catching_up | frozenset(self._copies)
        with self._lock:
            gone = [b for a, b in self._backups.items() if a not in wanted]
            new = [a for a in wanted if a not in self._backups]
            grown = {a for a, b in self._backups.items() if a in wanted and _grows(b.slices, wanted[a])}
            for b in gone:
                b.closed = True
                del self._backups[b.address]
            for address in new:
                self._backups[address] = _Backup(address, link_to(address, self.own, self._send, self._links,
                                                                  self._shm_dir))
            for address, b in self._backups.items():
                b.slices = wanted[address]
                b.joining = address in catching_up
                if not b.joining:
                    b.holds = True
                elif address in new or address in grown:
                    b.holds = False
        for b in gone:
            b.wake.set()
            if b.slices is None:
                log.warning("replication: %s is no longer a backup of %s (%d slices unsent)", b.address,
                            self.own, len(b.pending))
            elif b.address in self._switched:
                # Switched to it: it takes its copies over at the layout that moved them (`set_ownership`);
                # a release from here could reach it before that layout, and drop them.
                log.info("replication: %s took over %d slices of %s", b.address, len(b.slices), self.own)
                b.link.close()
                continue
            else:
                log.warning("replication: the copy of %d slices of %s to %s was rolled back", len(b.slices),
                            self.own, b.address)
            self._loop.run_in_executor(None, self._release, b)
        self._switched &= frozenset(self._copies)
        for address in new:
            backup = self._backups.get(address)
            if backup is not None:
                backup.task = self._loop.create_task(self._sender(backup))
                log.info("replication: %s backs up %s; copying its slices", address, self.own)
        if (new or grown) and self._store is not None:
            self.seed([s.key for s in self._store.slots()])
        if gone or grown:
            self._wake()

    @property
    def backups(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._backups)

    def close(self) -> None:
        # A copy in progress is the scheduler's to roll back (this server is gone); a switched one is its
        # target's: neither is released from here.
        self._switched |= frozenset(self._copies)
        self._copies = {}
        self.set_backups([])

    # ---- recording ----

    def _on_step(self, slot: Slot, update: np.ndarray, count: int) -> None:
        # Under the slice's lock, before the step: the sender snapshots under that lock too, so what it
        # ships covers every step recorded so far. Nothing is copied here: steps in between coalesce.
        with self._lock:
            if not self._backups:
                return
            self._seq += 1
            self._last_seq[slot.key] = self._seq
            if slot.key not in self._sizes:
                self._sizes[slot.key] = specs_bytes(state_specs(slot))
            backups = list(self._backups.values())
            backups = [b for b in backups if b.takes(slot.key)]
            for b in backups:
                b.due(slot.key, self._seq)
        for b in backups:
            self._loop.call_soon_threadsafe(b.wake.set)

    def seed(self, keys: Iterable[SliceKey]) -> None:
        """Make each of `keys` (this server's slices) due to every backup that lacks it."""
        store = self._store
        if store is None:
            return
        wanted = set(keys)
        woken: list[_Backup] = []
        for slot in store.slots():
            if slot.key not in wanted:
                continue
            with slot.lock, self._lock:
                self._sizes[slot.key] = specs_bytes(state_specs(slot))
                for b in self._backups.values():
                    if slot.key in b.acked or slot.key in b.pending or not b.takes(slot.key):
                        continue
                    self._seq += 1
                    b.due(slot.key, self._seq)
                    self._last_seq[slot.key] = self._seq
                    woken.append(b)
        for b in woken:
            self._loop.call_soon_threadsafe(b.wake.set)

    # ---- acknowledging ----

    def _targets(self, keys: Iterable[SliceKey] | None) -> dict[SliceKey, int]:
        with self._lock:
            if keys is None:
                return dict(self._last_seq)
            return {k: self._last_seq[k] for k in keys if k in self._last_seq}

    def _behind(self, targets: dict[SliceKey, int]) -> list[_Backup]:
        with self._lock:
            return [b for b in self._backups.values() if b.holds and b.behind(targets)]

    async def settle(self, keys: Iterable[SliceKey] | None, deadline: float) -> None:
        """Return once every step so far of `keys` (None: of every slice) is on every backup."""
        targets = self._targets(keys)
        if not targets or not self._behind(targets):
            return
        # A future per waiting request, resolved by the acknowledgement that completes it: no task of
        # its own, and an acknowledgement wakes only the requests it completes.
        held: asyncio.Future[bool] = self._loop.create_future()
        self._waiters.append((targets, held))
        timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), _expire, held)
        try:
            complete = await held
        finally:
            timer.cancel()
        if not complete:
            behind = self._behind(targets)
            if behind:
                raise PullTimeoutError(
                    "replication: backups " + ", ".join(f"{b.address} ({len(b.pending)} slices unsent)"
                                                        for b in behind)
                    + f" did not acknowledge {self.own}'s updates before the request's deadline")

    async def hand_off(self) -> None:
        """One turn of the event loop, in which the senders start on the slice just applied."""
        await asyncio.sleep(0)

    def lag(self) -> int:
        """Slices whose newest step the slowest backup has yet to acknowledge (the replication lag gauge)."""
        with self._lock:
            return max((len(b.pending) for b in self._backups.values()), default=0)

    def copy_bytes_left(self) -> int:
        """Bytes of slice states the slowest backup still lacks: a joiner's catch-up copy left to come from
        this server, its donor (`pshard status`), or, in steady state, the steps in flight."""
        with self._lock:
            return max((sum(self._sizes.get(k, 0) for k in b.pending) for b in self._backups.values()),
                       default=0)

    def in_sync(self, keys: Iterable[SliceKey]) -> list[str]:
        """The backups holding an acknowledged copy of each of `keys` (this server's slices): from
        then on no step is acknowledged before they have it too (docs/architecture.md, 9 Failures)."""
        wanted = list(keys)
        # Read before the lock, as `_shipped` does.
        own = list(self._store.slots()) if self._store is not None else []
        with self._lock:
            if not wanted and not own:
                # A server without slices (a table's rows only, say) has no state or step a joiner could
                # lack, and no copy would ever ship to make it hold: it holds now (else its join never
                # switched). A slice declared later is then copied to it as to any backup.
                for b in self._backups.values():
                    if b.joining and b.slices is None and not b.holds and not b.pending:
                        b.holds = True
                        log.info("replication: joiner %s holds %s's slices (it has none)", b.address,
                                 self.own)
            return [a for a, b in self._backups.items()
                    if b.slices is None and b.holds and all(k in b.acked for k in wanted)]

    def copies_in_sync(self) -> list[str]:
        """The targets of targeted copies holding an acknowledged copy of each slice they take (from then
        on no step of those is acknowledged before they have it too): the scheduler may switch them."""
        with self._lock:
            return [a for a, b in self._backups.items() if b.slices is not None and b.holds]

    def restarted(self, address: str) -> None:
        """The backup at `address` is a new process: what its old one acknowledged is gone; copy
        every slice to it again."""
        with self._lock:
            b = self._backups.get(address)
            if b is None:
                return
            b.acked.clear()
            b.pending.clear()
            b.need.clear()
            b.incarnation += 1  # the sender drops an in-flight reply and starts fresh segments
            b.holds = not b.joining
        log.info("replication: backup %s restarted; copying %s's slices to it again", address, self.own)
        if self._store is not None:
            self.seed([s.key for s in self._store.slots()])

    def _wake(self) -> None:
        """On the event loop: resolve the waiting requests whose steps every backup now holds."""
        if not self._waiters:
            return
        waiting = []
        for targets, held in self._waiters:
            if held.done():
                continue  # timed out, or its request was cancelled
            if self._behind(targets):
                waiting.append((targets, held))
            else:
                held.set_result(True)
        self._waiters = waiting

    # ---- sending ----

    def _batch(self, b: _Backup) -> list[SliceKey]:
        limit = b.link.batch_bytes
        with self._lock:
            batch: list[SliceKey] = []
            size = 0
            for key in b.pending:
                if key in b.flying:  # one state of a slice in flight at a time: its slots alternate
                    continue
                if batch and size + self._sizes.get(key, 0) > limit:
                    break
                batch.append(key)
                size += self._sizes.get(key, 0)
            b.flying.update(batch)
            return batch

    async def _sender(self, b: _Backup) -> None:
        """Keeps up to `_IN_FLIGHT` calls going to `b`, on different slices: one batch is copied while
        the call of the one before is on its way. After a failure, or when the backup is a new
        process, it lets the calls in flight end, then resets the segments (and waits, after a failure)."""
        delay = _RETRY_S[0]
        calls: set[asyncio.Task[None]] = set()
        while not b.closed:
            await b.wake.wait()
            b.wake.clear()
            while not b.closed:
                if b.failed or (b.link.segmented and b.link_incarnation != b.incarnation):
                    if calls:
                        break  # each call ending wakes this loop
                    b.link.reset()
                    b.link_incarnation = b.incarnation
                    if b.failed:
                        b.failed = False
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, _RETRY_S[1])
                    continue
                if len(calls) >= _IN_FLIGHT:
                    break
                batch = self._batch(b)
                if not batch:
                    break
                if b.failing_since is None:
                    delay = _RETRY_S[0]
                call = self._loop.create_task(self._call(b, batch, b.incarnation))
                calls.add(call)

                def ended(call: asyncio.Task[None]) -> None:
                    calls.discard(call)
                    b.wake.set()  # only now: a wake-up while the call still counts as in flight is lost
                call.add_done_callback(ended)

    async def _call(self, b: _Backup, batch: list[SliceKey], incarnation: int) -> None:
        try:
            # The copy (or encoding) and the call, off the event loop.
            shipped, need = await self._loop.run_in_executor(None, self._ship, b, batch)
        except Exception as e:  # unreachable, restarting, refusing: the slices stay due
            b.failed = True
            if b.failing_since is None:
                b.failing_since = time.monotonic()
                log.warning("replication: backup %s unreachable (%s); retrying until it is back or "
                            "the scheduler declares it gone", b.address, e)
            return
        finally:
            with self._lock:
                b.flying.difference_update(batch)
        if b.failing_since is not None:
            log.info("replication: backup %s reachable again after %.1fs", b.address,
                     time.monotonic() - b.failing_since)
            b.failing_since = None
        if b.incarnation != incarnation:
            return  # the old process's acknowledgement: the slices are due again
        self._shipped(b, shipped, need)
        self._wake()

    def _ship(self, b: _Backup, keys: Sequence[SliceKey]) -> tuple[dict[SliceKey, int], list[SliceKey]]:
        """Snapshot `keys` (each under its lock) into one Replicate call to `b`, the way its link lays
        them out: the sequence number each shipped state covers, and the slices the backup could not take."""
        store = self._store
        slots = store.find(keys) if store is not None else {}
        config = self._config_proto(store.config if store is not None else JobConfig())
        link = b.link = b.link.prepare([slots[k] for k in keys if k in slots])
        shipped: dict[SliceKey, int] = {}
        records: list[pb.ReplicaRecord] = []
        arrays: list[np.ndarray] = []  # the records' bytes the link sends after the message, if any
        for key in keys:
            slot = slots.get(key)
            if slot is None:  # no longer ours (moved away): nothing to hold
                with self._lock:
                    shipped[key] = b.need.get(key, 0)
                continue
            with slot.lock:
                with self._lock:
                    shipped[key] = b.need.get(key, 0)
                records.append(link.record(slot, arrays))
        reply = link.call(pb.ReplicateRequest(primary=self.own, config=config, records=records), arrays)
        return shipped, [codec.slice_id_from_proto(k) for k in reply.need_state]

    def _config_proto(self, config: JobConfig) -> pb.JobConfig:
        """The job's config as every call carries it, encoded once (it changes only with a new job)."""
        cached = self._config_cache
        if cached is None or cached[0] is not config:
            cached = self._config_cache = (config, codec.job_to_proto(config))
        return cached[1]

    def _shipped(self, b: _Backup, shipped: dict[SliceKey, int], need: Sequence[SliceKey]) -> None:
        refused = set(need)
        # Read before the lock (the store's own lock is taken before ours where a step is recorded).
        own = [s.key for s in self._store.slots() if b.takes(s.key)] \
            if self._store is not None and not b.holds else []
        with self._lock:
            for key, seq in shipped.items():
                if key in refused:
                    continue
                b.acked[key] = max(b.acked.get(key, 0), seq)
                if b.need.get(key, 0) <= b.acked[key]:
                    b.pending.pop(key, None)
            if not b.holds and not b.pending and all(k in b.acked for k in own):
                # Every step recorded so far is on it (under the lock no step is recorded meanwhile): from
                # now on none is acknowledged before it has it too, so it counts as an in-sync copy.
                b.holds = True
                log.info("replication: %s %s caught up with %s; acknowledgements wait for it from now on",
                         "joiner" if b.slices is None else "copy target", b.address, self.own)
        b.link.acknowledged(k for k in shipped if k not in refused)
        if refused:
            b.link = b.link.refused()
            b.wake.set()

    def _release(self, b: _Backup) -> None:
        """Tell a former backup to drop our copies; best effort (a dead one has nothing to drop)."""
        b.link.close()
        try:
            self._send(b.address, pb.ReplicateRequest(primary=self.own, release=True))
        except Exception as e:
            log.debug("replication: could not release %s: %s", b.address, e)


def _grows(before: frozenset[SliceKey] | None, after: frozenset[SliceKey] | None) -> bool:
    """A peer that takes more slices than before (a copy's target that became a backup, or that takes
    more): it lacks their copies, and is caught up again only once it holds them."""
    return before is not None and (after is None or bool(after - before))


def _expire(held: asyncio.Future[bool]) -> None:
    if not held.done():
        held.set_result(False)
