"""Sparse-table replication and failover (docs/architecture.md, 9 Failures).

A server's tables hold the ids of the row partitions it serves: partition p is the ids whose row
hash (pshard.common.sparse.server_of) is p, served by server p until a failover moves it
(Layout.row_owners). With `--replicas r` the server forwards its table rows to the same backups
as its slices (pshard.common.replicas.backups_of), and acknowledges a push only once every backup
holds the rows it changed:

- Each applied push (async), or each clock's aggregated update (sync), marks the rows it touched
  dirty for every backup; evictions and row-creating pulls mark theirs. One sender task per backup
  ships the dirty rows' whole state as it is when the batch is taken (ps_server/table_replica.py):
  pushes in between coalesce. A push waits (`settle`) until every backup acknowledged a batch
  taken after it, over the same Replicate call and channel as the dense slices
  (ps_server/replica_link.py).
- A backup that joins, or comes back as a new process, first gets every row, a chunk at a time
  behind the dirty rows (so pushes are not held up by the copy), and only then counts as in sync
  (ps_server/replica_sync.py reports the backups that hold both the slices and the rows).
- On failover the heir merges the dead primary's replica tables into its own tables when the
  layout naming it arrives, and serves those ids from then on; a server refuses ids of partitions
  it does not serve (UnknownKeyError: the worker re-routes). Pushes carry an idempotence key
  (worker, push_id) replicated with the rows, so a push resent after a failover, that the old
  primary had applied and replicated before it died, is dropped by the heir.

Lives on the server's event loop (table requests run there); the Replicate call's decoding and
applying of batches run on a thread (ReplicaTables locks itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pshard.common.errors import PullTimeoutError, StaleGenerationError, UnknownKeyError
from pshard.common.layout import Layout
from pshard.common.replicas import index_of
from pshard.common.sparse import TableConfig, server_of
from pshard.common.sparse_codec import spec_from_proto, spec_to_proto
from pshard.common.view import ClusterView
from pshard.ps_server.replication import Send
from pshard.ps_server.table import SparseTable
from pshard.ps_server.table_replica import PushLog, ReplicaTables, RowBatch, all_ids, capture, merge

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.replication")

_ID = np.dtype("<i8")
_BATCH_BYTES = 16 * 2**20  # rows per Replicate call, by bytes (the servers' message limit is 64 MiB)
_RETRY_S = (0.05, 1.0)  # first and longest wait between attempts to reach a backup


class TableSource(Protocol):
    """What replication needs of the server's tables (ps_server.table_handlers.TableHandlers has it)."""

    def tables(self) -> list[SparseTable]:
        ...

    def find(self, name: str) -> SparseTable | None:
        ...

    def make(self, config: TableConfig) -> SparseTable:
        ...

    def add(self, table: SparseTable) -> None:
        ...


# ---- wire ----

def batch_to_proto(b: RowBatch) -> pb.TableReplica:
    return pb.TableReplica(
        spec=spec_to_proto(b.config), ids=b.ids.astype(_ID, copy=False).tobytes(),
        columns={name: np.ascontiguousarray(c).tobytes() for name, c in b.columns.items()},
        deleted=b.deleted.astype(_ID, copy=False).tobytes(), step=b.step, clock=b.clock, evicted=b.evicted,
        admitted=b.admitted, seen_ids=b.seen_ids.astype(_ID, copy=False).tobytes(),
        seen_counts=b.seen_counts.astype("<i4", copy=False).tobytes(), rng_state=b.rng_state,
        pushes={w: pb.PushIds(ids=[k for k, _ in keys], partitions=[p for _, p in keys])
                for w, keys in b.pushes.items()})


def batch_from_proto(msg: pb.TableReplica) -> RowBatch:
    """The batch of `msg`, its arrays their own (the replica keeps none of the message's bytes)."""
    config = spec_from_proto(msg.spec)
    ids = np.frombuffer(msg.ids, _ID).astype(np.int64)
    # The column layout of a table of this config, as SparseTable.columns() has it.
    shapes = {name: (a.dtype, shape) for name, (a, shape) in SparseTable(config).columns().items()}
    columns = {}
    for name, raw in msg.columns.items():
        if name not in shapes:
            raise StaleGenerationError(f"table replica {config.name!r}: unknown column {name!r}")
        dtype, shape = shapes[name]
        columns[name] = np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(len(ids), *shape)
    return RowBatch(config, ids, columns, np.frombuffer(msg.deleted, _ID).astype(np.int64), msg.step,
                    msg.clock, msg.evicted, msg.admitted, np.frombuffer(msg.seen_ids, _ID).astype(np.int64),
                    np.frombuffer(msg.seen_counts, "<i4").astype(np.int32), msg.rng_state,
                    {w: list(zip(p.ids, p.partitions, strict=True)) for w, p in msg.pushes.items()})


