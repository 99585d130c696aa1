"""Sparse-table replication and failover (docs/architecture.md, 9 Failures).

A server's tables hold the ids of the row partitions it serves: partition p is the ids whose row
hash (pshard.common.sparse.server_of) is p, served by server p until a failover moves it
(Layout.row_owners). With `--replicas r` the server forwards its table rows to the same backups
as its slices (pshard.common.cluster.replicas.backups_of), and acknowledges a push only once every backup
holds the rows it changed:

- Each applied push (async), or each clock's aggregated update (sync), marks the rows it touched
  dirty for every backup; evictions and row-creating pulls mark theirs. One sender task per backup
  ships the dirty rows' whole state as it is when the batch is taken (ps_server/replication/table_rows.py):
  pushes in between coalesce. A push waits (`settle`) until every backup acknowledged a batch
  taken after it, over the same Replicate call and channel as the dense slices
  (ps_server/replication/link.py); between hosts over the same raw TCP link as theirs when the backup
  offers one (ps_server/transport/replica_tcp.py: the columns are the link frame's data), over gRPC when it
  breaks.
- A backup that joins, or comes back as a new process, first gets every row, a chunk at a time
  behind the dirty rows (so pushes are not held up by the copy), and only then counts as in sync
  (ps_server/replication/in_sync.py reports the backups that hold both the slices and the rows).
- On failover the heir merges the dead primary's replica tables into its own tables when the
  layout naming it arrives, and serves those ids from then on; a server refuses ids of partitions
  it does not serve (UnknownKeyError: the worker re-routes). Pushes carry an idempotence key
  (worker, push_id) replicated with the rows, so a push resent after a failover, that the old
  primary had applied and replicated before it died, is dropped by the heir.
- Sync tables: a clock's update is applied per row partition (ps_server/tables/sync.py) and
  replicated like any change, with each partition's applied clock, in the same batch as the rows
  (a sync table's changed rows are never split over two calls, so the two agree). The heir serves
  an adopted partition from that clock on; the pushes its old primary held pending come again from
  the workers, which keep each sync push until a pull shows it applied (client/tables.py). A sync
  push counts, empty parts included, for the partitions its server serves, so it is taken only when
  the layout it was routed with gave this server the partitions it serves now (`routed`).

Lives on the server's event loop (table requests run there); the Replicate call's decoding and
applying of batches run on a thread (ReplicaTables locks itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import grpc
import numpy as np
from pshard.common.cluster.layout import Layout
from pshard.common.cluster.replicas import index_of, joining_backups
from pshard.common.cluster.view import ClusterView, NodeState, ServerIncarnations
from pshard.common.errors import (
    InvalidArgumentError,
    LayoutNotYetError,
    PartitionMovedError,
    PartitionTakenError,
    PSError,
    PullTimeoutError,
    StaleGenerationError,
)
from pshard.common.failpoints import failpoint
from pshard.common.rpc.status import error_from_rpc_error
from pshard.common.sparse import TableConfig, server_of
from pshard.ps_server.replication.api import RowReplication
from pshard.ps_server.replication.backends import Links, Send, over_link
from pshard.ps_server.replication.shm import SegmentMaps
from pshard.ps_server.replication.table_rows import (
    Alloc,
    PushLog,
    ReplicaTables,
    RowBatch,
    all_ids,
    capture,
    merge,
)
from pshard.ps_server.replication.table_wire import (
    RowSegment,
    batch_from_proto,
    batch_into_proto,
    columns_into_proto,
    frame_columns,
    needed_bytes,
    row_bytes,
    small_batch,
)
from pshard.ps_server.tables.table import SparseTable

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.replication")

_BATCH_BYTES = 16 * 2**20  # rows per Replicate call, by bytes (the servers' message limit is 64 MiB)
# Over a raw TCP link the columns are received into the backup's session region (16 MiB,
# replica_tcp.REGION_BYTES), each page-aligned: batches well inside it, as the dense slices' are.
_LINK_BATCH_BYTES = 8 * 2**20
_CHECKED = 2  # id arrays `check` remembers as served here (a pull's, then the push of the same ids)
_RETRY_S = (0.05, 1.0)  # first and longest wait between attempts to reach a backup
_VERSIONS_KEPT = 64  # layouts whose served partitions `routed` remembers


class TableSource(Protocol):
    """What replication needs of the server's tables (ps_server.handlers.tables.TableHandlers has it)."""

    def tables(self) -> list[SparseTable]:
        ...

    def find(self, name: str) -> SparseTable | None:
        ...

    def make(self, config: TableConfig) -> SparseTable:
        ...

    def add(self, table: SparseTable) -> None:
        ...

    def sync_applied(self, name: str) -> dict[int, int] | None:
        """A sync table's first clock not applied per partition (None: not a sync table)."""
        ...

    def adopt_sync(self, name: str, applied: dict[int, int]) -> None:
        ...

    def number_own(self, partition: int) -> None:
        ...

    def moved_away(self) -> None:
        """Partitions this server served moved to another: wake the pulls waiting for their clocks."""
        ...


# ---- primary side ----

class _Call(NamedTuple):
    seq: int  # every change marked up to it is in the call, when `drained`
    batches: list[tuple[RowBatch, str, int]]  # (rows, segment, offset of their columns)
    drained: bool
    taken: list[tuple[str, np.ndarray]]  # the part of the full copy the call ships
    incarnation: int  # of the backup when the call was taken


