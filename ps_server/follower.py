"""A parameter server following the scheduler (docs/architecture.md, 3 Membership, 9 Failures).

`SchedulerFollower` registers the server and hands every cluster view, and with replicas every new
layout, to the consumers subscribed to it, on the server's event loop and in the order they
subscribed. The consumers are objects built whole by their constructors:

- `QuorumInstaller`: the workers each sync clock waits for (dense handlers and sync tables), kept
  for a grace while a restarted scheduler's workers re-register;
- `ReplicaWiring` (a job with `--replicas`): the slices' and rows' replication to this server's
  backups, which slices and row partitions the newest layout makes this server's, and the in-sync
  report sent with each heartbeat.

`follow_scheduler` assembles them for a running server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.loads import Counters
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.cluster.view import ClusterView, ServerIncarnations
from pshard.common.security.credentials import SecurityConfig
from pshard.ps_server.core.quorum import QuorumFollower
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.replication.dense import Replicator
from pshard.ps_server.replication.in_sync import InSyncReporter, copies_caught_up
from pshard.ps_server.replication.link import (
    backup_addresses,
    grpc_sender,
    owned_slices,
    stub_cache,
    tcp_links,
)
from pshard.ps_server.replication.tables import TableReplication

if TYPE_CHECKING:
    from pshard.ps_server.service import RunningServer
    from pshard.ps_server.transport.fastpath import FastPathServer

log = logging.getLogger("pshard.ps")

# How often a primary recomputes which backups are in sync (sent with the next heartbeat).
IN_SYNC_REPORT_S = 0.25
# How often a server's load counters are taken for its next heartbeats (the scheduler rates them over
# about ten seconds, common/cluster/loads.py).
LOAD_REPORT_S = 1.0
# Workers a restarted scheduler forgot are waited for while they re-register (ps_server/core/quorum.py): this
# long until registration tells the scheduler's heartbeat timeout, twice which it is from then on.
_FIRST_GRACE_S = 10.0

ViewConsumer = Callable[[ClusterView], None]
LayoutConsumer = Callable[[Layout], None]


class SchedulerFollower:
    """Registers this server with the scheduler and fans its views (and layouts) out to subscribers.

    Views arrive on the scheduler client's Watch thread; each subscriber is called on `loop`.
    Registration retries in a thread of its own (the scheduler may start after us) once `start` is
    called: subscribe first.
    """

    def __init__(self, spec: ClusterSpec, loop: asyncio.AbstractEventLoop,
                 security: SecurityConfig | None = None, last_generation: int = 0,
                 on_left: Callable[[], None] | None = None) -> None:
        """`last_generation`: the newest worker generation a restored shard remembers; a fresh scheduler
        must hand out newer ones, or the restored fencing refuses the new incarnations."""
        self._spec = spec
        self._loop = loop
        self._views: list[ViewConsumer] = []
        self._layouts: list[LayoutConsumer] = []
        self._grace_subscribers: list[Callable[[float], None]] = []
        self._answers: list[Callable[[float, float], None]] = []
        self._layout_seen = 0
        # The newest layout read (the one this server routes by): offered when it registers again, so a
        # restarted scheduler adopts it rather than planning a fresh one over servers that hold this one.
        self.layout: Layout | None = None
        self.client = SchedulerClient(
            spec.scheduler_address, "ps", own_address=spec.own_address or "", node_id=spec.node_id,
            rank_hint=spec.task_index, on_view=self._on_view, connect_timeout_s=300.0,
            last_generation=last_generation, security=security,
            scheduler_host="" if spec.scheduler else ("chief-0" if spec.chief else "worker-0"),
            on_answer=self._on_answer, on_left=on_left, offer_layout=lambda: self.layout)

    def subscribe_views(self, consumer: ViewConsumer) -> None:
        self._views.append(consumer)

    def subscribe_layouts(self, consumer: LayoutConsumer) -> None:
        """Every layout newer than the last one handed out (read from the scheduler when a view says so)."""
        self._layouts.append(consumer)

    def subscribe_heartbeat_timeout(self, consumer: Callable[[float], None]) -> None:
        """The scheduler's heartbeat timeout, once registered (called on the registering thread)."""
        self._grace_subscribers.append(consumer)

    def subscribe_answers(self, consumer: Callable[[float, float], None]) -> None:
        """(sending time, heartbeat timeout) of each heartbeat (and the registration) the scheduler
        answered, on `loop`, once the layout that answer brought went to the layout subscribers: a
        server's lease (ps_server/core/lease.py) is renewed only with the newest ownership in place."""
        self._answers.append(consumer)

    def start(self) -> SchedulerClient:
        threading.Thread(target=self._register, name="ps-register", daemon=True).start()
        return self.client

    def _on_view(self, view: ClusterView) -> None:
        # The layout's consumers first: a failover's new ownership is known before the view's quorum.
        if self._layouts and view.layout_version > self._layout_seen:
            try:
                layout = self.client.get_layout(timeout_s=5.0)
            except Exception as e:  # the next view tries again
                log.warning("could not read layout version %d: %s", view.layout_version, e)
            else:
                self._layout_seen = layout.version
                self.layout = layout
                for on_layout in self._layouts:
                    self._loop.call_soon_threadsafe(on_layout, layout)
        for on_view in self._views:
            self._loop.call_soon_threadsafe(on_view, view)

    def _on_answer(self, sent_at: float, timeout_s: float) -> None:
        if not self._answers:
            return
        view = self.client.view
        if self._layouts and view is not None and view.layout_version > self._layout_seen:
            self._on_view(view)  # a layout read that failed before is tried again first
            if view.layout_version > self._layout_seen:
                return
        for consumer in self._answers:
            self._loop.call_soon_threadsafe(consumer, sent_at, timeout_s)

    def _register(self) -> None:
        client, spec = self.client, self._spec
        try:
            sent_at = time.monotonic()
            registration = client.register()
            self._on_answer(sent_at, client.heartbeat_timeout_s)  # armed at once: cut off before a heartbeat
            for consumer in self._grace_subscribers:
                consumer(client.heartbeat_timeout_s)
            log.info("registered with scheduler %s as %s (rank %d, generation %d)", spec.scheduler_address,
                     registration.node_id, registration.rank, registration.generation)
        except Exception:
            if not client.closed:  # a stop (SIGTERM) during registration is not a failure
                log.exception("could not register with scheduler %s", spec.scheduler_address)