# ---- primary side ----

@dataclass
class _Peer:
    address: str
    dirty: dict[str, list[np.ndarray]] = field(default_factory=dict)  # table -> ids changed since the batch
    workers: dict[str, set[str]] = field(default_factory=dict)  # table -> workers with new push ids
    backlog: list[tuple[str, np.ndarray]] = field(default_factory=list)  # the full copy still to ship
    acked: int = 0  # the mark sequence number every change up to which the backup holds
    copied: bool = False  # the full copy is acknowledged: in sync
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    incarnation: int = 0
    task: asyncio.Task[None] | None = None
    failing_since: float | None = None

    def mark(self, name: str, ids: np.ndarray, worker: str) -> None:
        self.dirty.setdefault(name, []).append(ids)
        if worker:
            self.workers.setdefault(name, set()).add(worker)


class TableReplication:
    """Both sides of table replication for one server: what it forwards as a primary, the replicas it
    holds as a backup, and which row partitions it serves."""

    def __init__(self, own: str, send: Send, loop: asyncio.AbstractEventLoop, tables: TableSource) -> None:
        """`send`: the Replicate call (ps_server/replica_link.py); `tables`: the server's tables."""
        self.own = own
        self._send = send
        self._loop = loop
        self._tables = tables
        self.replicas = ReplicaTables()
        self._logs: dict[str, PushLog] = {}  # this server's tables' push logs
        self._peers: dict[str, _Peer] = {}
        self._seq = 0
        self._acked = asyncio.Condition()
        self._generations: dict[str, int] = {}
        self._layout: Layout | None = None
        self._me: int | None = None
        self._owned: frozenset[int] | None = None  # partitions served (None: no layout, nothing checked)
        self.promoted_rows = 0

    # ---- requests (TableHandlers' hooks, on the loop) ----

    def check(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        """Refuse ids of partitions this server does not serve (moved by a failover, or not yet here)."""
        owned, layout = self._owned, self._layout
        if table.evict_hook is None:
            name = table.config.name
            table.evict_hook = lambda evicted: self.changed(name, evicted)
        if owned is None or layout is None or not len(ids):
            return
        partition = server_of(ids, len(layout.servers))
        if len(owned) == 1:
            bad = partition != next(iter(owned))
        else:
            bad = ~np.isin(partition, np.fromiter(owned, np.int64))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            p = int(partition[i])
            raise UnknownKeyError(
                f"{what} of table {table.config.name!r}: id {int(ids[i])} is in row partition {p}, which "
                f"layout version {layout.version} has on server {layout.row_owner(p)} "
                f"({layout.servers[layout.row_owner(p)]}), not here; re-route")

    def fresh(self, name: str, ids: np.ndarray, worker: str, push_id: int) -> np.ndarray | None:
        """Which of a push's `ids` to apply: None, all; else a mask without the ids of the partitions
        that applied this push already (a resend after a failover, or after a broken session)."""
        push_log = self._logs.get(name)
        if not push_id or not worker or push_log is None:
            return None
        partition = self._partition_of(ids)
        if isinstance(partition, int):
            return np.zeros(len(ids), bool) if push_log.seen(worker, (push_id, partition)) else None
        done = [p for p in np.unique(partition).tolist() if push_log.seen(worker, (push_id, p))]
        return ~np.isin(partition, done) if done else None

    def _partition_of(self, ids: np.ndarray) -> int | np.ndarray:
        """The row partition of each of `ids` (checked to be served here): one number when this
        server serves one partition, as it does until a failover gives it more."""
        owned, layout = self._owned, self._layout
        if owned is not None and len(owned) == 1:
            return next(iter(owned))
        if layout is None:
            return -1
        return server_of(ids, len(layout.servers))

    def changed(self, name: str, ids: np.ndarray, worker: str = "", push_id: int = 0) -> None:
        """Rows of `name` changed (after the change, on the loop): every backup gets them, and the
        push's idempotence key (a resend after a failover is then dropped by the heir)."""
        keyed = bool(push_id and worker)
        if keyed:
            push_log = self._logs.setdefault(name, PushLog())
            partition = self._partition_of(ids)
            for p in [partition] if isinstance(partition, int) else np.unique(partition).tolist():
                push_log.add(worker, (push_id, p))
        if not self._peers or not (len(ids) or keyed):
            return
        self._seq += 1
        ids = np.array(ids, np.int64)  # a view of a request's bytes or of a fast-path region: copy
        for peer in self._peers.values():
            peer.mark(name, ids, worker if keyed else "")
            peer.wake.set()

    async def settle(self, deadline: float) -> None:
        """Return once every backup holds every change marked so far."""
        target = self._seq
        if not self._behind(target):
            return
        async with self._acked:
            try:
                await asyncio.wait_for(self._acked.wait_for(lambda: not self._behind(target)),
                                       max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise PullTimeoutError(
                    f"table replication: backups {', '.join(p.address for p in self._behind(target))} did "
                    f"not acknowledge {self.own}'s table rows before the request's deadline") from None

    def _behind(self, target: int) -> list[_Peer]:
        return [p for p in self._peers.values() if p.acked < target]

    # ---- backups (from the scheduler's views) ----

    def set_backups(self, addresses: Sequence[str]) -> None:
        wanted = list(dict.fromkeys(addresses))
        for address in [a for a in self._peers if a not in wanted]:
            peer = self._peers.pop(address)
            peer.closed = True
            peer.wake.set()
            log.warning("table replication: %s is no longer a backup of %s", address, self.own)
            self._loop.run_in_executor(None, self._release, address)
            self._loop.create_task(self._notify())
        for address in wanted:
            if address not in self._peers:
                peer = self._peers[address] = _Peer(address, acked=self._seq)
                self._copy_all(peer)
                peer.wake.set()
                peer.task = self._loop.create_task(self._sender(peer))
                log.info("table replication: %s backs up %s; copying its table rows", address, self.own)

    def on_view(self, view: ClusterView) -> None:
        """A backup with a new incarnation holds nothing: copy every row to it again."""
        for node in view.nodes:
            if node.role != "ps" or not node.address or node.address == self.own:
                continue
            before = self._generations.get(node.address)
            self._generations[node.address] = node.generation
            peer = self._peers.get(node.address)
            if before is not None and before != node.generation and peer is not None:
                peer.incarnation += 1
                peer.dirty.clear()
                peer.workers.clear()
                peer.acked = self._seq  # what it lacks comes in the copy, which marks it out of sync
                self._copy_all(peer)
                peer.wake.set()
                log.info("table replication: backup %s restarted; copying %s's rows to it again",
                         node.address, self.own)

    def in_sync(self) -> set[str]:
        """The backups holding every row of this server's tables (the rest are still copying)."""
        return {a for a, p in self._peers.items() if p.copied}

    def _copy_all(self, peer: _Peer) -> None:
        peer.copied = False
        peer.backlog = [(t.config.name, all_ids(t)) for t in self._tables.tables()]
        for name, push_log in self._logs.items():
            peer.workers.setdefault(name, set()).update(push_log.workers())

    # ---- layout: partitions served, promotion ----

    def on_layout(self, layout: Layout) -> None:
        """Serve the partitions `layout` gives this server; merge the replicas of those it gained."""
        if self._layout is not None and layout.version <= self._layout.version:
            return
        before, self._layout = self._layout, layout
        me = index_of(layout, self.own)
        self._me = me
        if me is None:
            self._owned = None
            return
        owned = frozenset(layout.partitions_on(me))
        gained = owned - (self._owned if self._owned is not None else frozenset({me}))
        self._owned = owned
        if not gained:
            return
        # Whose replicas hold the gained partitions: their previous servers (an earlier failover may
        # have moved one to a server that died since), or their own servers.
        sources = {layout.servers[p] for p in gained}
        if before is not None and len(before.servers) == len(layout.servers):
            sources |= {before.servers[before.row_owner(p)] for p in gained}
        for primary in sorted(sources & self.replicas.primaries()):
            self._promote(primary)

    def _promote(self, primary: str) -> None:
        rows = 0
        for replica, push_log in self.replicas.take(primary):
            name = replica.config.name
            table = self._tables.find(name)
            if table is None:
                table = self._tables.make(replica.config)
                self._tables.add(table)
            moved = merge(table, replica)
            self._logs.setdefault(name, PushLog()).merge(push_log)
            rows += len(moved)
            for peer in self._peers.values():  # they count in sync again once they hold these rows too
                peer.copied = False
                peer.backlog.append((name, moved))
                peer.workers.setdefault(name, set()).update(push_log.workers())
                peer.wake.set()
        self.promoted_rows += rows
        log.warning("FAILOVER: promoted %d table rows of %s to serve them here", rows, primary)

    # ---- backup side (the Replicate call, on a thread) ----

    def apply(self, request: pb.ReplicateRequest) -> None:
        primary = request.primary
        if request.release_tables:
            dropped = self.replicas.release(primary)
            log.info("table replication: %s no longer forwards here; dropped %d rows", primary, dropped)
            return
        layout = self._layout
        p = index_of(layout, primary) if layout is not None else None
        if layout is not None and p is not None and layout.row_owner(p) != p:
            raise StaleGenerationError(f"replicate: {primary}'s row partition {p} has server "
                                       f"{layout.row_owner(p)} as its primary since a failover (layout "
                                       f"version {layout.version}); the sender was declared dead")
        self.replicas.apply(primary, [batch_from_proto(t) for t in request.tables])

    # ---- sending ----

    def _take(self, peer: _Peer) -> tuple[int, list[RowBatch], bool, list[tuple[str, np.ndarray]]]:
        """The next batch for `peer`, taken now (on the loop: no request runs meanwhile): the sequence
        number it covers, the batches, whether it drains the dirty rows, and the backlog it took."""
        seq = self._seq
        dirty, peer.dirty = peer.dirty, {}
        workers, peer.workers = peer.workers, {}
        budget = _BATCH_BYTES
        batches: list[RowBatch] = []
        drained = True
        for name, parts in dirty.items():
            table = self._tables.find(name)
            if table is None:
                continue
            ids = np.unique(np.concatenate(parts))
            fits = max(1, budget // _row_bytes(table))
            if len(ids) > fits:
                drained = False
                peer.dirty.setdefault(name, []).insert(0, ids[fits:])
                ids = ids[:fits]
            batches.append(self._capture(table, ids, workers.pop(name, set())))
            budget -= batches[-1].nbytes
        taken: list[tuple[str, np.ndarray]] = []
        while peer.backlog and (budget > 0 or not batches):
            name, ids = peer.backlog[0]
            table = self._tables.find(name)
            if table is None:
                peer.backlog.pop(0)
                continue
            fits = max(1, budget // _row_bytes(table))
            part, rest = ids[:fits], ids[fits:]
            if len(rest):
                peer.backlog[0] = (name, rest)
            else:
                peer.backlog.pop(0)
            taken.append((name, part))
            if len(part):
                batches.append(self._capture(table, np.unique(part), workers.pop(name, set())))
                budget -= batches[-1].nbytes
        for name, names in workers.items():  # push ids alone (a duplicate dropped, nothing changed)
            table = self._tables.find(name)
            if table is not None:
                batches.append(self._capture(table, np.zeros(0, np.int64), names))
        return seq, batches, drained, taken

    def _capture(self, table: SparseTable, ids: np.ndarray, workers: set[str]) -> RowBatch:
        push_log = self._logs.get(table.config.name)
        return capture(table, ids, push_log.keys_of(workers) if push_log is not None and workers else None)

    async def _sender(self, peer: _Peer) -> None:
        delay = _RETRY_S[0]
        while not peer.closed:
            await peer.wake.wait()
            peer.wake.clear()
            while not peer.closed and (peer.dirty or peer.workers or peer.backlog):
                incarnation = peer.incarnation
                seq, batches, drained, taken = self._take(peer)
                if not batches:  # only tables that are gone
                    peer.acked = max(peer.acked, seq) if drained else peer.acked
                    continue
                request = pb.ReplicateRequest(primary=self.own)
                try:
                    await self._loop.run_in_executor(None, self._ship, peer.address, request, batches)
                except Exception as e:  # unreachable, restarting, refusing: the rows stay due
                    for b in batches:
                        peer.mark(b.config.name, np.concatenate([b.ids, b.deleted]), "")
                        peer.workers.setdefault(b.config.name, set()).update(b.pushes)
                    peer.backlog[:0] = taken
                    if peer.failing_since is None:
                        peer.failing_since = time.monotonic()
                        log.warning("table replication: backup %s unreachable (%s); retrying until it is "
                                    "back or the scheduler declares it gone", peer.address, e)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, _RETRY_S[1])
                    continue
                delay = _RETRY_S[0]
                if peer.failing_since is not None:
                    log.info("table replication: backup %s reachable again", peer.address)
                    peer.failing_since = None
                if peer.incarnation != incarnation:
                    continue  # the old process's acknowledgement
                if drained:
                    peer.acked = max(peer.acked, seq)
                await self._notify()
            if not peer.copied and not peer.closed and not (peer.backlog or peer.dirty or peer.workers):
                peer.copied = True  # every batch since the copy began is acknowledged
                log.info("table replication: %s holds every table row of %s", peer.address, self.own)

    def _ship(self, address: str, request: pb.ReplicateRequest, batches: list[RowBatch]) -> None:
        request.tables.extend(batch_to_proto(b) for b in batches)
        self._send(address, request)

    async def _notify(self) -> None:
        async with self._acked:
            self._acked.notify_all()

    def _release(self, address: str) -> None:
        try:
            self._send(address, pb.ReplicateRequest(primary=self.own, release_tables=True))
        except Exception as e:
            log.debug("table replication: could not release %s: %s", address, e)

    def close(self) -> None:
        self.set_backups([])


def _row_bytes(table: SparseTable) -> int:
    return 8 + sum(a.itemsize * int(np.prod(shape)) for a, shape in table.columns().values())