@dataclass
class _Peer:
    address: str
    dirty: dict[str, list[np.ndarray]] = field(default_factory=dict)  # table -> ids changed since the batch
    workers: dict[str, set[str]] = field(default_factory=dict)  # table -> workers with new push ids
    backlog: list[tuple[str, np.ndarray]] = field(default_factory=list)  # the full copy still to ship
    acked: int = 0  # the mark sequence number every change up to which the backup holds
    copied: bool = False  # the full copy is acknowledged: in sync
    # Acknowledgements wait for it: always for a backup, for a joiner (issue 20) once its copy is done, so
    # that a joiner slow, held or killed mid-copy stalls no push.
    holds: bool = True
    joining: bool = False
    # None: a backup, given every row. A set: a move's target (issue 20, `pshard rebalance`), given only
    # the rows of these row partitions, until the scheduler switches them to it.
    partitions: frozenset[int] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    incarnation: int = 0
    task: asyncio.Task[None] | None = None
    failing_since: float | None = None
    segment: RowSegment | None = None  # same host: the columns go through shared memory
    shm_worked: bool = False  # the backup took a call through `segment`
    # Partitions moved from this server whose new server (this backup) refused their rows: it took its
    # copy, so their changed rows go to it no more (TableReplication._take).
    taken: frozenset[int] = frozenset()

    def mark(self, name: str, ids: np.ndarray, worker: str) -> None:
        self.dirty.setdefault(name, []).append(ids)
        if worker:
            self.workers.setdefault(name, set()).add(worker)


