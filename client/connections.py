"""What a worker holds open to a job's parameter servers, shared by PSClient and the tables client.

One `ServerConnections` owns, per server, the gRPC channel (and says once when a server drops out and
when it is back), the fast-path session (client/fast_session.py: negotiated when a try is due, dropped
when it breaks, gRPC meanwhile), the thread pool that calls every server at once, and the layout calls
are routed by, with the way to a newer one a failover publishes. PSClient (client/ps_client.py) and
TableClient (client/tables.py) are each handed it; neither reaches into the other.

The servers are the routing layout's: a layout that lists a server this client has not heard of (one that
joined the running job, issue 20) opens its connections before any call is routed by it, and the clients
that keep per-server stubs are told (`on_server_added`). A layout whose list is not the servers known here
followed by new ones (an index names another address) is refused: routing by it would send slices to
the wrong server, and leaving them out would stop training them without a word.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeGuard

import grpc
from pshard.client.fast_session import FastPath
from pshard.common.cluster.layout import Layout
from pshard.common.errors import (
    LayoutConflictError,
    PartitionMovedError,
    PSError,
    SliceMovedError,
    UnavailableError,
)
from pshard.common.rpc.options import channel_options
from pshard.common.rpc.retry import parameter_server_channel_options
from pshard.common.security.credentials import SecurityConfig
from pshard.common.wire.fastwire import FastPortSilent
from pshard.common.wire.liveness import DEFAULT_DEAD_AFTER_S, figures

from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc

# A server refuses a row partition or a dense slice that a newer layout than it knows moved to it
# (server_behind), and a sync table push routed with a layout it has not received yet (LayoutNotYetError):
# the request goes again after this.
NOT_YET_WAIT_S = 0.05


def server_behind(err: Exception, layout: Layout | None) -> bool:
    """A server refused a row partition or a dense slice by an older layout than the one the request was
    routed with: it has not received the newer one yet (a move, a drain or a join switched it). No newer
    layout is coming, so the request goes again in a moment, as a LayoutNotYetError's does; waiting for a
    newer one held it for the whole re-route wait, and a dense step gave up."""
    if not isinstance(err, (PartitionMovedError, SliceMovedError)) or layout is None:
        return False
    known = err.facts.get("layout_version", 0)
    return isinstance(known, int) and 0 < known < layout.version

log = logging.getLogger("pshard.client")

# After a fast path failed to open or broke, gRPC carries the calls for this long before a new try.
FAST_PATH_RETRY_S = 10.0
_CLOSE_WATCH_WAIT_S = 1.0  # at most, for every channel of a client together (see `close`)
# (layout, timeout_s) -> a layout newer than `layout` once the scheduler publishes one, else None.
Relayout = Callable[[Layout, float], "Layout | None"]


class GrowingPool(ThreadPoolExecutor):
    """A thread pool whose bound can rise: a server added to the layout gets its threads too. The
    executor reads the bound at each submit and starts threads only as calls need them."""

    def at_least(self, max_workers: int) -> None:
        self._max_workers = max(self._max_workers, max_workers)


class ServerConnections:
    def __init__(self, servers: Sequence[str], worker_id: str, security: SecurityConfig, *, timeout_s: float,
                 transport: str, shm_dir: str, layout: Layout | None = None, relayout: Relayout | None = None,
                 reroute_wait_s: float = 15.0, dead_after_s: float = DEFAULT_DEAD_AFTER_S,
                 room: Callable[[int], int] = lambda server: 0) -> None:
        """`transport`: "auto", "shm", "tcp" or "grpc" (PSClient checked it); `room(server)`: the bytes a
        fast-path session with that server must hold each way (asked when one is negotiated);
        `dead_after_s`: a server silent this long breaks its raw TCP session (common.wire.liveness)."""
        figures(dead_after_s)  # a bad figure fails here, not at the first step
        self.servers: tuple[str, ...] = ()
        self.worker_id = worker_id
        self.security = security
        self.timeout_s = timeout_s
        self._relayout = relayout
        self.reroute_wait_s = reroute_wait_s
        self._room = room
        self._options = [*channel_options(), *parameter_server_channel_options()]
        # Before the subscriptions below: their callbacks may run at once, on gRPC's thread, and read it.
        self.closed = threading.Event()
        # gRPC retries unary calls silently; say once when a server drops out and when it is back.
        self.unreachable: set[str] = set()
        # Per server, by its index in the layout: channel, connectivity watcher, stub, fast path (the open
        # one, when the next try is due, its lock) and what carries its calls. Grown by _add only.
        self.channels: list[grpc.Channel] = []
        self._watchers: list[Callable[[grpc.ChannelConnectivity], None]] = []
        # Set by each channel's first connectivity callback: see `close`.
        self._watching: list[threading.Event] = []
        self._stubs: list[pb_grpc.ParameterServerServiceStub] = []
        self._fast: list[FastPath | None] = []
        self._fast_retry_at: list[float] = []
        self._fast_locks: list[threading.Lock] = []
        self.transports: list[str] = []
        self._transport = transport
        self._shm_dir = shm_dir
        self._dead_after_s = dead_after_s
        # One thread per server drives its stream; a second set lets a push future overlap a pull. A
        # server added later raises the bound (the pool makes threads only as calls need them).
        self.pool = GrowingPool(max_workers=2 * max(1, len(servers)), thread_name_prefix="psclient")
        # Called with each server's index once its channel is open (PSClient's and TableClient's stubs).
        self.on_server_added: list[Callable[[int], None]] = []
        self._grow = threading.Lock()
        for address in servers:
            self._add(address)
        # The layout calls are routed by. Set it through `use_layout`, which opens connections to the
        # servers it adds first; a plain attribute for readers, since a step reads it several times and
        # every Python call counts there (tests/service/test_hot_path_calls.py).
        self.layout: Layout | None = None
        if layout is not None:
            self.use_layout(layout)

    # ---- routing ----

    def use_layout(self, layout: Layout | None) -> None:
        """Route calls by `layout` from now on, once connections to the servers it adds are open."""
        if layout is not None:
            self.serve(layout.servers, f"layout version {layout.version}")
        self.layout = layout

    def serve(self, servers: Sequence[str], what: str) -> None:
        """Open connections to the servers of `servers` not connected yet, which must all come after the
        known ones: LayoutConflictError naming the index and both addresses when one is not."""
        with self._grow:
            for index, (known, wanted) in enumerate(zip(self.servers, servers, strict=False)):
                if known != wanted:
                    raise LayoutConflictError(
                        f"{what}: server {index} is {wanted}, this worker's server {index} is {known}; a "
                        "layout may only add servers after the job's (a joining server), never re-order or "
                        f"replace one (this worker knows {', '.join(self.servers)}, the layout lists "
                        f"{', '.join(servers)})")
            added = list(servers[len(self.servers):])
            for address in added:
                self._add(address)
        for address in added:
            log.warning("server %s joined the layout (%s): this worker connects to it as server %d", address,
                        what, self.servers.index(address))

    def _add(self, address: str) -> None:
        if self.closed.is_set():
            raise UnavailableError(f"server {address}: this client is closed")
        channel = self.security.channel(address, options=self._options)
        watching = threading.Event()
        watcher = functools.partial(self._on_connectivity, address, watching)
        self.channels.append(channel)
        self._watchers.append(watcher)
        self._watching.append(watching)
        self._stubs.append(pb_grpc.ParameterServerServiceStub(channel))
        self._fast.append(None)
        self._fast_retry_at.append(0.0)
        self._fast_locks.append(threading.Lock())
        self.transports.append("grpc")
        self.servers = (*self.servers, address)  # last: a reader of `servers` finds every list grown
        channel.subscribe(watcher, try_to_connect=False)
        self.pool.at_least(2 * len(self.servers))
        index = len(self.servers) - 1
        for added in self.on_server_added:
            added(index)

    def set_layout(self, layout: Layout) -> None:
        """Route by `layout` from now on (a failover moved slices to their backups' servers, or a join
        to a new one)."""
        self.use_layout(layout)
        for server in range(len(self.servers)):  # their buffers were sized for the old slices
            with self._fast_locks[server]:
                self._drop(server)

    @property
    def dead_after_s(self) -> float:
        """How long a server may stay silent before it counts as gone (the job's heartbeat timeout)."""
        return self._dead_after_s

    @property
    def can_reroute(self) -> bool:
        """A newer layout can be asked for (the client was given the scheduler's): a partition that
        `pshard rebalance` moved is re-routed to, with replicas or without."""
        return self._relayout is not None

    @property
    def fails_fast(self) -> bool:
        """`fails_fast_under` the layout calls are routed by now."""
        return self.fails_fast_under(self.layout)

    def fails_fast_under(self, layout: Layout | None) -> TypeGuard[Layout]:
        """Re-routable under a replicated `layout`: a server that is down is not waited for, the call goes
        to the newer layout the scheduler publishes once it failed the server over. A step re-routed to a
        layout that still names a dead server (its failover refused) must fail at once, not wait for it in
        a fast path's negotiation (10 s per kind), so the scheduler's refusal reaches it."""
        return self._relayout is not None and layout is not None and bool(layout.replicas)

    def newer_layout(self, layout: Layout, left_s: float) -> Layout | None:
        """A layout newer than `layout`, waited for up to `left_s` (at most `reroute_wait_s`); else None."""
        if self._relayout is None:
            return None
        newer = self._relayout(layout, min(left_s, self.reroute_wait_s))
        return newer if newer is not None and newer.version > layout.version else None

    # ---- fast paths (shared memory, raw TCP) ----

    def session(self, server: int) -> FastPath | None:
        """The server's open fast path, negotiating one when none is (and a try is due)."""
        if self._transport == "grpc":
            return None
        with self._fast_locks[server]:
            fast = self._fast[server]
            if fast is not None or time.monotonic() < self._fast_retry_at[server] or self.closed.is_set():
                return fast
            room = self._room(server)
            reasons = []
            for kind in ("shm", "tcp") if self._transport == "auto" else (self._transport,):
                try:
                    fast = FastPath.open(kind, self._stubs[server], self.servers[server], self.worker_id,
                                         request_bytes=room, reply_bytes=room, shm_dir=self._shm_dir,
                                         timeout_s=min(self.timeout_s, 10.0),
                                         ssl_context=self.security.client_ssl_context() if self.security.tls
                                         else None, dead_after_s=self._dead_after_s,
                                         wait_for_ready=not self.fails_fast)
                except FastPortSilent as err:
                    # Each try would block a step as long again (issue 24): this server's calls stay on
                    # gRPC for this client's life, said once.
                    self._fast_retry_at[server] = math.inf
                    log.warning("server %s: %s; not tried again by this worker", self.servers[server], err)
                    return None
                except PSError as err:
                    reasons.append(f"{kind}: {err}")
                    continue
                self._fast[server], self.transports[server] = fast, kind
                log.info("server %s: push and pull over %s", self.servers[server], kind)
                return fast
            self._fast_retry_at[server] = time.monotonic() + FAST_PATH_RETRY_S
            log.info("server %s: push and pull over grpc (%s)", self.servers[server], "; ".join(reasons))
            return None

    def sessions(self) -> list[FastPath | None]:
        """Each server's fast-path session open now (None: its calls ride gRPC); negotiates nothing."""
        return list(self._fast)

    def broke(self, server: int, fast: object) -> None:
        """`fast` broke under a call: gRPC carries the server's calls until a new try is due (unless another
        thread replaced the session meanwhile)."""
        with self._fast_locks[server]:
            if self._fast[server] is fast:
                self._drop(server)
                self._fast_retry_at[server] = time.monotonic() + FAST_PATH_RETRY_S

    def _drop(self, server: int) -> None:
        fast, self._fast[server] = self._fast[server], None
        self.transports[server] = "grpc"
        if fast is not None:
            fast.close()

    # ---- lifecycle ----

    def _on_connectivity(self, address: str, watching: threading.Event,
                         state: grpc.ChannelConnectivity) -> None:
        watching.set()
        if self.closed.is_set():
            return
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE and address not in self.unreachable:
            self.unreachable.add(address)
            log.warning("parameter server %s unreachable (not running there yet, or refusing this worker's "
                        "TLS): calls wait for it, retrying until their deadline (%g s)", address,
                        self.timeout_s)
        elif state is grpc.ChannelConnectivity.READY and address in self.unreachable:
            self.unreachable.discard(address)
            log.info("server %s reachable again", address)

    def close(self, owned: bool = True) -> None:
        """`owned`: False in a forked child, whose copy's channels, sockets and threads are the parent's."""
        if self.closed.is_set():
            return
        self.closed.set()
        if not owned:
            return
        for server in range(len(self.servers)):  # unlocked: a session being negotiated may hold a lock
            self._drop(server)
        # Channels first: closing one cancels its calls, so a pool thread blocked in a sync pull
        # (a stop, SIGTERM, in mid-step) ends now instead of at its deadline.
        # grpcio's connectivity poller (one thread per subscribed channel) reads the channel's state once
        # before its first callback; a channel closed before that read makes the thread die with
        # "Cannot monitor channel state: Channel closed!" on stderr (most clients closed within a
        # millisecond of being made did). Its first callback means the read is done: wait for it, bounded.
        deadline = time.monotonic() + _CLOSE_WATCH_WAIT_S
        # Every poller is told first, then the channels close: a close waits for its poller's 0.2 s turn,
        # so one channel after the other cost 0.2 s a server.
        for channel, watcher, watching in zip(self.channels, self._watchers, self._watching, strict=True):
            watching.wait(max(0.0, deadline - time.monotonic()))
            channel.unsubscribe(watcher)
        for channel in self.channels:
            channel.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
