"""The Scheduler gRPC service: a thin asyncio layer over `Membership`.

All handlers run on one event loop, so the membership table needs no lock. Waiting RPCs
(Watch, Barrier, GetLayout) wait on a `ChangeSignal` fired on every change: a waiter costs a
coroutine, never a thread, so any number of them cannot starve the heartbeats and registrations
they are waiting for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio
from pshard.common.changes import ChangeSignal
from pshard.common.cluster.layout import DEFAULT_SLICE_BYTES, Layout
from pshard.common.cluster.loads import LoadMeter
from pshard.common.cluster.view import ClusterView
from pshard.common.errors import (
    EmptyRequestError,
    LayoutConflictError,
    PermissionDeniedError,
    PullTimeoutError,
)
from pshard.common.rpc.status import maps_errors
from pshard.common.security.auth import caller, check_acts_as, refused
from pshard.common.wire.codec import (
    counters_from_proto,
    layout_from_proto,
    layout_to_proto,
    load_to_proto,
    param_spec_from_proto,
    register_from_proto,
    timeout_ms_from_proto,
    view_to_proto,
)
from pshard.scheduler.auto_rebalancer import AutoRebalancer
from pshard.scheduler.membership import Membership

from pshard.api.v1 import scheduler_pb2 as pb
from pshard.api.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("pshard.scheduler")

# A Barrier or GetLayout without timeout_ms waits this long at most (and never past the RPC's deadline).
DEFAULT_WAIT_S = 60.0
# Answer a wait's timeout this much before the caller's own gRPC deadline, so the caller gets our
# message naming what was missing instead of a bare DEADLINE_EXCEEDED.
_DEADLINE_MARGIN_S = 0.2
# Who proposes a layout (the trainers compute it), and who may give one back to a restarted scheduler.
PROPOSERS = frozenset({"chief", "worker", "admin"})
RESTORERS = frozenset({"ps", "chief", "admin"})

class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(self, membership: Membership, heartbeat_interval_s: float,
                 rebalancer: AutoRebalancer | None = None) -> None:
        self._members = membership
        self._rebalancer = rebalancer
        self._heartbeat_interval_s = heartbeat_interval_s
        self._changes = ChangeSignal()
        self._closed = False

    # ---- change notification ----

    def _publish(self) -> None:
        """Wake every waiter; they re-read the state."""
        self._changes.notify()

    def _wait_budget(self, timeout_ms: int | None, context: grpc.aio.ServicerContext) -> float:
        budget = timeout_ms / 1000 if timeout_ms is not None else DEFAULT_WAIT_S
        remaining = context.time_remaining()
        if remaining is not None:
            budget = min(budget, remaining - _DEADLINE_MARGIN_S)
        return max(budget, 0.0)

    @property
    def membership(self) -> Membership:
        """The table behind the service (read on its event loop, e.g. by the metrics collector)."""
        return self._members

    def close(self) -> None:
        """End every Watch stream and wake every waiter (the server is stopping)."""
        self._closed = True
        self._publish()

    async def run_expiry(self, period_s: float) -> None:
        """Declare silent nodes dead every `period_s` and publish the new view. Runs until cancelled."""
        while not self._closed:
            await asyncio.sleep(period_s)
            dead = self._members.expire()
            for node in dead:
                log.info("declared %s dead (%s rank %d at %s): silent for %.1f s; generation %d",
                         node.node_id, node.role, node.rank, node.address or "-",
                         self._members.silent_for(node.node_id), self._members.generation)
            if dead:
                self._publish()

    async def run_auto_rebalance(self, period_s: float) -> None:
        """Decide on an automatic move every `period_s` (a heartbeat interval: the loads change no faster)
        and publish the view when one started. Runs until cancelled."""
        assert self._rebalancer is not None
        while not self._closed:
            await asyncio.sleep(period_s)
            if self._rebalancer.tick():
                self._publish()

    # ---- membership ----

    @maps_errors
    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> pb.RegisterResponse:
        args = register_from_proto(request)
        who = caller()
        if who is not None:  # a node registers only as what its credential names
            if who.role != args.role:
                refused("Register")
                raise PermissionDeniedError(
                    f"Register: credential {who} may not register as role {args.role!r}")
            if who.node_id and not args.node_id:
                args = args._replace(node_id=who.node_id)
            if args.node_id:
                check_acts_as(args.node_id, "Register")
        before = self._members.view().node(args.node_id) if args.node_id else None
        reg = self._members.register(**args._asdict(), layout=self._offered_layout(request))
        log.info("%s %s (%s rank %d at %s); generation %d",
                 "re-registered" if before else "registered", reg.node_id, args.role, reg.rank,
                 args.address or "-", reg.generation)
        self._publish()
        return pb.RegisterResponse(
            node_id=reg.node_id, rank=reg.rank, generation=reg.generation, view=view_to_proto(reg.view),
            heartbeat_interval_ms=round(self._heartbeat_interval_s * 1000),
            heartbeat_timeout_ms=round(self._members.heartbeat_timeout_s * 1000))

    @maps_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatResponse:
        check_acts_as(request.node_id, "Heartbeat")
        counters = counters_from_proto(request)
        LoadMeter.check(request.node_id, counters)  # a bad report is refused before the heartbeat counts
        view = self._members.heartbeat(request.node_id, request.generation, request.clock,
                                       dict(request.in_sync), request.in_sync_layout,
                                       list(request.reached_servers))
        self._members.report_load(request.node_id, counters, request.copy_bytes_left)
        return pb.HeartbeatResponse(view=view_to_proto(view))

    @maps_errors
    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        check_acts_as(request.node_id, "Leave")  # a node leaves only for itself (admin: any)
        before = self._members.generation
        view = self._members.leave(request.node_id, request.generation)
        if view.generation != before:
            log.info("%s left; generation %d", request.node_id, view.generation)
            self._publish()
        return pb.LeaveResponse(view=view_to_proto(view))

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.WatchResponse]:
        sent = request.after_generation

        def newer() -> ClusterView | None:
            view = self._members.view()
            return view if view.generation > sent or self._closed else None

        while not self._closed:
            view = await self._changes.wait_for(newer)
            if view is not None and view.generation > sent:
                yield pb.WatchResponse(view=view_to_proto(view), drains=self._drains(),
                                       loads=self._loads(view), moves=self._moves(), joins=self._joins(),
                                       auto_rebalance=self._auto_rebalance())
                sent = view.generation

    def _drains(self) -> list[pb.Drain]:
        now = self._members.clock_now()
        return [pb.Drain(node_id=d.node_id, address=d.address, heir=d.heir, slices=d.slices,
                         partitions=d.partitions, layout_version=d.layout_version, seconds=d.seconds(now),
                         done=d.done) for d in self._members.drains.all()]

    def _joins(self) -> list[pb.Join]:
        now = self._members.clock_now()
        return [pb.Join(node_id=j.node_id, address=j.address, donor=j.donor, slices=j.slices,
                        partitions=j.partitions, bytes=j.nbytes, layout_version=j.layout_version,
                        seconds=j.seconds(now), done=j.done and j.took, rolled_back=j.rolled_back,
                        bytes_left=j.bytes_left)
                for j in self._members.joins.all()]

    def _auto_rebalance(self) -> pb.AutoRebalance:
        if self._rebalancer is None:
            return pb.AutoRebalance(enabled=False)
        s = self._rebalancer.status()
        return pb.AutoRebalance(enabled=True, threshold=s.threshold, cooldown_s=s.cooldown_s, moves=s.moves,
                                last_move=s.last_move, since_last_move_s=s.since_last_move_s or 0.0,
                                eligible_in_s=s.eligible_in_s, reason=s.reason)

    def _loads(self, view: ClusterView) -> list[pb.ServerLoad]:
        return [load_to_proto(self._members.loads.load(n.address)) for n in view.live("ps")]

    def _moves(self) -> list[pb.PartitionMove]:
        now = self._members.clock_now()
        copying = [pb.PartitionMove(partition=c.partition, source=c.source, target=c.target, bytes=c.nbytes,
                                    bytes_copied=c.nbytes - c.bytes_left, bytes_left=c.bytes_left,
                                    seconds=now - c.started)
                   for c in self._members.copies.in_progress()]
        return copying + [pb.PartitionMove(partition=m.partition, source=m.source, target=m.target,
                                 layout_version=m.layout_version, bytes=m.nbytes, bytes_copied=m.bytes_copied,
                                 bytes_left=m.bytes_left, seconds=m.seconds(now), done=m.done)
                for m in self._members.moves.all()]

    @maps_errors
    async def MovePartition(self, request: pb.MovePartitionRequest, context: grpc.aio.ServicerContext
                            ) -> pb.MovePartitionResponse:
        who = caller()
        if who is not None and who.role != "admin":  # an operator's `pshard rebalance`
            refused("MovePartition")
            raise PermissionDeniedError(f"MovePartition: credential {who} may not move partitions (an admin "
                                        "may)")
        limits = self._members.limits
        limits.check_chars("move target", request.target, limits.max_address_chars)
        layout = self._members.move_partition(request.partition, request.target, request.layout_version)
        self._publish()
        # Not on the target yet: a catch-up copy runs first, and the switch comes with a later layout.
        copying = layout.servers[layout.row_owner(request.partition)] != request.target
        return pb.MovePartitionResponse(layout_version=layout.version, copying=copying)

    # ---- barriers ----

    @maps_errors
    async def Barrier(self, request: pb.BarrierRequest, context: grpc.aio.ServicerContext
                      ) -> pb.BarrierResponse:
        check_acts_as(request.node_id, "Barrier")
        arrival = self._members.arrive(request.name, request.count, request.node_id)
        if arrival.released:
            self._publish()
        budget = self._wait_budget(timeout_ms_from_proto(request), context)
        try:
            released = await self._changes.wait_for(
                lambda: True if self._members.barrier_released(arrival.name, arrival.round) else
                False if self._closed else None, time.monotonic() + budget)
            if not released:
                raise self._members.barrier_timeout(arrival.name, arrival.round, request.node_id, budget)
        except asyncio.CancelledError:
            # The caller went away: it must not be counted in a round it no longer waits for.
            if not self._members.barrier_released(arrival.name, arrival.round):
                self._members.barrier_timeout(arrival.name, arrival.round, request.node_id, budget)
            raise
        return pb.BarrierResponse(generation=self._members.generation)

    def _offered_layout(self, request: pb.RegisterRequest) -> Layout | None:
        """A registering server's layout, its counts checked before it is decoded (as a restore's)."""
        if not request.HasField("layout"):
            return None
        proto = request.layout
        limits = self._members.limits
        self._members.check_layout_request(len(proto.params), proto.servers)
        limits.check_int("offered layout slices", len(proto.slices), limits.max_layout_slices)
        return layout_from_proto(proto)

    # ---- layout ----

    @maps_errors
    async def ProposeLayout(self, request: pb.ProposeLayoutRequest, context: grpc.aio.ServicerContext
                            ) -> pb.ProposeLayoutResponse:
        if request.HasField("restore"):
            return self._restore_layout(request.restore)
        who = caller()
        if who is not None and who.role not in PROPOSERS:  # a server may only give a layout back
            refused("ProposeLayout")
            raise PermissionDeniedError(f"ProposeLayout: credential {who} may not propose a layout")
        # Counts first: decoding and planning cost CPU on the event loop every caller shares.
        self._members.check_layout_request(len(request.params), request.servers)
        params = [param_spec_from_proto(p) for p in request.params]
        if not params:
            raise EmptyRequestError("params: got none, a layout needs at least one parameter")
        servers = list(request.servers) or [n.address for n in self._members.view().live("ps")]
        if self._members.held_layout() is not None:
            # Restarted, with servers that route by a layout this scheduler lost: the layout comes back
            # (a server's offer, the chief's restore), and the proposer gets it as a joining worker does.
            await self._changes.wait_for(
                lambda: self._members.held_layout() is None or (False if self._closed else None),
                time.monotonic() + self._wait_budget(None, context))
        existing = self._members.layout()
        if not servers and existing is not None:
            servers = list(existing.servers)  # only compared, never re-planned
        if not servers:
            raise EmptyRequestError("servers: got none, and no parameter server is registered and live")
        layout, created = self._members.propose_layout(
            self._members.plan(params, servers, request.slice_bytes or DEFAULT_SLICE_BYTES, request.replicas))
        if created:
            log.info("layout version %d: %d params in %d slices on %d servers; generation %d",
                     layout.version, len(layout.params), len(layout.slices), len(layout.servers),
                     self._members.generation)
            self._publish()
        return pb.ProposeLayoutResponse(layout=layout_to_proto(layout), created=created)

    def _restore_layout(self, proto: pb.Layout) -> pb.ProposeLayoutResponse:
        """A member's layout after this scheduler restarted: kept if newer, failovers and all."""
        self._check_may_restore()
        limits = self._members.limits
        self._members.check_layout_request(len(proto.params), proto.servers)
        limits.check_int("layout slices", len(proto.slices), limits.max_layout_slices)
        try:
            layout, restored = self._members.restore_layout(layout_from_proto(proto))
        except LayoutConflictError as e:
            log.warning("refused a layout restore from %s: %s", caller() or "a caller", e)
            raise
        if restored:
            log.info("layout version %d restored from a member that holds it (this scheduler restarted); "
                     "generation %d", layout.version, self._members.generation)
            self._publish()
        return pb.ProposeLayoutResponse(layout=layout_to_proto(layout), created=restored)

    def _check_may_restore(self) -> None:
        """Only a role that holds the job's layout across a scheduler restart may give it back: a
        server, the chief, worker-0 where the job has no chief (it plays the chief), or an admin
        (issue 23, item 5). Other workers hold it too, but any one of them could forge it."""
        who = caller()
        if who is None or who.role in RESTORERS:
            return
        chiefless = not any(n.role == "chief" for n in self._members.view().nodes)
        if who.role == "worker" and who.node_id == "worker-0" and chiefless:
            return
        refused("ProposeLayout")
        raise PermissionDeniedError(f"ProposeLayout: credential {who} may not restore the layout (a server, "
                                    "the chief, or worker-0 of a job without a chief may)")

    @maps_errors
    async def GetLayout(self, request: pb.GetLayoutRequest, context: grpc.aio.ServicerContext
                        ) -> pb.GetLayoutResponse:
        budget = self._wait_budget(timeout_ms_from_proto(request), context)
        layout = await self._changes.wait_for(
            lambda: self._members.layout() or (False if self._closed else None), time.monotonic() + budget)
        if not layout:
            raise PullTimeoutError(f"layout: none proposed within {budget:.3g} s (layout version 0)")
        return pb.GetLayoutResponse(layout=layout_to_proto(layout))