class TableReplication:
    """Both sides of table replication for one server: what it forwards as a primary, the replicas it
    holds as a backup, and which row partitions it serves."""

    def __init__(self, own: str, send: Send, loop: asyncio.AbstractEventLoop, tables: TableSource,
                 shm_dir: str | None = None, links: Links | None = None) -> None:
        """`send`: the Replicate call (ps_server/replication/link.py); `tables`: the server's tables;
        `shm_dir`: the shared-memory directory row columns go through to same-host backups (and are
        read from as a backup), None: inline only; `links`: the raw TCP links rows not in shared
        memory go over before gRPC (the dense slices', ps_server/transport/replica_tcp.py), None: gRPC
        only."""
        self.own = own
        self._shm_dir = shm_dir
        self._links = links
        self._maps = SegmentMaps(shm_dir) if shm_dir is not None else None
        self._send = send
        self._loop = loop
        self._tables = tables
        self.replicas = ReplicaTables()
        self._logs: dict[str, PushLog] = {}  # this server's tables' push logs
        self._peers: dict[str, _Peer] = {}
        self._seq = 0
        self._acked = asyncio.Condition()
        self._incarnations = ServerIncarnations(own)
        self._layout: Layout | None = None
        self._me: int | None = None
        self._owned: frozenset[int] | None = None  # partitions served (None: no layout, nothing checked)
        self._owned_at: dict[int, frozenset[int] | None] = {}  # layout version -> partitions served then
        self.promoted_rows = 0
        self._watched: dict[str, SparseTable] = {}  # the tables whose rows the backups are given
        # The last ids found served here (see `check`), with their rows per partition.
        self._checked: list[tuple[np.ndarray, dict[int, int]]] = []
        # Load (issue 20, `pshard rebalance`): rows pulled or pushed per row partition since the start.
        self.partition_rows: dict[int, int] = {}
        self._partition_bytes: tuple[float, dict[int, int]] = (-float("inf"), {})  # (next count, bytes held)
        # Partitions a move took from this server while it lived on (`pshard rebalance`): rows of them
        # changed before it knew are no longer its to replicate (`_take`).
        self._lost: frozenset[int] = frozenset()
        # Primary -> the partitions a move gave this server from it while it lives on: its batches with
        # rows of them are refused from then on (`apply`), as a dead primary's are after a failover.
        self._taken: dict[str, frozenset[int]] = {}
        # The peers the views ask for: backups (and joiners among them), and the targets of this server's
        # partitions being moved to a server that is not a backup of it, with those partitions.
        self._backups: list[str] = []
        self._catching_up: frozenset[str] = frozenset()
        self._copies: dict[str, frozenset[int]] = {}
        # Servers copying a partition to this one (the views' copies): their replica here is a move's copy
        # alone, dropped once taken over.
        self._copy_sources: frozenset[str] = frozenset()
        self._view: ClusterView | None = None

    # ---- requests (TableHandlers' hooks, on the loop) ----

    def placed(self, name: str, what: str) -> None:
        """Refuse a request while the layout this server knows does not list it: a joiner before its
        switch. Only a worker that knows the switch sends it one, so the joiner is about to learn it; it
        must not apply the request meanwhile (its tables hold no rows of its own yet: the partitions it
        takes are merged from its copy at the switch, and a push applied before would be overwritten)."""
        layout = self._layout
        if layout is not None and self._me is None:
            raise LayoutNotYetError(
                f"{what} of table {name!r}: this server is not in the layout it knows (version "
                f"{layout.version}), it has not received the one that gives it row partitions yet; retry",
                table=name, known_version=layout.version)

    def check(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        """Refuse ids of partitions this server does not serve (moved by a failover, or not yet here)."""
        owned, layout = self._owned, self._layout
        if self._watched.get(table.config.name) is not table:
            self._watch()
        if owned is None or layout is None or not len(ids):
            return
        first, last = ids[0], ids[-1]
        for seen, counts in self._checked:  # a push of the ids pulled a moment before: hashed once
            if len(seen) == len(ids) and seen[0] == first and seen[-1] == last and np.array_equal(seen, ids):
                self._count(counts)
                return
        partition = server_of(ids, layout.partition_count)
        if len(owned) == 1:
            bad = partition != next(iter(owned))
        else:
            bad = ~np.isin(partition, np.fromiter(owned, np.int64))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            p = int(partition[i])
            raise PartitionMovedError(
                f"{what} of table {table.config.name!r}: id {int(ids[i])} is in row partition {p}, which "
                f"layout version {layout.version} has on server {layout.row_owner(p)} "
                f"({layout.servers[layout.row_owner(p)]}), not here; re-route",
                table=table.config.name, partition=p, layout_version=layout.version)
        found, hits = np.unique(partition, return_counts=True)
        rows = dict(zip(found.tolist(), hits.tolist(), strict=True))
        self._count(rows)
        self._checked = [(ids.copy(), rows), *self._checked[:_CHECKED - 1]]

    def kept(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        """A push applied and acknowledged by the backups, while a move may have taken some of its
        partitions from this server (`pshard rebalance`): their new server refused the rows, or took its
        copy before they came, so the push is refused and the worker re-routes (idempotence keys drop what
        reached either server already)."""
        lost, layout = self._lost, self._layout
        if not lost or layout is None or not len(ids):
            return
        partition = server_of(ids, layout.partition_count)
        hit = np.isin(partition, np.fromiter(lost, np.int64))
        if hit.any():
            p = int(partition[hit][0])
            raise PartitionMovedError(
                f"{what} of table {table.config.name!r}: row partition {p} moved to server "
                f"{layout.row_owner(p)} ({layout.servers[layout.row_owner(p)]}) while it was applied here "
                f"(layout version {layout.version}); re-route", table=table.config.name, partition=p,
                layout_version=layout.version)

    def _count(self, rows: dict[int, int]) -> None:
        for p, n in rows.items():
            self.partition_rows[p] = self.partition_rows.get(p, 0) + n

    def load(self, now: float) -> tuple[dict[int, int], dict[int, int]]:
        """(rows pulled or pushed per partition served since the start, bytes held per partition served):
        the heartbeat's load report. The bytes hash every id held on the event loop, so they are recounted
        every 2 s at most, and at most 2 % of the time for large tables."""
        owned = self._owned or frozenset()
        when, held = self._partition_bytes
        layout = self._layout
        if now >= when and layout is not None:
            started = time.monotonic()
            held = {}
            for table in self._tables.tables():
                ids = all_ids(table)
                if len(ids):
                    found, counts = np.unique(server_of(ids, layout.partition_count), return_counts=True)
                    for p, n in zip(found.tolist(), counts.tolist(), strict=True):
                        held[p] = held.get(p, 0) + n * row_bytes(table.config)
            self._partition_bytes = (now + max(2.0, 50 * (time.monotonic() - started)), held)
        return ({p: self.partition_rows.get(p, 0) for p in owned}, {p: held.get(p, 0) for p in owned})

    def copy_bytes_left(self) -> int:
        """Bytes of table rows the slowest backup still lacks from its catch-up copy (a move's bytes left)."""
        left = 0
        for peer in self._peers.values():
            nbytes = 0
            for name, ids in peer.backlog:
                table = self._tables.find(name)
                nbytes += len(ids) * row_bytes(table.config) if table is not None else 0
            left = max(left, nbytes)
        return left

    def fresh(self, name: str, ids: np.ndarray, worker: str, push_id: int) -> np.ndarray | None:
        """Which of a push's `ids` to apply: None, all; else a mask without the ids of the partitions
        that applied this push already (a resend after a failover, or after a broken session)."""
        push_log = self._logs.get(name)
        if not push_id or not worker or push_log is None:
            return None
        partition = self.partitions(ids)
        if isinstance(partition, int):
            return np.zeros(len(ids), bool) if push_log.seen(worker, (push_id, partition)) else None
        done = [p for p in np.unique(partition).tolist() if push_log.seen(worker, (push_id, p))]
        return ~np.isin(partition, done) if done else None

    def served(self) -> frozenset[int] | None:
        """The row partitions this server serves (None: it knows no layout yet)."""
        return self._owned

    def layout_version(self) -> int:
        """The version of the newest layout this server knows (0: none yet)."""
        return self._layout.version if self._layout is not None else 0

    def partition_count(self) -> int:
        """How many row partitions `partitions` numbers ids into (0: no layout yet, every id is -1's)."""
        layout = self._layout
        return layout.partition_count if layout is not None else 0

    def routed(self, name: str, version: int) -> None:
        """Refuse a sync push routed with layout `version` unless that layout gave this server the
        partitions it serves: the push counts for each of them, empty parts too, so a worker routing
        with another layout would be counted for a partition whose ids it sent elsewhere, or not
        counted for one it believes it pushed to here. 0: a worker without a layout, not checked."""
        layout = self._layout
        if not version:
            return
        if layout is None or version > layout.version:
            raise LayoutNotYetError(f"push of sync table {name!r}: routed with layout version {version}, "
                                    f"while this server knows version {layout.version if layout else 'none'}"
                                    "; it has not received that layout yet; retry",
                                    table=name, routed_version=version,
                                    known_version=layout.version if layout else 0)
        if version < layout.version and self._owned_at.get(version, frozenset()) != self._owned:
            raise PartitionMovedError(f"push of sync table {name!r}: routed with layout version {version}, "
                                      f"whose row partitions on this server are not those of version "
                                      f"{layout.version}; not here; re-route",
                                      table=name, layout_version=layout.version)

    def partitions(self, ids: np.ndarray) -> int | np.ndarray:
        """The row partition of each of `ids` (checked to be served here): one number when this
        server serves one partition, as it does until a failover gives it more (-1: no layout yet,
        ps_server.tables.sync.OWN)."""
        owned, layout = self._owned, self._layout
        if owned is not None and len(owned) == 1:
            return next(iter(owned))
        if layout is None:
            return -1
        return server_of(ids, layout.partition_count)

    def changed(self, name: str, ids: np.ndarray, worker: str = "", push_id: int = 0,
                clocked: bool = False) -> None:
        """Rows of `name` changed (after the change, on the loop): every backup gets them, and the
        push's idempotence key (a resend after a failover is then dropped by the heir). `clocked`: a
        sync clock was applied, touching these rows or none: the backups get its applied clock."""
        keyed = bool(push_id and worker)
        if keyed:
            push_log = self._logs.setdefault(name, PushLog())
            partition = self.partitions(ids)
            for p in [partition] if isinstance(partition, int) else np.unique(partition).tolist():
                push_log.add(worker, (push_id, p))
        if not self._peers or not (len(ids) or keyed or clocked):
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
        return [p for p in self._peers.values() if p.holds and p.acked < target]

    # ---- backups (from the scheduler's views) ----

    def set_backups(self, addresses: Sequence[str], catching_up: Collection[str] = ()) -> None:
        """The backups this server forwards to now; those in `catching_up` are joiners, which
        acknowledgements wait for only once their copy is done."""
        self._backups, self._catching_up = list(dict.fromkeys(addresses)), frozenset(catching_up)
        self._reconcile()

    def set_copies(self, copies: Mapping[str, frozenset[int]]) -> None:
        """The row partitions this server copies to each target now (`pshard rebalance` to a server that is
        not a backup of it): a catch-up copy of their rows, then each change of them, as to a backup.
        Acknowledgements wait for a target only once its copy is done, so a slow or dead target stalls no
        push; from then on they do, which makes it a copy the scheduler can switch the partitions to."""
        self._copies = {a: frozenset(p) for a, p in copies.items() if p and a != self.own}
        self._reconcile()

    def _reconcile(self) -> None:
        """Peers for the backups and the copies wanted now: new ones start with a copy, gone ones stop."""
        wanted: dict[str, frozenset[int] | None] = {a: p for a, p in self._copies.items()}
        wanted.update((a, None) for a in self._backups)  # a backup gets every row, its copies' too
        self._watch()  # a new backup's copy then covers every table once
        for address in [a for a in self._peers if a not in wanted]:
            self._stop(self._peers.pop(address))
        for address, partitions in wanted.items():
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = _Peer(address, acked=self._seq, partitions=partitions)
                peer.holds = partitions is None and address not in self._catching_up
                if self._shm_dir is not None:
                    peer.segment = RowSegment(self._shm_dir)
                self._copy_all(peer)
                peer.wake.set()
                peer.task = self._loop.create_task(self._sender(peer))
                log.info("table replication: %s %s; copying its table rows", address,
                         f"backs up {self.own}" if partitions is None else
                         f"takes row partitions {sorted(partitions)} of {self.own} (a move)")
            elif peer.partitions != partitions:
                self._retarget(peer, partitions)
        for address, peer in self._peers.items():
            peer.joining = address in self._catching_up or peer.partitions is not None
            peer.holds = peer.holds or not peer.joining

    def _retarget(self, peer: _Peer, partitions: frozenset[int] | None) -> None:
        """A peer's rows change: a move's target that became a backup, or a move's that takes more
        partitions, gets a copy of what it lacks; one that takes fewer (or a backup that is a move's
        target only now) holds what it needs already."""
        before, peer.partitions = peer.partitions, partitions
        if before is not None and (partitions is None or partitions - before):
            self._copy_all(peer)
            peer.wake.set()

    def _stop(self, peer: _Peer) -> None:
        peer.closed = True
        peer.wake.set()
        if peer.segment is not None:
            peer.segment.close()
        owned = self._owned or frozenset()
        if peer.partitions is None:
            log.warning("table replication: %s is no longer a backup of %s", peer.address, self.own)
        elif not peer.partitions <= owned:
            # Switched to it: it drops the copy itself once it took it over (`_promote_moved`); a release
            # from here could reach it before the layout that switched them.
            log.info("table replication: %s took over row partitions %s of %s", peer.address,
                     sorted(peer.partitions), self.own)
            self._loop.create_task(self._notify())
            return
        else:
            log.warning("table replication: the move of row partitions %s of %s to %s was rolled back",
                        sorted(peer.partitions), self.own, peer.address)
        self._loop.run_in_executor(None, self._release, peer.address)
        self._loop.create_task(self._notify())

    def on_view(self, view: ClusterView) -> None:
        """A backup with a new incarnation holds nothing: copy every row to it again. The view's copies
        are the moves this server sends or takes."""
        self._copy_sources = frozenset(c.source for c in view.copies if c.target == self.own)
        self._view = view
        self.set_copies(view.copies_from(self.own))
        for address in self._incarnations.restarted(view):
            peer = self._peers.get(address)
            if peer is not None:
                peer.incarnation += 1
                if peer.segment is not None:  # the new process cannot open an unlinked file
                    peer.segment.close()
                    peer.segment, peer.shm_worked = RowSegment(peer.segment.directory), False
                peer.dirty.clear()
                peer.workers.clear()
                peer.acked = self._seq  # what it lacks comes in the copy, which marks it out of sync
                peer.holds = not peer.joining
                self._copy_all(peer)
                peer.wake.set()
                log.info("table replication: backup %s restarted; copying %s's rows to it again",
                         address, self.own)

    def in_sync(self) -> set[str]:
        """The backups holding every row of this server's tables (the rest are still copying)."""
        self._watch()
        return {a for a, p in self._peers.items() if p.copied and p.partitions is None}

    def copies_in_sync(self) -> dict[str, int]:
        """The targets of moves holding every row of the partitions they take (address -> the generation of
        the incarnation the views showed): the scheduler switches those partitions to them."""
        self._watch()
        generations = self._incarnations.generations
        return {a: generations[a] for a, p in self._peers.items()
                if p.copied and p.partitions is not None and a in generations}

    def _watch(self) -> None:
        """Tables this server has gained since it last looked (declared, or restored by a global
        checkpoint with rows no backup has): every backup gets their rows, and their evictions."""
        for table in self._tables.tables():
            name = table.config.name
            if self._watched.get(name) is table:
                continue
            self._hook(table)
            ids = all_ids(table)
            if not len(ids):
                continue
            for peer in self._peers.values():
                peer.copied = False
                peer.backlog.append((name, ids))
                peer.wake.set()

    def _hook(self, table: SparseTable) -> None:
        name = table.config.name
        self._watched[name] = table
        table.evict_hook = lambda evicted: self.changed(name, evicted)

    def _copy_all(self, peer: _Peer) -> None:
        peer.copied = False
        peer.backlog = [(t.config.name, self._for_peer(peer, all_ids(t))) for t in self._tables.tables()]
        for name, push_log in self._logs.items():
            peer.workers.setdefault(name, set()).update(push_log.workers())

    # ---- layout: partitions served, promotion ----

    def on_layout(self, layout: Layout) -> None:
        """Serve the partitions `layout` gives this server; merge the replicas of those it gained."""
        if self._layout is not None and layout.version <= self._layout.version:
            return
        before, self._layout = self._layout, layout
        me = index_of(layout, self.own)
        if me is not None and self._me is None and layout.home_partitions(me) == (me,):
            # Clocks kept before any layout (OWN) are of this one partition; a layout of more
            # partitions than servers comes from the scheduler, whose workers route every push with
            # its version, so none reaches a server that knows no layout (routed).
            self._tables.number_own(me)
        self._me = me
        if me is None:
            self._owned = None
            self._remember(layout.version)
            return
        owned = frozenset(layout.partitions_on(me))
        self._checked = []
        # A server appended by a join served nothing before this layout (its copies are a backup's).
        joined = before is not None and me >= len(before.servers)
        previous = self._owned if self._owned is not None else frozenset(
            () if joined else layout.home_partitions(me))
        gained = owned - previous
        self._owned = owned
        self._lost = (self._lost | (previous - owned)) - owned
        if previous - owned:
            self._tables.moved_away()  # a sync pull parked for one of them re-routes now, not at its deadline
        self._taken = {a: t & owned for a, t in self._taken.items() if t & owned}
        self._remember(layout.version)
        if not gained:
            return
        # Whose replicas hold the gained partitions: their previous servers (an earlier failover may
        # have moved one to a server that died since), or their own servers.
        sources = {layout.servers[p % len(layout.servers)] for p in gained}
        # The same places (a join only appends servers) and partitions: `before` names their servers.
        kept = (before is not None and before.servers == layout.servers[:len(before.servers)]
                and before.partition_count == layout.partition_count)
        if kept:
            assert before is not None
            sources |= {before.servers[before.row_owner(p)] for p in gained}
        for primary in sorted(sources & self.replicas.primaries()):
            index = index_of(layout, primary)
            if index is not None and layout.partitions_on(index):
                # A move of some partitions (`pshard rebalance`, or a join taking some of its donor's):
                # the primary lives on with the rest.
                moved = frozenset(p for p in gained if kept and before is not None
                                  and before.servers[before.row_owner(p)] == primary)
                if moved:
                    self._promote_moved(primary, moved, layout.partition_count)
            else:
                self._promote(primary, gained, layout.partition_count)

    def _promote_moved(self, primary: str, moved: frozenset[int], partitions: int) -> None:
        """Serve the rows of `moved`, row partitions a move took from `primary`, which serves the rest on:
        copied from its replicas, which stay for a failover of it. Its batches with rows of them are
        refused from the copy on (a write it applied before it knew is never acknowledged: the worker
        resends it here)."""

        def refuse_from_now() -> None:
            self._taken[primary] = self._taken.get(primary, frozenset()) | moved

        copies = self.replicas.copy(primary, _in_partitions(moved, partitions), refuse_from_now)
        rows = self._take_over(copies, moved, partitions)
        log.warning("MOVE: took over %d table rows of row partitions %s from %s", rows, sorted(moved),
                    primary)
        if primary in self._copy_sources and not self._backs_up(primary):
            self.replicas.release(primary)  # a move's copy, not a backup's: nothing else is kept of it

    def _backs_up(self, primary: str) -> bool:
        """This server is a backup of `primary` in the newest view (the ring moved during a move's copy:
        the copy became a backup's, which a failover of `primary` needs whole)."""
        view, layout = self._view, self._layout
        if view is None or layout is None or not layout.replicas:
            return False
        servers = {n.rank: n for n in view.nodes if n.role == "ps"}
        rank = next((r for r, n in servers.items() if n.address == primary), None)
        if rank is None:
            return False
        live = {r for r, n in servers.items() if n.state is NodeState.LIVE} | {rank}
        kept, joining = joining_backups(rank, max(servers) + 1, layout.replicas, live, len(layout.servers))
        return any(servers[r].address == self.own for r in (*kept, *joining))

    def _remember(self, version: int) -> None:
        self._owned_at[version] = self._owned
        while len(self._owned_at) > _VERSIONS_KEPT:
            del self._owned_at[min(self._owned_at)]

    def _promote(self, primary: str, gained: frozenset[int], partitions: int) -> None:
        """Serve the rows of `gained` that `primary`'s replicas hold (a failover or a drain of it): the
        replicas are taken. Only the gained partitions' rows: a partition a move took from `primary`
        earlier is served here or elsewhere already, and its copy here is stale."""
        clocks = self.replicas.clocks(primary)
        rows = self._take_over([(replica, push_log, clocks.get(replica.config.name))
                                for replica, push_log in self.replicas.take(primary)], gained, partitions)
        log.warning("FAILOVER: promoted %d table rows of %s to serve them here", rows, primary)

    def _take_over(self, replicas: Iterable[tuple[SparseTable, PushLog, dict[int, int] | None]],
                   taken: frozenset[int], partitions: int) -> int:
        """Serve row partitions `taken` (of `partitions`) from `replicas`, a move's or a failover's: their
        rows merged into this server's table of the replica's name, with its push log and, for a sync
        table, their applied clocks. Only theirs: the replicas' primary may hold other partitions, or
        stale copies of partitions a move took from it earlier, which are served elsewhere or here
        already. The rows taken over."""
        keep = _in_partitions(taken, partitions)
        rows = 0
        for replica, push_log, clocks in replicas:
            name = replica.config.name
            table = self._tables.find(name)
            if table is None:
                table = self._tables.make(replica.config)
                self._tables.add(table)
                self._hook(table)  # its rows go to the backups below
            ids = merge(table, replica, keep)
            if clocks is not None:  # a sync table: its partitions go on from the clock the rows hold
                self._tables.adopt_sync(name, {p: c for p, c in clocks.items() if p in taken})
            self._logs.setdefault(name, PushLog()).merge(push_log, taken)
            rows += len(ids)
            for peer in self._peers.values():  # they count in sync again once they hold these rows too
                peer.copied = False
                peer.backlog.append((name, ids))
                peer.workers.setdefault(name, set()).update(push_log.workers())
                peer.wake.set()
        self.promoted_rows += rows
        return rows

    # ---- backup side (the Replicate call, on a thread) ----

    def apply(self, request: pb.ReplicateRequest, frame: Sequence[np.ndarray] | None = None) -> bool:
        """Hold a primary's batches; True when their columns lie in shared memory this server cannot
        map (nothing applied: the primary sends them inline). `frame`: the columns of the batches not
        in shared memory, as a raw link's frame brought them (views of its region: copied here)."""
        primary = request.primary
        if request.release_tables:
            dropped = self.replicas.release(primary)
            if self._maps is not None:
                self._maps.drop(primary)
            log.info("table replication: %s no longer forwards here; dropped %d rows", primary, dropped)
            return False
        failpoint("ps.before_rows_apply")
        layout = self._layout
        p = index_of(layout, primary) if layout is not None else None
        # A sender serving no row partition was failed over (declared dead). Not "none of its home
        # partitions" (p mod n): a server appended by a join serves others only, and its backup refused
        # every row it took, so its pushes were never acknowledged.
        if layout is not None and p is not None and not layout.partitions_on(p):
            home = layout.home_partitions(p)
            raise StaleGenerationError(
                f"replicate: {primary} serves no row partition since a failover (layout version "
                f"{layout.version}: its row partitions {list(home)} have servers "
                f"{[layout.row_owner(q) for q in home]}); the sender was declared dead")
        arrays = iter(frame) if frame is not None else None
        try:
            batches = [batch_from_proto(t, self._maps, primary, arrays) for t in request.tables]
        except OSError as e:
            log.warning("table replication: cannot map %s's shared memory (%s); asking for rows inline",
                        primary, e)
            return True
        if arrays is not None and next(arrays, None) is not None:
            raise InvalidArgumentError(f"replicate: {len(frame or ())} arrays in the frame, more than "
                                       f"{primary}'s table rows take")
        segments = {t.segment for t in request.tables if t.segment}
        if self._maps is not None and segments:
            self._maps.keep(primary, segments)  # a new segment replaces the old
        taken = self._taken.get(primary)
        self.replicas.apply(primary, batches, None if taken is None else
                            lambda batch: self._refuse_taken(primary, batch))
        return False

    def _refuse_taken(self, primary: str, batch: RowBatch) -> None:
        """A batch of `primary`'s with rows of a partition a move gave this server: `primary` applied
        them before it knew; refused, so it never acknowledges them and the worker resends them here."""
        taken, layout = self._taken.get(primary), self._layout
        if not taken or layout is None or not len(batch.ids):
            return
        partition = server_of(batch.ids, layout.partition_count)
        hit = np.isin(partition, np.fromiter(taken, np.int64))
        if hit.any():
            raise PartitionTakenError(
                f"replicate: row partition {int(partition[hit][0])} of table {batch.config.name!r} moved "
                f"from {primary} to {self.own} (layout version {layout.version}); {primary} no longer "
                "serves it")

    # ---- sending ----

    def _take(self, peer: _Peer) -> _Call:
        """The next call to `peer`, its rows captured now (on the loop: no request runs meanwhile)."""
        seq = self._seq
        dirty, peer.dirty = peer.dirty, {}
        workers, peer.workers = peer.workers, {}
        budget = _LINK_BATCH_BYTES if self._links is not None and peer.segment is None else _BATCH_BYTES
        plan: list[tuple[SparseTable, np.ndarray, set[str]]] = []
        drained = True
        for name, parts in dirty.items():
            table = self._tables.find(name)
            if table is None:
                continue
            # Changed rows of a partition a move took go on until its new server refuses them: before
            # it took its copy they must reach it, with their pushes' keys, or it would hold the keys
            # of pushes whose rows it lacks (applied here before this server learnt of the move) and
            # drop the workers' resends of them. A peer that takes only some partitions (a move's
            # target) gets only their rows.
            ids = self._for_peer(peer, self._still_ours(np.unique(np.concatenate(parts)), peer.taken))
            fits = max(1, budget // row_bytes(table.config))
            keys = workers.pop(name, set())
            if peer.partitions is not None and not len(ids) and table.config.mode != "sync":
                # Only rows of partitions it does not take: their push keys are not its either. A sync
                # table's batch goes all the same: it carries the applied clocks, the moving partition's too.
                continue
            # A sync table's rows go whole: its applied clocks ride along and must match every row.
            if len(ids) > fits and table.config.mode != "sync":
                drained = False
                peer.dirty.setdefault(name, []).insert(0, ids[fits:])
                ids = ids[:fits]
                # The pushes' idempotence keys go with their last rows: a key that reached the backup
                # before the rest of its push's rows would make an heir drop the resend of a push
                # whose rows it lacks (the primary dying between the two calls).
                if keys:
                    peer.workers.setdefault(name, set()).update(keys)
                    keys = set()
            plan.append((table, ids, keys))
            budget -= len(ids) * row_bytes(table.config)
        taken: list[tuple[str, np.ndarray]] = []
        while peer.backlog and (budget > 0 or not plan):
            name, ids = peer.backlog[0]
            table = self._tables.find(name)
            if table is None:
                peer.backlog.pop(0)
                continue
            fits = max(1, budget // row_bytes(table.config))
            part, rest = self._for_peer(peer, self._still_ours(ids[:fits])), ids[fits:]
            if len(rest):
                peer.backlog[0] = (name, rest)
            else:
                peer.backlog.pop(0)
            taken.append((name, part))
            if len(part):
                plan.append((table, np.unique(part), workers.pop(name, set())))
                budget -= len(part) * row_bytes(table.config)
        for name, names in workers.items():  # push ids alone (a duplicate dropped, nothing changed)
            table = self._tables.find(name)
            if table is not None and peer.partitions is None:
                plan.append((table, np.zeros(0, np.int64), names))
        segment = peer.segment
        if segment is not None and plan:
            try:
                segment.start(sum(needed_bytes(t.config, len(ids)) for t, ids, _ in plan))
            except OSError as e:  # the directory is full (a container's small /dev/shm): inline from now on
                log.warning("table replication: no room in shared memory for %s (%s); rows go inline",
                            peer.address, e)
                segment.close()
                peer.segment = segment = None
        batches: list[tuple[RowBatch, str, int]] = []
        for table, ids, names in plan:
            push_log = self._logs.get(table.config.name)
            pushes = push_log.keys_of(names) if push_log is not None and names else None
            alloc: Alloc | None = segment.alloc if segment is not None else None
            offset = segment.position if segment is not None else 0
            batch = capture(table, ids, pushes, alloc)
            batch.applied = self._tables.sync_applied(table.config.name)
            if table.config.name in peer.dirty or any(n == table.config.name for n, _ in peer.backlog):
                # The scheduled record goes with the table's last rows, as the push keys do: an heir that
                # held it before the rest of a push's rows would drop the re-dispatched push's.
                batch.scheduled = None
            batches.append((batch, segment.name if segment else "", offset))
        return _Call(seq, batches, drained, taken, peer.incarnation)

    async def _sender(self, peer: _Peer) -> None:
        delay = _RETRY_S[0]
        while not peer.closed:
            await peer.wake.wait()
            peer.wake.clear()
            while not peer.closed and (peer.dirty or peer.workers or peer.backlog):
                call = self._take(peer)
                if not call.batches:  # only tables that are gone
                    peer.acked = max(peer.acked, call.seq) if call.drained else peer.acked
                    continue
                try:
                    inline = await self._loop.run_in_executor(None, self._ship, peer.address, call.batches)
                except Exception as e:  # unreachable, restarting, refusing: the rows stay due
                    self._again(peer, call)
                    if isinstance(_as_ps_error(e), PartitionTakenError) and self._lost - peer.taken:
                        peer.taken = peer.taken | self._lost
                        continue  # at once, without the partitions it took (else once this server knows)
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
                if inline:  # it could not map the segment: nothing applied
                    self._again(peer, call)
                    self._refused_segment(peer)
                    continue
                if peer.incarnation != call.incarnation:
                    continue  # the old process's acknowledgement
                if peer.segment is not None:
                    peer.segment.acknowledged()
                    peer.shm_worked = True
                if call.drained:
                    peer.acked = max(peer.acked, call.seq)
                await self._notify()
            if not peer.copied and not peer.closed and not (peer.backlog or peer.dirty or peer.workers):
                peer.copied = True  # every batch since the copy began is acknowledged
                peer.holds = True  # a joiner: from now on no push is acknowledged before it has it
                log.info("table replication: %s holds every table row of %s", peer.address, self.own)

    def _still_ours(self, ids: np.ndarray, lost: frozenset[int] | None = None) -> np.ndarray:
        """`ids` without those of partitions a move took from this server (`pshard rebalance`, a join), or
        of those of them in `lost`: their new server holds them, and refuses them from us."""
        lost = self._lost if lost is None else lost & self._lost
        layout = self._layout
        if not lost or layout is None or not len(ids):
            return ids
        return ids[~np.isin(server_of(ids, layout.partition_count), np.fromiter(lost, np.int64))]

    def _for_peer(self, peer: _Peer, ids: np.ndarray) -> np.ndarray:
        """`ids` without those of partitions `peer` does not take (all of them for a backup)."""
        if peer.partitions is None or not len(ids):
            return ids
        layout = self._layout
        if layout is None:
            return ids[:0]
        return ids[np.isin(server_of(ids, layout.partition_count), np.fromiter(peer.partitions, np.int64))]

    def _again(self, peer: _Peer, call: _Call) -> None:
        """A call that was not applied: its rows are due again."""
        for b, _, _ in call.batches:
            peer.mark(b.config.name, np.concatenate([b.ids, b.deleted]), "")
            peer.workers.setdefault(b.config.name, set()).update(b.pushes)
        peer.backlog[:0] = call.taken

    def _refused_segment(self, peer: _Peer) -> None:
        segment = peer.segment
        if segment is None:
            return
        segment.close()
        if peer.shm_worked:  # a new backup process cannot open the unlinked file: a fresh one
            peer.segment = RowSegment(segment.directory)
            peer.shm_worked = False
        else:
            peer.segment = None
            log.warning("table replication: backup %s cannot map %s's shared memory; rows go inline",
                        peer.address, self.own)

    def _ship(self, address: str, batches: list[tuple[RowBatch, str, int]]) -> bool:
        """One Replicate call of `batches`; True when the backup asks for the columns inline. Rows not
        in shared memory go over the raw TCP link when there is one, else, or when it breaks under
        the call, inline over gRPC: the backup's replay of a batch it may hold already is idempotent
        (each row travels whole, and a batch's scalars and push ids are its primary's state then)."""
        links = None if any(segment for _, segment, _ in batches) else self._links
        request = pb.ReplicateRequest(primary=self.own)
        for batch, segment, offset in batches:
            batch_into_proto(batch, request.tables.add(), segment, offset, inline=links is None)
        if links is not None:
            arrays = [a for batch, _, _ in batches for a in frame_columns(batch)]
            if over_link(links, address, request, arrays) is not None:
                return False
            for (batch, _, _), msg in zip(batches, request.tables, strict=True):
                columns_into_proto(batch, msg)
        return bool(self._send(address, request).tables_need_inline)

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


def _as_ps_error(e: Exception) -> PSError | Exception:
    """A backup's refusal as its type, over gRPC (its status and metadata) or a raw link (raised as is)."""
    return error_from_rpc_error(e) if isinstance(e, grpc.RpcError) else e


def _in_partitions(chosen: frozenset[int], partitions: int) -> Callable[[np.ndarray], np.ndarray]:
    """A mask of the ids whose row partition (of `partitions`) is one of `chosen`."""
    wanted = np.fromiter(chosen, np.int64)
    return lambda ids: np.isin(server_of(ids, partitions), wanted)


async def hold_rows(rows: RowReplication, request: pb.ReplicateRequest,
                    frame: Sequence[np.ndarray] | None = None, executor: Executor | None = None) -> bool:
    """A backup's side of a primary's table rows, from a Replicate call or a raw link's frame
    (`frame`: their columns): `TableReplication.apply`. A step's rows are applied on the event loop,
    copied once into the replicas (as fast as a push of them), where a thread hop each way would cost
    more; a big copy (a new backup's) on a thread of `executor`."""
    if small_batch(request.tables):
        return rows.apply(request, frame)
    return await asyncio.get_running_loop().run_in_executor(executor, rows.apply, request, frame)
