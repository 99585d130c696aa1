"""Shard replication (docs/architecture.md, 9 Failures): a primary forwards every optimizer step it
takes to its backups before it acknowledges; a backup replays them.

What travels is the step's input, not its result: the gradient of an async or SSP push, or a sync
clock's sum with the number of gradients it holds. A backup runs the same element-wise optimizer on
the same bytes (`Slot.apply` / `Slot.apply_mean`), so its weights and optimizer state stay
bit-identical to the primary's. Each record also carries the slice's per-worker clocks, so a worker
that resends after a failover is deduplicated by the backup exactly as by the primary.

A slice's first record to a backup is always its whole state (value, optimizer state, version,
clocks); then its steps follow in version order. A backup that lacks a slice's earlier history (it
restarted, or a record came before its state) answers `need_state`, and the primary sends the state
again, taken under the slice's lock: a copy that catches up while training goes on.

Per backup one ordered queue and one sender task (batches up to `_BATCH_BYTES`, one Replicate call
at a time, retried until it is acknowledged or the backup leaves the view). Records get one global
sequence number; a request is acknowledged once every current backup acknowledged the records of
its slices (`settle`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from pshard.common import codec
from pshard.common.errors import PullTimeoutError
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey
from pshard.ps_server.optimizers import Optimizer, SliceState, make_optimizer
from pshard.ps_server.policies import NO_CLOCK, Slot
from pshard.ps_server.store import ShardStore

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.replication")

# One Replicate call carries records up to this many bytes (at least one record): a round trip costs
# milliseconds on a loaded host, so a big shard's step goes in a few calls; the servers' message
# limit (64 MiB by default) leaves room for a 4 MiB slice's state with Adam's two arrays on top.
_BATCH_BYTES = 32 * 2**20
_RETRY_S = (0.05, 1.0)  # first and longest wait between attempts to reach a backup


class Record(NamedTuple):
    seq: int
    key: SliceKey
    version: int  # the slice's version once applied
    state: bool  # True: the whole slice; False: one step
    value: np.ndarray  # state: the master value; step: the update
    summed: int  # step: how many gradients `value` sums
    clocks: dict[str, int]
    dtype: str = ""  # state: the declared dtype
    opt_state: SliceState | None = None
    floors: dict[str, int] | None = None

    @property
    def nbytes(self) -> int:
        extra = sum(v.nbytes for v in (self.opt_state or {}).values() if isinstance(v, np.ndarray))
        return self.value.nbytes + extra


def step_record(slot: Slot, update: np.ndarray, count: int, seq: int) -> Record:
    """Called under the slice's lock, before the step: `update` may be scratch or a network buffer."""
    return Record(seq, slot.key, slot.version + 1, False, np.array(update, copy=True), count,
                  dict(slot.last_clock))


def state_record(slot: Slot, seq: int) -> Record:
    """The whole slice, under its lock."""
    state = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in slot.opt_state.items()}
    return Record(seq, slot.key, slot.version, True, slot.value.copy(), 0, dict(slot.last_clock),
                  slot.dtype.name, state, dict(slot.floors))


def record_to_proto(r: Record) -> pb.ReplicaRecord:
    msg = pb.ReplicaRecord(id=codec.slice_id_to_proto(r.key), version=r.version, state=r.state,
                           value=codec.tensor_to_proto(codec.WireArray(r.value, r.value.dtype.name)),
                           count=r.summed, clocks=r.clocks)
    if r.state:
        msg.dtype = codec.dtype_to_proto(r.dtype)
        msg.floors.update(r.floors or {})
        for name, v in (r.opt_state or {}).items():
            if isinstance(v, np.ndarray):
                msg.opt_arrays[name].CopyFrom(codec.tensor_to_proto(codec.WireArray(v, v.dtype.name)))
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                msg.opt_ints[name] = int(v)
            else:
                msg.opt_floats[name] = float(v)
    return msg


