"""`SchedulerClient`: how parameter servers and workers join the cluster and follow its view.

Synchronous, with two daemon threads: one sends heartbeats at the interval the scheduler asks
for, one follows the Watch stream and keeps `view` current (calling `on_view` callbacks in
generation order). Unary calls wait for a scheduler that is not up yet and retry while it is
UNAVAILABLE, up to their deadline, through gRPC's own retry policy (`pshard.common.rpc.retry`).
When the scheduler restarts it has forgotten everyone (soft state) and answers
NOT_FOUND: the client re-registers with the same node id, its rank as the hint and the newest
generation it has seen, so ranks are kept, generations keep growing and training goes on.

    with SchedulerClient("scheduler:7000", "worker", node_id="worker-1", rank_hint=1) as client:
        client.register()
        client.barrier("start", count=spec.world_size, timeout_s=60)
        layout = client.get_layout(timeout_s=60)
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from pshard.common.cluster.layout import DEFAULT_SLICE_BYTES, Layout, ParamSpec
from pshard.common.cluster.loads import Counters
from pshard.common.cluster.losses import lost_in, slices_lost_error
from pshard.common.cluster.view import ClusterView, Registration
from pshard.common.errors import (
    NodeLeftError,
    PermissionDeniedError,
    PSError,
    PullTimeoutError,
    StaleGenerationError,
    UnavailableError,
    UnknownNodeError,
)
from pshard.common.rpc.options import channel_options
from pshard.common.rpc.retry import Backoff, scheduler_channel_options
from pshard.common.rpc.status import ERROR_TYPE_KEY, error_from_rpc_error
from pshard.common.security.credentials import SecurityConfig
from pshard.common.security.identity import Identity, identity_from_pem, may_serve_scheduler
from pshard.common.wire.codec import (
    counters_into_proto,
    layout_from_proto,
    layout_to_proto,
    param_spec_to_proto,
    register_to_proto,
    view_from_proto,
)

from pshard.api.v1 import scheduler_pb2 as pb
from pshard.api.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("pshard.scheduler.client")

ViewCallback = Callable[[ClusterView], None]
T = TypeVar("T")

# Extra time on a waiting call's gRPC deadline, so the scheduler's own timeout (which names what
# was missing) arrives before a bare DEADLINE_EXCEEDED.
_WAIT_MARGIN_S = 2.0
# Watch calls get a deadline too (every wait has one); the stream is simply reopened when it ends.
_WATCH_DEADLINE_S = 300.0


class SchedulerClient:
    def __init__(self, address: str, role: str, own_address: str = "", node_id: str | None = None,
                 rank_hint: int | None = None, *, on_view: ViewCallback | None = None,
                 rpc_timeout_s: float = 5.0, connect_timeout_s: float = 30.0,
                 last_generation: int = 0, security: SecurityConfig | None = None,
                 scheduler_host: str | None = None,
                 on_answer: Callable[[float, float], None] | None = None,
                 on_left: Callable[[], None] | None = None,
                 offer_layout: Callable[[], Layout | None] | None = None) -> None:
        """`security`: this node's TLS files or token (pshard.common.security.credentials); default plain.
        `scheduler_host`: with TLS, check once registered that the scheduler's certificate is a
        scheduler's, or that of this task ("chief-0", "worker-0") hosting it ("" when the cluster has a
        scheduler task); None: no check. `on_answer(sent_at, heartbeat_timeout_s)`: a heartbeat sent at
        `sent_at` (time.monotonic()) was answered, after the view it brought went through the view
        callbacks (a server's lease). `on_left()`: the scheduler says this node left without its asking
        (an operator drained it, `pshard drain`): heartbeats stop and it does not register again;
        None: it registers again, as after any refusal naming it unknown. `offer_layout()` (a server):
        the layout it routes by, offered with each registration, so that a restarted scheduler gets
        back the layout in force, failovers included (None: it holds none)."""
        self.address = address
        self.role = role
        self.own_address = own_address
        self._node_id = node_id or ""
        self._rank_hint = rank_hint
        self._rank: int | None = None
        self._generation = 0
        # Newest generation seen anywhere: the floor after a scheduler restart. A node that restored
        # state stamped with generations (a parameter server's checkpoint) starts from those.
        self._max_generation = last_generation
        self._heartbeat_interval_s = 1.0
        self._heartbeat_timeout_s = 5.0
        self._progress = 0
        self._in_sync: tuple[dict[str, int], int] = ({}, 0)
        self._load: tuple[Counters, int] = (Counters(), 0)
        self._reached: Callable[[float], Sequence[str]] | None = None
        self._rpc_timeout_s = rpc_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._security = (security or SecurityConfig()).for_node(role, node_id or "")
        self._scheduler_host = scheduler_host
        self._channel = self._security.channel(
            address, options=[*channel_options(), *scheduler_channel_options()])
        self._stub = pb_grpc.SchedulerServiceStub(self._channel)
        self._lock = threading.Lock()
        self._view_changed = threading.Condition(self._lock)
        self._view: ClusterView | None = None
        self._deliver = threading.Lock()  # one view at a time through the callbacks, in order
        self._register_lock = threading.Lock()
        self._callbacks: list[ViewCallback] = [on_view] if on_view else []
        self._on_answer = on_answer
        self._on_left = on_left
        self._offer_layout = offer_layout
        self._closed = threading.Event()
        self._heartbeats_stopped = threading.Event()
        self._leaving = False  # leave() began: never register again
        self._fenced: PSError | None = None
        self._watch_call: Any = None
        self._threads: list[threading.Thread] = []

    # ---- state ----

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def rank(self) -> int:
        if self._rank is None:
            raise UnknownNodeError(f"{self.role} at {self.own_address or '-'}: not registered yet")
        return self._rank

    @property
    def generation(self) -> int:
        """This incarnation's generation: stamp requests to servers with it."""
        return self._generation

    @property
    def view(self) -> ClusterView | None:
        with self._lock:
            return self._view

    @property
    def fenced(self) -> PSError | None:
        """Why a newer incarnation of this node fenced this process out for good (None: it did not)."""
        return self._fenced

    @property
    def heartbeat_timeout_s(self) -> float:
        """How long the scheduler lets a node stay silent before declaring it dead."""
        return self._heartbeat_timeout_s

    @property
    def heartbeat_interval_s(self) -> float:
        return self._heartbeat_interval_s

    def add_view_callback(self, callback: ViewCallback) -> None:
        self._callbacks.append(callback)

    def report_clock(self, clock: int) -> None:
        """Progress (a worker's clock) sent with the next heartbeats."""
        self._progress = clock

    def report_reached(self, reached: Callable[[float], Sequence[str]]) -> None:
        """A worker: `reached(within_s)` names the servers that answered it within `within_s`; sent with
        each heartbeat, so the scheduler keeps a server only it cannot hear (docs/architecture.md, 9)."""
        self._reached = reached

    def report_load(self, counters: Counters, copy_bytes_left: int = 0) -> None:
        """A server: its load counters and the bytes its backups lack, sent with the next heartbeats."""
        self._load = (counters, copy_bytes_left)

    def report_in_sync(self, copies: dict[str, int], layout_version: int) -> None:
        """A server with replicas: its backups holding all the slices layout `layout_version` makes
        it primary of (address -> the backup's generation), sent with the next heartbeats."""
        self._in_sync = (dict(copies), layout_version)

    def wait_for_view(self, predicate: Callable[[ClusterView], bool], timeout_s: float) -> ClusterView:
        """Block until a view satisfies `predicate`; PullTimeoutError after `timeout_s`."""
        with self._view_changed:
            ok = self._view_changed.wait_for(
                lambda: self._view is not None and predicate(self._view), timeout=timeout_s)
            if not ok:
                generation = self._view.generation if self._view else 0
                raise PullTimeoutError(
                    f"scheduler {self.address}: no cluster view matched within {timeout_s:g} s "
                    f"(latest generation {generation})")
            assert self._view is not None
            return self._view

    # ---- membership ----

    def register(self) -> Registration:
        """Join (or re-join) the cluster; starts the heartbeat and Watch threads the first time."""
        self._check_usable()
        with self._register_lock:
            reg = self._register(self._connect_timeout_s)
        if not self._threads:
            self._start_thread(self._heartbeat_loop, "heartbeat")
            self._start_thread(self._watch_loop, "watch")
        return reg

    def _register(self, timeout_s: float) -> Registration:
        rank_hint = self._rank if self._rank is not None else self._rank_hint
        request = register_to_proto(self.role, self.own_address, node_id=self._node_id or None,
                                    rank_hint=rank_hint, last_generation=self._max_generation,
                                    layout=self._offer_layout() if self._offer_layout is not None else None)
        reply = self._call("Register", self._stub.Register, request, timeout_s)
        self._check_scheduler_identity()
        with self._view_changed:
            self._node_id, self._rank, self._generation = reply.node_id, reply.rank, reply.generation
            # The Watch stream may have delivered this incarnation's view already: wake waiters
            # whose predicates also look at our generation.
            self._view_changed.notify_all()
        self._heartbeat_interval_s = max(reply.heartbeat_interval_ms / 1000, 0.01)
        self._heartbeat_timeout_s = max(reply.heartbeat_timeout_ms / 1000, self._heartbeat_interval_s)
        view = view_from_proto(reply.view)
        self._offer_view(view)
        log.info("registered %s (%s rank %d) with scheduler %s; generation %d",
                 self._node_id, self.role, self._rank, self.address, self._generation)
        return Registration(self._node_id, self._rank, self._generation, view)

    def _check_scheduler_identity(self) -> None:
        """PermissionDeniedError (this client closed) when the scheduler just reached presents a
        certificate that may not serve it (common.security.identity.may_serve_scheduler). Checked
        after a registration, when the scheduler is known to answer: gRPC's client shows no peer
        certificate, so one handshake of our own reads it."""
        if self._scheduler_host is None or not self._security.tls:
            return
        try:
            who = served_identity(self.address, self._security.client_ssl_context(), self._rpc_timeout_s)
        except OSError as err:  # gone again: the next registration checks
            log.warning("could not read the certificate of scheduler %s (%s)", self.address, err)
            return
        if may_serve_scheduler(who, self._scheduler_host):
            return
        self.close()
        expected = "scheduler" + (f" or {self._scheduler_host}" if self._scheduler_host else "")
        raise PermissionDeniedError(
            f"scheduler at {self.address}: its certificate names {who or 'no pshard role'}, expected "
            f"{expected}; refusing it (another node's certificate cannot serve the scheduler: give the "
            "scheduler its own, `pshard certs scheduler`)")

    def _reregister(self, failed_generation: int) -> None:
        """Register again after NOT_FOUND, unless another thread already did."""
        with self._register_lock:
            # Not once leave() began: a heartbeat refused while the node was leaving must not bring it back.
            if self._generation == failed_generation and not self._closed.is_set() and not self._leaving:
                log.warning("scheduler %s forgot %s (restarted, or declared it dead): registering again",
                            self.address, self._node_id)
                self._register(self._connect_timeout_s)

    def leave(self) -> None:
        """Leave the cluster on purpose (a worker that finished). Heartbeats stop first."""
        self._leaving = True
        self._heartbeats_stopped.set()
        if self._rank is None:
            return
        # Under the registration lock: a re-registration the heartbeat thread has in flight (this node was
        # declared dead while cut off, and came back) ends first, and the leave goes from the generation
        # it got. Read before it answered, the generation is the one the scheduler just replaced: the
        # leave was refused as stale and the worker failed at its very end (seen on the namespace hosts).
        with self._register_lock:
            request = pb.LeaveRequest(node_id=self._node_id, generation=self._generation)
            try:
                reply = self._call("Leave", self._stub.Leave, request, self._rpc_timeout_s)
            except UnknownNodeError:
                # The scheduler restarted and we never re-registered: its views do not have us, so the
                # servers no longer wait for us either. Leaving is already done.
                log.info("leave: scheduler %s does not know %s (it restarted); nothing to leave",
                         self.address, self._node_id)
                return
        self._offer_view(view_from_proto(reply.view))

    def hand_over(self) -> None:
        """Leave as a parameter server that serves slices or rows (a drain): the scheduler first hands
        them to an in-sync backup under a new layout. Heartbeats stop only once it has: a refusal (a
        NoInSyncCopyError while the backup still copies) raises with this node still live, to retry."""
        self._check_usable()
        generation = self._generation
        try:
            request = pb.LeaveRequest(node_id=self._node_id, generation=generation)
            reply = self._call("Leave", self._stub.Leave, request, self._rpc_timeout_s)
        except UnknownNodeError:
            # A restarted scheduler forgot this server: the leave goes again from the new incarnation
            # (the first request's generation would be refused as stale).
            self._reregister(generation)
            reply = self._call("Leave", self._stub.Leave,
                               pb.LeaveRequest(node_id=self._node_id, generation=self._generation),
                               self._rpc_timeout_s)
        self._heartbeats_stopped.set()
        self._offer_view(view_from_proto(reply.view))

    # ---- barriers and layout ----

    def barrier(self, name: str, count: int, timeout_s: float) -> int:
        """Wait until `count` nodes reached barrier `name`; returns the generation at release.

        BarrierTimeoutError after `timeout_s`, naming who did not arrive.
        """
        request = pb.BarrierRequest(name=name, count=count, node_id=self._node_id,
                                    timeout_ms=max(1, round(timeout_s * 1000)))
        reply = self._call_registered("Barrier", self._stub.Barrier, request, timeout_s + _WAIT_MARGIN_S)
        return int(reply.generation)

    def propose_layout(self, params: Iterable[ParamSpec], slice_bytes: int = DEFAULT_SLICE_BYTES,
                       servers: Sequence[str] = (), replicas: int = 0) -> Layout:
        """Propose a layout; the first proposal wins and everyone gets the stored one back.

        LayoutConflictError when the stored layout describes other parameters. `servers` empty =
        the live parameter servers the scheduler knows, in rank order.
        """
        request = pb.ProposeLayoutRequest(params=[param_spec_to_proto(p) for p in params],
                                          slice_bytes=slice_bytes, servers=list(servers), replicas=replicas)
        reply = self._call("ProposeLayout", self._stub.ProposeLayout, request, self._rpc_timeout_s * 2)
        return layout_from_proto(reply.layout)

    def restore_layout(self, layout: Layout) -> Layout:
        """Give a restarted scheduler back the job's layout (kept when newer than what it has)."""
        request = pb.ProposeLayoutRequest(restore=layout_to_proto(layout))
        reply = self._call("ProposeLayout", self._stub.ProposeLayout, request, self._rpc_timeout_s * 2)
        return layout_from_proto(reply.layout)

    def newer_layout(self, layout: Layout, timeout_s: float) -> Layout | None:
        """A PSClient's `relayout`: the scheduler's layout once it is newer than `layout` (a failover),
        None at the timeout. SlicesLostError at once when the view names a server `layout` still routes
        to as lost (its failover was refused): no newer layout will come for it."""
        try:
            view = self.wait_for_view(
                lambda view: view.layout_version > layout.version or bool(lost_in(view, layout)), timeout_s)
        except PullTimeoutError:
            return None
        if view.layout_version <= layout.version:
            raise slices_lost_error(lost_in(view, layout), layout)
        newer = self.get_layout(timeout_s=max(1.0, timeout_s))
        return newer if newer.version > layout.version else None

    def get_layout(self, timeout_s: float) -> Layout:
        """The stored layout, waiting up to `timeout_s` for someone to propose one."""
        request = pb.GetLayoutRequest(timeout_ms=max(1, round(timeout_s * 1000)))
        reply = self._call("GetLayout", self._stub.GetLayout, request, timeout_s + _WAIT_MARGIN_S)
        return layout_from_proto(reply.layout)

    # ---- lifecycle ----

    @property
    def closed(self) -> bool:
        """close() was called: a call failing now is the stop, not a fault."""
        return self._closed.is_set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads and close the channel (without leaving: the node will expire)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._heartbeats_stopped.set()
        with self._lock:
            call = self._watch_call
        if call is not None:
            call.cancel()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)
        self._channel.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- machinery ----

    def _check_usable(self) -> None:
        if self._closed.is_set():
            raise UnavailableError(f"scheduler client for {self._node_id or self.role}: closed")
        if self._fenced is not None:
            raise self._fenced

    def _start_thread(self, target: Callable[[], None], what: str) -> None:
        thread = threading.Thread(target=target, name=f"scheduler-{what}-{self._node_id}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _call(self, what: str, method: Callable[..., T], request: Any, timeout_s: float) -> T:
        """One unary call made with wait_for_ready: gRPC waits for a scheduler that is not up yet and
        retries UNAVAILABLE (the channel's retry policy), all within `timeout_s`."""
        try:
            return method(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            err = error_from_rpc_error(e)
            if isinstance(err, UnavailableError) or _gave_up_waiting(e):
                raise UnavailableError(f"scheduler {self.address}: {what} got no answer within "
                                       f"{timeout_s:g} s: {err}") from e
            raise err from e

    def _call_registered(self, what: str, method: Callable[..., T], request: Any, timeout_s: float) -> T:
        """`_call` for RPCs that need a registered node: re-register once on NOT_FOUND."""
        self._check_usable()
        deadline = time.monotonic() + timeout_s
        generation = self._generation
        try:
            return self._call(what, method, request, timeout_s)
        except UnknownNodeError:
            self._reregister(generation)
            return self._call(what, method, request, max(deadline - time.monotonic(), 0.001))

    def _offer_view(self, view: ClusterView) -> None:
        """Adopt `view` if it is newer than the one we have, then tell the callbacks."""
        with self._deliver:
            with self._lock:
                if self._view is not None and view.generation <= self._view.generation:
                    return
                self._view = view
                self._max_generation = max(self._max_generation, view.generation)
                self._view_changed.notify_all()
            for callback in list(self._callbacks):
                try:
                    callback(view)
                except Exception:
                    log.exception("on_view callback failed for generation %d", view.generation)

    def _heartbeat_loop(self) -> None:
        unreachable_since: float | None = None
        while not self._heartbeats_stopped.wait(self._heartbeat_interval_s):
            generation = self._generation
            copies, layout_version = self._in_sync
            reached = self._reached(self._heartbeat_timeout_s) if self._reached is not None else ()
            request = pb.HeartbeatRequest(node_id=self._node_id, generation=generation, clock=self._progress,
                                          in_sync=copies, in_sync_layout=layout_version,
                                          reached_servers=reached)
            counters, copy_bytes_left = self._load
            counters_into_proto(counters, request)
            request.copy_bytes_left = copy_bytes_left
            sent_at = time.monotonic()
            try:
                reply = self._stub.Heartbeat(request, timeout=min(self._rpc_timeout_s,
                                                                  self._heartbeat_timeout_s / 2))
                self._offer_view(view_from_proto(reply.view))
                if self._on_answer is not None:
                    self._on_answer(sent_at, self._heartbeat_timeout_s)
                if unreachable_since is not None:
                    log.info("scheduler %s reachable again after %.1f s", self.address,
                             time.monotonic() - unreachable_since)
                    unreachable_since = None
                continue
            except grpc.RpcError as e:
                err = error_from_rpc_error(e)
            if self._heartbeats_stopped.is_set():
                return
            if isinstance(err, NodeLeftError) and self._on_left is not None:
                log.warning("%s was made to leave the cluster (drained): not registering again",
                            self._node_id)
                self._heartbeats_stopped.set()
                self._on_left()
                return
            if isinstance(err, UnknownNodeError):
                try:
                    self._reregister(generation)
                except PSError as again:
                    log.warning("re-registering %s failed: %s", self._node_id, again)
            elif isinstance(err, StaleGenerationError):
                if self._generation != generation:
                    # This process registered again while the heartbeat was on its way (a drain's leave
                    # to a restarted scheduler does): the newer incarnation is this one, and the next
                    # heartbeat carries its generation.
                    continue
                # A newer incarnation of this node id exists: this process is fenced out for good.
                log.error("%s is fenced out by a newer incarnation: %s", self._node_id, err)
                with self._view_changed:  # waiters for a newer generation of ours: there will be none
                    self._fenced = err
                    self._view_changed.notify_all()
                return
            elif unreachable_since is None:
                unreachable_since = time.monotonic()
                log.warning("heartbeat to scheduler %s failed: %s", self.address, err)

    def _watch_loop(self) -> None:
        # A stream: gRPC cannot retry it once views came back, so this loop reopens it.
        backoff = Backoff(stop=self._closed)
        while not self._closed.is_set():
            call = self._stub.Watch(pb.WatchRequest(after_generation=self._max_generation),
                                    timeout=_WATCH_DEADLINE_S)
            with self._lock:
                self._watch_call = call
            if self._closed.is_set():  # close() ran before the call was visible to it
                call.cancel()
                return
            try:
                for message in call:
                    self._offer_view(view_from_proto(message.view))
                    backoff.reset()
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                    log.debug("watch stream from %s ended: %s", self.address, e)
            backoff.wait()


def _gave_up_waiting(e: grpc.RpcError) -> bool:
    """The client's own deadline passed (the scheduler never answered), not a timeout it reported."""
    if not isinstance(e, grpc.Call) or e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return not any(key == ERROR_TYPE_KEY for key, _ in (e.trailing_metadata() or ()))


def served_identity(address: str, context: ssl.SSLContext, timeout_s: float) -> Identity | None:
    """The pshard identity in the certificate the service at gRPC target `address` presents (None:
    it names none); OSError (ssl.SSLError among them) when no handshake completes."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=timeout_s) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    return identity_from_pem(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None