class QuorumInstaller:
    """Installs each view's quorum in the dense handlers and the sync tables, on the event loop, and
    installs it again when a forgotten worker's grace runs out."""

    def __init__(self, handlers: ParameterServerHandlers, tables: TableHandlers | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._handlers = handlers
        self._tables = tables
        self._loop = loop
        self._follower = QuorumFollower(grace_s=_FIRST_GRACE_S, now=time.monotonic)
        handlers.follow_views()

    def set_heartbeat_timeout(self, timeout_s: float) -> None:
        self._follower.grace_s = 2 * timeout_s

    def on_view(self, view: ClusterView | None = None) -> None:
        """`view`: None re-evaluates the last one (a grace ran out)."""
        quorum = self._follower.apply(view)
        self._handlers.set_quorum(quorum, view.generation if view is not None else None)
        if self._tables is not None:  # sync tables wait for the same workers
            self._tables.set_quorum(dict(quorum))
        deadline = self._follower.next_deadline()
        if deadline is not None:
            self._loop.call_later(max(0.0, deadline - time.monotonic()) + 0.01, self.on_view)


class ReplicaWiring:
    """A job with replicas: this server's slices and table rows go to the backups each view names,
    the layouts say which are this server's, and each heartbeat says which backups are in sync."""

    def __init__(self, handlers: ParameterServerHandlers, tables: TableHandlers | None, spec: ClusterSpec,
                 loop: asyncio.AbstractEventLoop, report: Callable[[dict[str, int], int], None],
                 security: SecurityConfig | None = None) -> None:
        self._handlers = handlers
        self._node_id = spec.node_id
        self._own = spec.own_address or ""
        self._replicas = handlers.replicas_setting
        self._loop = loop
        self._view: ClusterView | None = None
        self._layout: Layout | None = None  # the newest: which servers are placed, which are joining
        stubs = stub_cache(security)
        send = grpc_sender(security, stubs)
        self.links = links = tcp_links(spec.node_id, security, stubs)  # the slices' and the rows': one each
        self.slices = Replicator(spec.own_address or spec.node_id, send, loop,
                                 shm_dir=handlers.replica_shm_dir, links=links)
        handlers.enable_replication(self.slices)
        # Which backups hold all our slices, with each heartbeat: only those can be promoted.
        self.reporter = InSyncReporter(self.slices, self._own, report)
        self.rows: TableReplication | None = None
        if tables is not None:  # table rows go to the same backups, over the same calls
            self.rows = TableReplication(spec.own_address or spec.node_id, send, loop, tables,
                                         shm_dir=handlers.replica_shm_dir, links=links)
            tables.replication = handlers.table_replication = self.rows
            self.reporter.tables_in_sync = self.rows.in_sync
            self.reporter.copies_in_sync = self.rows.copies_in_sync
        loop.call_soon_threadsafe(self._report)

    def on_view(self, view: ClusterView) -> None:
        self._view = view
        self._set_backups()
        if self.rows is not None:
            self.rows.on_view(view)
        self.reporter.on_view(view)

    def _set_backups(self) -> None:
        """From the newest view and layout: a join's switch (a layout with the joiner) releases the
        donor's old backup, which kept its copy while the joiner caught up."""
        if self._view is None:
            return
        placed = len(self._layout.servers) if self._layout is not None else None
        backups, joining = backup_addresses(self._view, self._node_id, self._replicas, placed)
        self.slices.set_backups([*backups, *joining], catching_up=joining)
        if self.rows is not None:
            self.rows.set_backups([*backups, *joining], catching_up=joining)

    def on_layout(self, layout: Layout) -> None:
        # Each new layout says which slices are this server's: one a failover moved away (this server
        # was declared dead, and is back) is refused from then on, so a worker still routing to it
        # re-routes instead of updating a copy nobody replicates.
        owned = owned_slices(layout, self._own)
        if owned is not None:
            self._handlers.set_ownership(layout.version, owned)
        if self._layout is None or layout.version > self._layout.version:
            self._layout = layout
            self._set_backups()
        if self.rows is not None:  # before the report: a promotion makes the backups copy again
            self.rows.on_layout(layout)
        self.reporter.on_layout(layout)

    def set_heartbeat_timeout(self, timeout_s: float) -> None:
        """Replication sockets notice a silent backup as the scheduler notices a silent node."""
        self.links.dead_after_s = timeout_s

    def _report(self) -> None:
        self.reporter.report()
        self._loop.call_later(IN_SYNC_REPORT_S, self._report)


class MoveWiring:
    """A job without replicas: its table row partitions and dense slices move all the same (issue 20:
    `pshard rebalance`, a drain). The layouts say which slices and partitions are this server's (it
    refuses the others, and counts each partition's load), the views which it copies to a move's or a
    drain's target or takes from a source, and each heartbeat which of its copies are caught up. The rows
    travel by the replication of a job with replicas (`TableReplication`, with no backups), the slices by a
    `Replicator` made at the first copy this server sends (a job that never moves one pays nothing), over
    gRPC."""

    def __init__(self, handlers: ParameterServerHandlers, tables: TableHandlers | None, spec: ClusterSpec,
                 loop: asyncio.AbstractEventLoop, report: Callable[[dict[str, int], int], None],
                 security: SecurityConfig | None = None) -> None:
        self._handlers = handlers
        self._report = report
        self._loop = loop
        self._own = spec.own_address or spec.node_id
        self._send = grpc_sender(security, stub_cache(security))
        self._incarnations = ServerIncarnations(self._own)
        self._view: ClusterView | None = None
        self._layout_version = 0
        self.rows: TableReplication | None = None
        if tables is not None:
            self.rows = TableReplication(self._own, self._send, loop, tables)
            tables.replication = handlers.table_replication = self.rows
        self.slices: Replicator | None = None
        loop.call_soon_threadsafe(self._tick)

    def on_view(self, view: ClusterView) -> None:
        self._view = view
        if self.rows is not None:
            self.rows.on_view(view)
        copies, switched = view.slice_copies_from(self._own)
        if copies and self.slices is None:
            self.slices = Replicator(self._own, self._send, self._loop)
            self._handlers.enable_replication(self.slices)
        restarted = self._incarnations.restarted(view)
        if self.slices is not None:
            for address in restarted:  # a new process holds nothing of its copy
                self.slices.restarted(address)
            self.slices.set_copies(copies, switched)

    def on_layout(self, layout: Layout) -> None:
        # A layout that moved slices away (a drain) makes this server refuse them, and one that gave it
        # slices it holds a copy of makes it take them over (`set_ownership`), as after a failover.
        owned = owned_slices(layout, self._own)
        if owned is not None:
            self._handlers.set_ownership(layout.version, owned)
        self._layout_version = max(self._layout_version, layout.version)
        if self.rows is not None:
            self.rows.on_layout(layout)
        self._send_report()

    def _send_report(self) -> None:
        view = self._view
        rows = self.rows.copies_in_sync() if self.rows is not None else {}
        if view is not None:
            dense, _ = view.slice_copies_from(self._own)
            rows = copies_caught_up(view.copies_from(self._own), rows, dense,
                                    self.slices.copies_in_sync() if self.slices is not None else (),
                                    {n.address: n.generation for n in view.nodes if n.role == "ps"})
        self._report(rows, self._layout_version)

    def _tick(self) -> None:
        self._send_report()
        self._loop.call_later(IN_SYNC_REPORT_S, self._tick)


class LoadReporter:
    """Every LOAD_REPORT_S, the server's load counters for its next heartbeats (issue 20: `pshard status`,
    `pshard rebalance`): bytes in and out over every transport, and with replicated tables the rows
    each row partition served and the bytes (of rows and slice states) a backup still lacks from its
    catch-up copy."""

    def __init__(self, handlers: ParameterServerHandlers, rows: TableReplication | None,
                 report: Callable[[Counters, int], None], loop: asyncio.AbstractEventLoop,
                 slices: Replicator | None = None) -> None:
        self._handlers = handlers
        self._rows = rows
        self._slices = slices
        self._report = report
        self._loop = loop
        loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        traffic = [t for _, t in self._handlers.requests.items()]
        rows: dict[int, int] = {}
        held: dict[int, int] = {}
        left = 0
        if self._rows is not None:
            rows, held = self._rows.load(time.monotonic())
            left = self._rows.copy_bytes_left()
        if self._slices is not None:
            left += self._slices.copy_bytes_left()
        bytes_in, bytes_out = sum(t.bytes_in for t in traffic), sum(t.bytes_out for t in traffic)
        self._report(Counters(bytes_in, bytes_out, rows, held), left)
        self._loop.call_later(LOAD_REPORT_S, self._take)


def follow_scheduler(running: RunningServer, spec: ClusterSpec, loop: asyncio.AbstractEventLoop,
                     security: SecurityConfig | None = None,
                     on_left: Callable[[], None] | None = None) -> SchedulerClient:
    """Register the running server with the scheduler and apply every cluster view to it. `on_left()`
    (on the scheduler client's thread): an operator drained this server (`pshard drain`)."""
    handlers, tables, fast = running.handlers, running.tables, running.fast
    # A restored shard remembers the generations its workers had; a fresh scheduler must hand out newer
    # ones, or the restored fencing refuses the new incarnations (a resumed job's chief could not even
    # pull its final weights).
    restored = handlers.store.newest_generation() if handlers.has_store else 0
    follower = SchedulerFollower(spec, loop, security, last_generation=restored, on_left=on_left)
    rows: TableReplication | None = None
    slices: Replicator | None = None
    if handlers.replicas_setting > 0:
        replicas = ReplicaWiring(handlers, tables, spec, loop, follower.client.report_in_sync, security)
        follower.subscribe_layouts(replicas.on_layout)
        follower.subscribe_views(replicas.on_view)
        follower.subscribe_heartbeat_timeout(replicas.set_heartbeat_timeout)
        follower.subscribe_answers(handlers.renew_lease)  # fenced when it may have been failed over
        rows, slices = replicas.rows, replicas.slices
    else:
        moving = MoveWiring(handlers, tables, spec, loop, follower.client.report_in_sync, security)
        follower.subscribe_layouts(moving.on_layout)
        follower.subscribe_views(moving.on_view)
        rows = moving.rows
    LoadReporter(handlers, rows, follower.client.report_load, loop, slices)
    quorum = QuorumInstaller(handlers, tables, loop)
    follower.subscribe_views(quorum.on_view)
    follower.subscribe_heartbeat_timeout(quorum.set_heartbeat_timeout)
    if fast is not None:  # fast-path sockets notice a silent peer as the scheduler does
        def dead_after(timeout_s: float, fast: FastPathServer = fast) -> None:
            fast.dead_after_s = timeout_s
        follower.subscribe_heartbeat_timeout(dead_after)
    return follower.start()