def record_from_proto(msg: pb.ReplicaRecord) -> Record:
    key = codec.slice_id_from_proto(msg.id)
    value = codec.tensor_from_proto(msg.value, f"replica {key}").array
    if not msg.state:
        return Record(0, key, msg.version, False, value, max(1, msg.count), dict(msg.clocks))
    opt: SliceState = {n: np.array(codec.tensor_from_proto(t, f"replica {key} {n}").array, copy=True)
                       for n, t in msg.opt_arrays.items()}
    opt.update(dict(msg.opt_ints))
    opt.update(dict(msg.opt_floats))
    return Record(0, key, msg.version, True, np.array(value, copy=True), 0, dict(msg.clocks),
                  codec.dtype_from_proto(msg.dtype), opt, dict(msg.floors))


class ReplicaSet:
    """Backup side: copies of other servers' slices, replayed from their records; promoted on failover."""

    def __init__(self) -> None:
        self.config: JobConfig | None = None
        self._optimizer: Optimizer | None = None
        self._slots: dict[SliceKey, Slot] = {}
        self._origin: dict[SliceKey, str] = {}  # which primary each copy came from
        self._lock = threading.Lock()
        self.records_applied = 0

    def release(self, primary: str) -> int:
        """Drop the copies `primary` sent (it forwards elsewhere now); how many. A stale copy kept would
        cost memory, and could be promoted after a second failure instead of failing loudly."""
        with self._lock:
            keys = [k for k, origin in self._origin.items() if origin == primary]
            for key in keys:
                self._slots.pop(key, None)
                del self._origin[key]
            return len(keys)

    def apply(self, config: JobConfig, records: Iterable[Record], primary: str = "") -> list[SliceKey]:
        """Replay `records` in order; the slices whose history has a gap (their state is needed)."""
        with self._lock:
            if self.config != config:
                self.config, self._optimizer = config, make_optimizer(config.optimizer)
                self._slots.clear()
                self._origin.clear()  # another job's (or a reconfigured) copies mean nothing now
            need: list[SliceKey] = []
            for r in records:
                if r.key in need:
                    continue
                slot = self._slots.get(r.key)
                if r.state:
                    if slot is None or r.version >= slot.version:
                        self._slots[r.key] = self._from_state(r)
                        self._origin[r.key] = primary
                        self.records_applied += 1
                    continue
                if slot is None or slot.version < r.version - 1:
                    need.append(r.key)
                    continue
                if slot.version >= r.version:
                    continue  # already replayed (a batch resent after a lost reply)
                # The primary's very step; a sum is scratch to it (divided in place), one gradient only read.
                slot.apply_mean(np.array(r.value, copy=True) if r.summed > 1 else r.value, r.summed)
                slot.last_clock = dict(r.clocks)
                slot.max_clock = max(slot.max_clock, max(r.clocks.values(), default=NO_CLOCK))
                self.records_applied += 1
            return need

    def _from_state(self, r: Record) -> Slot:
        assert self._optimizer is not None and r.opt_state is not None
        return Slot(key=r.key, dtype=np.dtype(r.dtype), value=np.ascontiguousarray(r.value),
                    optimizer=self._optimizer, opt_state=r.opt_state, version=r.version,
                    last_clock=dict(r.clocks), max_clock=max(r.clocks.values(), default=NO_CLOCK),
                    floors=dict(r.floors or {}))

    def holds(self, key: SliceKey) -> bool:
        with self._lock:
            return key in self._slots

    @property
    def empty(self) -> bool:
        return not self._slots  # a racy read is fine: a request routed here after a failover finds them

    def take(self, keys: Iterable[SliceKey]) -> list[Slot]:
        """Hand over the copies of `keys` (those held) to become this server's own slices."""
        with self._lock:
            for key in keys:
                self._origin.pop(key, None)
            return [self._slots.pop(k) for k in keys if k in self._slots]

    def keys(self) -> list[SliceKey]:
        with self._lock:
            return sorted(self._slots)


@dataclass
class _Backup:
    address: str
    queue: collections.deque[Record] = field(default_factory=collections.deque)
    seeded: set[SliceKey] = field(default_factory=set)  # slices whose state was queued to it
    acked: int = 0  # every record up to this sequence number is on the backup
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    task: asyncio.Task[None] | None = None
    failing_since: float | None = None


Send = Callable[[str, pb.ReplicateRequest], pb.ReplicateResponse]


class Replicator:
    """Primary side: queues each step of this server's slices to its backups and tracks their acks.

    `send(address, request)` is a blocking Replicate call (run in a thread); `own` names this
    server in the requests. Lives on the server's event loop; the store hook may run on any thread.
    """

    def __init__(self, own: str, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        self.own = own
        self._send = send
        self._loop = loop
        self._lock = threading.Lock()
        self._seq = 0
        self._last_seq: dict[SliceKey, int] = {}
        self._backups: dict[str, _Backup] = {}
        self._store: ShardStore | None = None
        self._acked = asyncio.Condition()
        self.records_sent = 0

    # ---- wiring ----

    def attach(self, store: ShardStore) -> None:
        """Replicate `store`'s slices from now on (the server's store, once configured)."""
        self._store = store
        store.set_step_hook(self._on_step)
        self.seed([s.key for s in store.slots()])

    def set_backups(self, addresses: Sequence[str]) -> None:
        """The backups this server forwards to now (from the scheduler's view, ring order)."""
        wanted = list(dict.fromkeys(addresses))
        with self._lock:
            gone = [b for a, b in self._backups.items() if a not in wanted]
            new = [a for a in wanted if a not in self._backups]
            for b in gone:
                b.closed = True
                del self._backups[b.address]
            for address in new:
                self._backups[address] = _Backup(address)
        for b in gone:
            b.wake.set()
            log.warning("replication: %s is no longer a backup of %s (%d records unsent)", b.address,
                        self.own, len(b.queue))
            self._loop.run_in_executor(None, self._release, b.address)
        for address in new:
            backup = self._backups.get(address)
            if backup is not None:
                backup.task = self._loop.create_task(self._sender(backup))
                log.info("replication: %s backs up %s; copying its slices", address, self.own)
        if new and self._store is not None:
            self.seed([s.key for s in self._store.slots()])
        if gone:
            self._loop.create_task(self._notify())

    @property
    def backups(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._backups)

    def close(self) -> None:
        self.set_backups([])

    # ---- recording ----

    def _on_step(self, slot: Slot, update: np.ndarray, count: int) -> None:
        # Under the slice's lock: records of one slice are queued in version order.
        with self._lock:
            if not self._backups:
                return
            self._seq += 1
            record = step_record(slot, update, count, self._seq)
            for b in self._backups.values():
                if slot.key not in b.seeded:  # a slice declared since: its state (before this step) first
                    b.queue.append(state_record(slot, record.seq))
                    b.seeded.add(slot.key)
                b.queue.append(record)
            self._last_seq[slot.key] = self._seq
            backups = list(self._backups.values())
        for b in backups:
            self._loop.call_soon_threadsafe(b.wake.set)

    def seed(self, keys: Iterable[SliceKey]) -> None:
        """Queue the state of each of `keys` (this server's slices) to every backup that lacks it."""
        store = self._store
        if store is None:
            return
        woken: set[str] = set()
        for slot in store.slots():
            if slot.key not in set(keys):
                continue
            with slot.lock, self._lock:
                for b in self._backups.values():
                    if slot.key in b.seeded:
                        continue
                    self._seq += 1
                    b.queue.append(state_record(slot, self._seq))
                    b.seeded.add(slot.key)
                    self._last_seq[slot.key] = self._seq
                    woken.add(b.address)
        for address in woken:
            backup = self._backups.get(address)
            if backup is not None:
                self._loop.call_soon_threadsafe(backup.wake.set)

    # ---- acknowledging ----

    def _target(self, keys: Iterable[SliceKey] | None) -> int:
        with self._lock:
            if keys is None:
                return self._seq
            return max((self._last_seq.get(k, 0) for k in keys), default=0)

    def _behind(self, target: int) -> list[_Backup]:
        with self._lock:
            return [b for b in self._backups.values() if b.acked < target]

    async def settle(self, keys: Iterable[SliceKey] | None, deadline: float) -> None:
        """Return once every record so far of `keys` (None: of every slice) is on every backup."""
        target = self._target(keys)
        if not self._behind(target):
            return
        async with self._acked:
            try:
                await asyncio.wait_for(self._acked.wait_for(lambda: not self._behind(target)),
                                       max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                behind = self._behind(target)
                raise PullTimeoutError(
                    "replication: backups " + ", ".join(f"{b.address} (acknowledged {b.acked} of {target})"
                                                        for b in behind)
                    + f" did not acknowledge {self.own}'s updates before the request's deadline") from None

    def lag(self) -> int:
        """Records queued but not yet acknowledged by the slowest backup (the replication lag gauge)."""
        with self._lock:
            return max((self._seq - b.acked for b in self._backups.values()), default=0)

    async def _notify(self) -> None:
        async with self._acked:
            self._acked.notify_all()

    # ---- sending ----

    async def _sender(self, b: _Backup) -> None:
        delay = _RETRY_S[0]
        while not b.closed:
            await b.wake.wait()
            b.wake.clear()
            while not b.closed:
                with self._lock:
                    batch: list[Record] = []
                    size = 0
                    for r in b.queue:
                        if batch and size + r.nbytes > _BATCH_BYTES:
                            break
                        batch.append(r)
                        size += r.nbytes
                if not batch:
                    break
                store = self._store
                config = store.config if store is not None else JobConfig()
                try:
                    # Encoding copies every byte: off the event loop, with the call.
                    reply = await self._loop.run_in_executor(None, self._send_batch, b.address, batch, config)
                except Exception as e:  # unreachable, restarting, refusing: keep the batch and retry
                    if b.failing_since is None:
                        b.failing_since = time.monotonic()
                        log.warning("replication: backup %s unreachable (%s); retrying until it is back or "
                                    "the scheduler declares it gone", b.address, e)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _RETRY_S[1])
                    continue
                if b.failing_since is not None:
                    log.info("replication: backup %s reachable again after %.1fs", b.address,
                             time.monotonic() - b.failing_since)
                    b.failing_since = None
                delay = _RETRY_S[0]
                self._sent(b, batch, [codec.slice_id_from_proto(k) for k in reply.need_state])
                await self._notify()

    def _release(self, address: str) -> None:
        """Tell a former backup to drop our copies; best effort (a dead one has nothing to drop)."""
        try:
            self._send(address, pb.ReplicateRequest(primary=self.own, release=True))
        except Exception as e:
            log.debug("replication: could not release %s: %s", address, e)

    def _send_batch(self, address: str, batch: Sequence[Record], config: JobConfig) -> pb.ReplicateResponse:
        request = pb.ReplicateRequest(primary=self.own, config=codec.job_to_proto(config),
                                      records=[record_to_proto(r) for r in batch])
        return self._send(address, request)

    def _sent(self, b: _Backup, batch: Sequence[Record], need_state: Sequence[SliceKey]) -> None:
        top = max(r.seq for r in batch)
        with self._lock:
            for _ in batch:
                b.queue.popleft()
            self.records_sent += len(batch)
        if not need_state:
            with self._lock:
                b.acked = max(b.acked, top)
            return
        log.info("replication: backup %s lacks the history of %d slices; sending their state", b.address,
                 len(need_state))
        store = self._store
        slots = {s.key: s for s in store.slots()} if store is not None else {}
        for key in need_state:
            slot = slots.get(key)
            if slot is None:
                continue
            # Under the slice's lock: every step recorded so far is in the state, every later one
            # is queued after it (the front is this task's alone).
            with slot.lock, self._lock:
                b.queue.appendleft(state_record(slot, top))
        b.wake.set()
