"""The parameter server's fast paths: shared memory on one host, a raw TCP socket between hosts.

Both are adapters over the same handlers as the gRPC servicer (`ParameterServerHandlers.exchange`),
so consistency, idempotence, fencing, validation and errors are those of gRPC; only where the
bytes travel differs (docs/architecture.md, 11 Transports):

* negotiation is a gRPC call, `OpenTransport`: the server hands out a session id and secret, and
  where to connect: for tcp the port of its TCP listener, for shm the name of its unix socket in
  the shared directory;
* the worker connects there; its first frame must carry the secret, else the server closes the
  socket. For shm that frame also carries the segment's descriptor: a memfd sealed against any
  change of size (common/wire/shm.py says why: a worker must not be able to SIGBUS the server),
  which the server checks and maps before answering with the nonce it read inside. Then each
  request is an ExchangeHeader frame, answered by a TransportReply frame.
  Over TCP the gradients follow the header and the pulled slices follow the reply; over shm both
  stay in the segment and the socket only carries these small frames (the doorbell);
* each connection is a task on the server's event loop: it reads into the session's page-aligned
  request region (`recv_into`) and awaits the handler, with no thread hop. A large TCP request is
  pipelined: the Exchange core applies each pushed slice as soon as its bytes are in, and each
  pulled slice is sent (a SLICE frame) as soon as it is ready, before the reply. Pulled slices are
  copied once, under the slice's lock, into a slot of the reply region that belongs to that slice
  for the session's lifetime: a pull at version v returns exactly v's bytes, and sync mode's
  shared-encoding cache stays valid per slot;
* sparse-table requests (EXCHANGE_OP_TABLE) ride the same sessions: ps_server.transport.table_fast hands
  their bytes to the table handlers and writes the pulled rows past the dense slots;
* a session ends with its socket: a worker that closes, dies or is SIGKILLed is noticed at once
  (EOF, even while its pull waits) and its segment is unmapped (a memfd: no file to remove); a
  session never connected expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc.aio
import numpy as np
from google.protobuf.message import DecodeError
from pshard.common.chunks import shared_pool
from pshard.common.compression import PullPack
from pshard.common.errors import InvalidArgumentError, PermissionDeniedError, PSError
from pshard.common.rpc.options import EXCHANGE_METHOD
from pshard.common.rpc.status import maps_errors
from pshard.common.security.auth import AuthRefusals, caller, check_acts_as
from pshard.common.types import SliceKey
from pshard.common.wire import codec
from pshard.common.wire.codec import WireArray
from pshard.common.wire.fastwire import TransportBroken
from pshard.common.wire.liveness import DEFAULT_DEAD_AFTER_S
from pshard.common.wire.shm import Segment, align, listen, remove, sweep_orphans
from pshard.ps_server.core.store import SliceMeta
from pshard.ps_server.handlers.dense import EncodedSlice, ExchangeDone, ParameterServerHandlers
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.transport.budget import WasteTarpit
from pshard.ps_server.transport.fastconn import (
    HELLO_TIMEOUT_S,
    Connection,
    Inflow,
    Session,
    SliceWriter,
    error_reply,
    receive_hello,
    send_hello,
)
from pshard.ps_server.transport.replica_tcp import serve_replicate
from pshard.ps_server.transport.table_fast import serve_table
from pshard.ps_server.transport.tarpit import wasted_reply
from pshard.ps_server.transport.tls_relay import TlsRelay, describe

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.transport")

TRANSPORTS = ("auto", "shm", "tcp", "grpc")
KIND_NAMES = {pb.TRANSPORT_KIND_SHM: "shm", pb.TRANSPORT_KIND_TCP: "tcp"}
# A negotiated session whose worker never connects is dropped (and its segment unmapped) after this.
_ATTACH_TIMEOUT_S = 30.0
# A TLS handshake is the peer proving its certificate: a few round trips, longer than a hello on a
# busy host, still short (the connection holds the TLS layer's buffers meanwhile).
_HANDSHAKE_TIMEOUT_S = 5.0
# Connections that have not sent their hello yet (TCP and shm hand-offs together): each holds a few KiB
# for at most HELLO_TIMEOUT_S, and past this many the newest are closed at once. Workers send their
# hello right after connecting, so only a crowd of strangers ever reaches it.
MAX_GREETING = 32
# Requests moving at most this many bytes take the plain push_pull handler; larger ones the
# Exchange core, which overlaps a slice's push with the pull of those already applied.
_SMALL_BYTES = 1 << 20
_SESSIONS_PER_WORKER = 4
# Regions larger than the shard (in any dtype) plus slack are refused: a client cannot make us
# reserve memory the job cannot use.
_SLACK_BYTES = 16 * 2**20


class TransportRefusedError(PSError):
    """This server does not offer the transport asked for (its --transport, or no shared directory)."""

    status = "FAILED_PRECONDITION"


def offered_kinds(transport: str) -> frozenset[str]:
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"transport: got {transport!r}, expected one of {TRANSPORTS}")
    return frozenset({"shm", "tcp"} if transport == "auto" else {transport} - {"grpc"})


# What a session's encoder hands back: the key, the slot's offset and size, and (lending) the value.
_Payload = tuple[SliceKey, int, int, "np.ndarray | None"]


class _SlotEncoder:
    """The handlers' encoder for one session: copies a pulled slice into its slot of the reply region.

    The handlers call it under the slice's lock for the pulled keys in request order, and the
    session's serving loop names the key it expects next (`expect`); the payload repeats the key so
    the loop can check the pairing. Hashable by identity: sync mode caches payloads per encoder.

    `lend`: sync mode over TCP, where the copy is a fifth of a server's CPU per dense step. The
    payload is a view of the value itself and the serving loop sends from it: a sync slice
    changes only once every worker pushed the next clock, and this worker pushes it only after
    the whole reply (its slices written to the socket first). The loop checks the slice's version
    after each send all the same: a slice that changed under it (a quorum that dropped this worker)
    breaks the path, and the worker pulls again over gRPC.
    """

    def __init__(self, session: _Session, lend: bool = False) -> None:
        self.session: _Session | None = session
        self.expect: SliceKey | None = None
        self.lend = lend

    def __call__(self, wire: WireArray) -> _Payload:
        session, key = self.session, self.expect
        if session is None or key is None:
            raise TransportBroken("fast-path session closed while serving a request")
        src = np.ascontiguousarray(wire.array).reshape(-1).view(np.uint8)
        # The slot is taken even when lending: its size is what tells a small request (the session's
        # pulled_bytes) from a large one.
        offset = session.slot(key, src.nbytes)
        if self.lend:
            return key, offset, src.nbytes, src
        shared_pool().copy(session.regions.reply[offset:offset + src.nbytes], src)  # multi-MiB: threads
        return key, offset, src.nbytes, None


class _Session:
    def __init__(self, worker_id: str, kind: str, regions: Segment) -> None:
        self.id = secrets.randbits(63)
        self.secret = secrets.token_bytes(32)
        self.worker_id = worker_id
        self.kind = kind
        self.peer = f"{kind}-session:{self.id}"  # its name in the tarpit: made once, not per request
        self.regions = regions
        self.encoder = _SlotEncoder(self)
        self.lender = _SlotEncoder(self, lend=True)  # a cache of its own: its payloads are not slots
        self.conn: Connection | None = None  # once the worker connected with the secret
        self.claimed = False  # a connection presented the secret (one only, ever)
        self.want = (0, 0)  # the request and reply bytes negotiated
        self.closed = False
        # Opened by a server: may carry its replication (ps_server/transport/replica_tcp.py).
        self.replicates = False
        self._slots: dict[SliceKey, tuple[int, int, int]] = {}  # key -> (offset, last size, room)
        self._reply_end = 0
        self._pull: tuple[Sequence[object], list[SliceKey]] | None = None
        self._wires: tuple[Sequence[SliceMeta], list[WireArray], list[tuple[SliceKey, WireArray]], int
                            ] | None = None

    def decoded(self, header: pb.ExchangeHeader, metas: Sequence[SliceMeta], views: Sequence[np.ndarray]
                ) -> tuple[list[SliceKey], list[WireArray], list[tuple[SliceKey, WireArray]], int]:
        """The pulled keys, the pushed arrays, as (key, array) items, and their bytes: reused while a
        request pulls the same slices as the one before, and pushes the same (the connection hands the
        very same `metas` then)."""
        if self._pull is None or self._pull[0] != header.pull:
            self._pull = (header.pull, [codec.slice_id_from_proto(s) for s in header.pull])
        if self._wires is None or self._wires[0] is not metas:
            wires = [WireArray(view.view(codec.numpy_dtype(meta.dtype)).reshape(meta.shape), meta.dtype,
                               meta.encoding)
                     for meta, view in zip(metas, views, strict=True)]
            self._wires = (metas, wires, [(m.key, w) for m, w in zip(metas, wires, strict=True)],
                           sum(view.nbytes for view in views))
        return self._pull[1], *self._wires[1:]

    def slot(self, key: SliceKey, nbytes: int) -> int:
        """The reply region's offset that holds `key` for this session (allocated on first use).
        Every reply write asks for its slot here, after any wait: a worker that went meanwhile (SIGTERM,
        a kill) has had its region unmapped, and its request ends as TransportBroken, not a traceback."""
        if self.closed:
            raise TransportBroken(f"worker {self.worker_id}'s {self.kind} session closed while its request "
                                  "waited")
        slot = self._slots.get(key)
        if slot is not None and nbytes <= slot[2]:
            # A compressed pull's slice changes size (whole, then packed): it keeps the room it has.
            self._slots[key] = (slot[0], nbytes, slot[2])
            return slot[0]
        offset = self._reply_end
        if offset + nbytes > self.regions.reply_bytes:
            raise TransportBroken(f"reply region full: slice {str(key)!r} needs {nbytes} bytes at offset "
                                  f"{offset}, the region has {self.regions.reply_bytes}")
        self._reply_end = offset + align(nbytes)
        self._slots[key] = (offset, nbytes, nbytes)
        return offset

    def reply_room(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Room for a table request's rows in the reply region, past every dense slot (whose bytes
        must outlive the request); TransportBroken when the worker's region is too small."""
        offset = self._reply_end
        if offset + nbytes > self.regions.reply_bytes:
            raise TransportBroken(f"reply region full: {nbytes} bytes of table rows at offset {offset}, "
                                  f"the region has {self.regions.reply_bytes}")
        return offset, self.regions.reply[offset:offset + nbytes]

    def pulled_bytes(self, keys: Sequence[SliceKey]) -> int:
        """What pulling `keys` moved last time: the size of this pull, for all but a session's first."""
        unknown = (0, 1 << 62)  # a slice not pulled yet could be any size: not small
        return sum(self._slots.get(k, unknown)[1] for k in keys)

    def close(self) -> None:
        self.closed = True
        self.encoder.session = self.lender.session = None
        self._pull = self._wires = None  # views of the region: it can only be unmapped without them
        self.regions.close()


class FastPathServer:
    def __init__(self, handlers: ParameterServerHandlers, loop: asyncio.AbstractEventLoop, *,
                 transport: str, shm_dir: str, host: str, ssl_context: ssl.SSLContext | None = None,
                 refusals: AuthRefusals | None = None, port: int = 0) -> None:
        """`port`: the TCP listener's (0: any free one; ServerSettings.fast_port).
        `ssl_context` (a server context that requires client certificates of the job's CA): the
        TCP path runs over TLS, mutually authenticated. Shared memory is local and needs none: a
        peer gets on it with the session's secret, handed out over the authenticated gRPC channel.
        `refusals`: the server's counter of refused calls (the gRPC interceptor's), where a peer
        without a session's secret and a session acting for another worker are counted too."""
        self._handlers = handlers
        self.refusals = refusals if refusals is not None else AuthRefusals()
        # Sparse tables, when the server holds them: their requests ride the same sessions.
        self.tables: TableHandlers | None = None
        self._ssl = ssl_context
        self.tls = ssl_context is not None
        self._loop = loop
        self.kinds = offered_kinds(transport)
        self._shm_dir = shm_dir
        self._sessions: dict[int, _Session] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._listener: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._unix: tuple[socket.socket, Path] | None = None
        self._handoffs: set[asyncio.Task[object]] = set()
        # TLS connections, each terminated in threads of its own (ps_server/transport/tls_relay.py).
        self._relays: weakref.WeakSet[TlsRelay] = weakref.WeakSet()
        self.greeting = 0  # connections waiting for their hello (greet/greeted), at most max_greeting
        self.max_greeting = MAX_GREETING
        self.refused_greetings = 0  # connections closed because max_greeting others were waiting
        # Sessions whose requests keep being wasted are not read for a while (ps_server/transport/tarpit.py).
        self.tarpit: WasteTarpit | None = None
        self.port = 0
        # Set from the job's heartbeat timeout once the server registered (ps_server.follower).
        self.dead_after_s = DEFAULT_DEAD_AFTER_S
        if not self.kinds:
            return
        if "shm" in self.kinds:
            for path in sweep_orphans(shm_dir):
                log.info("removed orphaned file %s (its creator is dead)", path)
            try:
                self._unix = listen(shm_dir)
            except OSError as err:
                log.warning("shm not offered: no unix socket in %s (%s)", shm_dir, err)
                self.kinds -= {"shm"}
            else:
                self._unix[0].setblocking(False)
                self._accepting = loop.create_task(self._accept_unix(self._unix[0]))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # "::" (an IPv6 cluster address) must take IPv4 workers too, as gRPC's listener does.
        dualstack = host == "::" and socket.has_dualstack_ipv6()
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=64,
                                                  dualstack_ipv6=dualstack)
        except OSError as err:
            raise OSError(err.errno, f"fast path: cannot listen on {host}:{port} ({err.strerror}): pick "
                                     "another --fast-port (or 0 for any free one)") from err
        self.port = self._listener.getsockname()[1]
        self._starting = loop.create_task(self._start(self._listener))
        log.info("fast paths %s listening on port %d%s", sorted(self.kinds), self.port,
                 " (tcp over TLS)" if self.tls else "")

    async def _start(self, listener: socket.socket) -> None:
        if self._ssl is None:
            self._server = await self._loop.create_server(lambda: Connection(self, self._loop), sock=listener)
            return
        listener.setblocking(False)
        while not self._stopping:
            try:
                conn, peer = await self._loop.sock_accept(listener)
            except OSError:
                return  # closed
            if not self.greet():
                log.warning("fast path: refused a TLS connection from %s: too many connections without a "
                            "hello", describe(peer))
                conn.close()
                continue
            conn.setblocking(True)
            relay = TlsRelay(conn, peer, self._ssl, _HANDSHAKE_TIMEOUT_S, self.dead_after_s,
                             self._relayed, self._handshaken, self._loop)
            self._relays.add(relay)
            relay.start()

    def _handshaken(self) -> None:
        """A TLS connection's handshake ended (from its relay's thread): it no longer counts as greeting;
        its Connection counts again until its hello."""
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone, and its count
            self._loop.call_soon_threadsafe(self.greeted)

    def _relayed(self, end: socket.socket, peer: object, relay: TlsRelay) -> None:
        """A TLS connection authenticated (from its relay's thread): the event loop serves its clear end."""
        def adopt() -> None:
            if self._stopping:
                end.close()
                return
            end.setblocking(False)
            task = self._loop.create_task(self._loop.connect_accepted_socket(
                lambda: Connection(self, self._loop, peer=peer, relay=relay), end))
            self._handoffs.add(task)
            task.add_done_callback(self._handoffs.discard)

        try:
            self._loop.call_soon_threadsafe(adopt)
        except RuntimeError:  # the loop closed: the server is gone
            end.close()

    async def _accept_unix(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                conn, _ = await self._loop.sock_accept(listener)
            except OSError:
                return  # closed
            if not self.greet():
                log.warning("fast path: refused a shm hand-off: too many connections without a hello")
                conn.close()
                continue
            task = self._loop.create_task(self._handoff(conn))
            self._handoffs.add(task)
            task.add_done_callback(self._handoffs.discard)
            task.add_done_callback(lambda _: self.greeted())

    async def _handoff(self, conn: socket.socket) -> None:
        """A shm worker's first frame, with its segment's descriptor: then a connection like TCP's."""
        conn.setblocking(False)
        session = None
        try:
            hello, fds = await asyncio.wait_for(receive_hello(self._loop, conn), HELLO_TIMEOUT_S)
            session = self._adopt(hello, fds)
            await asyncio.wait_for(send_hello(self._loop, conn, session.regions.nonce), HELLO_TIMEOUT_S)
            _, connection = await self._loop.connect_accepted_socket(
                lambda: Connection(self, self._loop, session), conn)
        except (OSError, PSError, asyncio.TimeoutError) as err:
            log.warning("fast path: refused a shm hand-off: %s", err)
            conn.close()
            if session is not None:
                self._end(session)
            return
        with self._lock:
            session.conn = connection
        log.info("worker %s: shm transport connected", session.worker_id)

    def _adopt(self, hello: bytes, fds: list[int]) -> _Session:
        """The shm session the hello names, its segment mapped; PSError for anyone else (every
        descriptor received is closed or kept; a session whose secret came with a bad segment ends)."""
        try:
            session = self._claim(hello, "shm")
            try:
                if len(fds) != 1:
                    raise InvalidArgumentError(f"shm hello: {len(fds)} descriptors, expected the segment's")
                regions = Segment.adopt(fds.pop())
                if regions.request_bytes < session.want[0] or regions.reply_bytes < session.want[1]:
                    regions.close()
                    raise InvalidArgumentError("shm hello: the segment is smaller than announced")
            except BaseException:
                self._end(session)
                raise
        finally:
            for fd in fds:
                os.close(fd)
        placeholder, session.regions = session.regions, regions
        placeholder.close()
        return session

    # ---- lifecycle ----

    async def aclose(self) -> None:
        """Close the listener and every session (removing their segments)."""
        self._stopping = True
        if self._listener is not None:
            if self._ssl is not None:  # the accept loop (its socket is closed below)
                self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starting
        if self._server is not None:
            self._server.close()
        elif self._listener is not None:
            self._listener.close()
        for relay in list(self._relays):
            relay.close()
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            if session.conn is not None:
                session.conn.abort("server stopping")
            self._end(session)
        if self._unix is not None:
            self._unix[0].close()
            remove(self._unix[1])
            self._accepting.cancel()
        for task in self._handoffs:
            task.cancel()

    def transports(self) -> dict[str, str]:
        """Worker id -> kind of its connected session."""
        with self._lock:
            return {s.worker_id: s.kind for s in self._sessions.values() if s.conn is not None}

    def disconnect(self, worker_id: str) -> int:
        """Cut the fast-path connections of `worker_id` (the worker carries on over gRPC and may
        negotiate again): how many were cut. For operators, and for tests of a path breaking mid-step."""
        with self._lock:
            connections = [s.conn for s in self._sessions.values()
                           if s.worker_id == worker_id and s.conn is not None]
        for connection in connections:
            self._loop.call_soon_threadsafe(connection.abort, "disconnected by the server")
        return len(connections)

    def _end(self, session: _Session) -> None:
        with self._lock:
            if self._sessions.pop(session.id, None) is None:
                return
        session.close()
        self._handlers.forget_encoder(session.encoder)
        self._handlers.forget_encoder(session.lender)

    # ---- negotiation (on the event loop, from the gRPC method) ----

    def open(self, request: pb.OpenTransportRequest) -> pb.OpenTransportResponse:
        kind = KIND_NAMES.get(request.kind)
        if kind is None:
            raise InvalidArgumentError(f"OpenTransport kind: got {request.kind}, expected SHM or TCP")
        if kind not in self.kinds or self._stopping:
            raise TransportRefusedError(f"OpenTransport: this server does not offer {kind} "
                                        f"(it offers {sorted(self.kinds) or 'gRPC only'})")
        # A server of sparse tables only has no store: its sessions carry table requests alone.
        stored = self._handlers.store.stats().bytes_stored if self._handlers.has_store else 0
        limit = 4 * stored + _SLACK_BYTES
        if max(request.request_bytes, request.reply_bytes) > limit:
            raise InvalidArgumentError(f"OpenTransport: regions of {request.request_bytes} and "
                                       f"{request.reply_bytes} bytes exceed what this shard needs ({limit})")
        # shm: the worker's segment replaces this empty one when its descriptor arrives.
        wanted = (request.request_bytes, request.reply_bytes)
        regions = Segment.private(*((0, 0) if kind == "shm" else wanted))
        session = _Session(request.worker_id, kind, regions)
        session.want = wanted
        who = caller()
        session.replicates = who is None or who.role == "ps"
        with self._lock:
            self._sessions[session.id] = session
            # A worker needs one session here; a few while an old one's end goes unnoticed. More is a
            # client reserving memory in a loop: its oldest sessions go.
            mine = [s for s in self._sessions.values() if s.worker_id == request.worker_id]
        for old in mine[:-_SESSIONS_PER_WORKER]:
            log.warning("worker %s: more than %d fast-path sessions, closing the oldest",
                        request.worker_id, _SESSIONS_PER_WORKER)
            if old.conn is not None:
                old.conn.abort("too many sessions for this worker")
            self._end(old)
        self._loop.call_later(_ATTACH_TIMEOUT_S, self._expire, session)
        return pb.OpenTransportResponse(kind=request.kind, session=session.id, secret=session.secret,
                                        port=self.port, socket=self._unix[1].name if kind == "shm" and
                                        self._unix is not None else "")

    def _expire(self, session: _Session) -> None:
        if not session.claimed:
            self._end(session)

    # ---- what connections (ps_server.transport.fastconn) call ----

    def _claim(self, hello: bytes, kind: str) -> _Session:
        """The not yet connected session of `kind` whose id and secret the first frame carries, now
        claimed; PSError for anyone else."""
        try:
            message = pb.TransportHello.FromString(hello)
        except DecodeError:
            self.refusals.add("UNAUTHENTICATED", EXCHANGE_METHOD)
            raise InvalidArgumentError("undecodable hello") from None
        with self._lock:
            session = self._sessions.get(message.session)
            if (session is None or session.kind != kind or session.claimed
                    or not hmac.compare_digest(session.secret, message.secret)):
                # Counted as the interceptor counts a call without a credential: the fast paths carry
                # Exchange requests, so they share its method label (pshard_auth_refused_total).
                self.refusals.add("UNAUTHENTICATED", EXCHANGE_METHOD)
                raise InvalidArgumentError("no valid session secret")
            session.claimed = True
        return session

    def greet(self) -> bool:
        if self.greeting >= self.max_greeting:
            self.refused_greetings += 1
            return False
        self.greeting += 1
        return True

    def greeted(self) -> None:
        self.greeting -= 1

    def attach(self, hello: bytes, connection: Connection) -> _Session | None:
        """The TCP session whose secret the first frame carries; None for anyone else."""
        try:
            session = self._claim(hello, "tcp")
        except PSError:
            return None
        with self._lock:
            session.conn = connection
        log.info("worker %s: tcp transport connected", session.worker_id)
        return session

    async def serve(self, session: Session, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                    views: Sequence[np.ndarray], inflow: Inflow | None = None,
                    write_slice: SliceWriter | None = None) -> pb.TransportReply:
        assert isinstance(session, _Session)
        started = time.perf_counter()
        reply = await self._run(session, header, metas, views, inflow, write_slice)
        method = {pb.EXCHANGE_OP_TABLE: "Table", pb.EXCHANGE_OP_REPLICATE: "Replicate"}.get(header.op,
                                                                                              "Exchange")
        self._handlers.requests.record(session.kind, method, sum([v.nbytes for v in views]),
                                       sum(reply.sizes), time.perf_counter() - started,
                                       reply.error_type or None, header.stamp.clock)
        return reply

    def end(self, session: Session) -> None:
        assert isinstance(session, _Session)
        self._end(session)

    def tally(self, session: Session, nbytes: int, reply: pb.TransportReply) -> float:
        if self.tarpit is None:
            return 0.0
        assert isinstance(session, _Session)
        peer = session.peer
        wasted = wasted_reply(reply)
        if self.tarpit.served(peer, nbytes, wasted):
            log.warning("worker %s: %s of fast-path requests in a row refused or changing nothing; not "
                        "reading its %s connection for a while", session.worker_id,
                        self.tarpit.describe(peer), session.kind)
        # A request that was not wasted has just cleared its peer's record: nothing holds it.
        return self.tarpit.hold_left(peer) if wasted else 0.0

    async def _run(self, session: _Session, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                   views: Sequence[np.ndarray], inflow: Inflow | None, write_slice: SliceWriter | None
                   ) -> pb.TransportReply:
        try:
            return await self._exchange(session, header, metas, views, inflow, write_slice)
        except PSError as err:
            return error_reply(err)
        except Exception as err:  # a bug must not leave the worker waiting: it falls back to gRPC
            log.exception("fast-path request of worker %s failed", session.worker_id)
            return error_reply(TransportBroken(f"internal error: {type(err).__name__}: {err}"))

    async def _exchange(self, session: _Session, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                        views: Sequence[np.ndarray], inflow: Inflow | None, write_slice: SliceWriter | None
                        ) -> pb.TransportReply:
        """`inflow`: the pushed bytes are still arriving (only the Exchange core takes them as they
        come); `write_slice`: the Exchange core sends each pulled slice with it as soon as it is ready."""
        if header.op not in (pb.EXCHANGE_OP_PUSH_PULL, pb.EXCHANGE_OP_TABLE, pb.EXCHANGE_OP_REPLICATE):
            raise InvalidArgumentError(f"fast-path header.op: got {header.op}, expected PUSH_PULL or TABLE")
        stamp = header.stamp
        if stamp.worker_id != session.worker_id:  # the opener's credential was checked for it
            self.refusals.add("PERMISSION_DENIED", EXCHANGE_METHOD)
            log.warning("fast path: refused a request of worker %r's session acting as %r", session.worker_id,
                        stamp.worker_id)
            raise PermissionDeniedError(f"fast path: a session of {session.worker_id!r} may not act as "
                                        f"{stamp.worker_id!r}")
        # A primary's replication link (ps_server/transport/replica_tcp.py).
        if header.op == pb.EXCHANGE_OP_REPLICATE:
            if not session.replicates:
                self.refusals.add("PERMISSION_DENIED", EXCHANGE_METHOD)
                raise PermissionDeniedError(f"fast path: {session.worker_id!r} may not replicate (no server)")
            if inflow is not None:
                await inflow.wait(inflow.total)
            return await serve_replicate(self._handlers, header, metas, views)
        if header.op == pb.EXCHANGE_OP_TABLE:
            if self.tables is None:
                raise TransportRefusedError("fast path: this server holds no sparse tables")
            if inflow is not None:
                await inflow.wait(inflow.total)
            return await serve_table(self.tables, header, metas, views, session.reply_room)
        pull, wires, items, pushed = session.decoded(header, metas, views)
        timeout_ms = codec.timeout_ms_from_proto(header)
        timeout_s = timeout_ms / 1000 if timeout_ms is not None else None
        packs = codec.pull_packs_from_proto(header) if header.pull_packing else ()  # a step's calls count
        if pushed + session.pulled_bytes(pull) <= _SMALL_BYTES:
            if inflow is not None:
                await inflow.wait(inflow.total)
            return await self._push_pull(session, stamp, items, pull, timeout_s, packs)

        async def gradients() -> AsyncIterator[tuple[int, WireArray]]:
            end = 0  # the slices' bytes arrive in push order, back to back
            for index, wire in enumerate(wires):
                if inflow is not None:
                    end += views[index].nbytes
                    await inflow.wait(end)
                yield index, wire

        # No store yet: an heir's first request after a failover, which the handlers promote its copies for.
        store = self._handlers.store if self._handlers.has_store else None
        # Sent from the value itself only when a send's return means the kernel has the bytes (not TLS,
        # whose transport may encrypt them later).
        lend = (write_slice is not None and session.conn is not None and session.conn.sends_directly
                and store is not None and store.config.mode == "sync")
        encoder = session.lender if lend else session.encoder
        encoder.expect = pull[0] if pull else None
        reply = pb.TransportReply()
        events = self._handlers.exchange(codec.stamp_from_proto(stamp), metas, pull, gradients(),
                                         encoder, timeout_s, packs)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, EncodedSlice):
                    key, offset, nbytes, lent = event.payload
                    if key != event.key:
                        raise TransportBroken(f"encoder wrote {str(key)!r} for {str(event.key)!r}")
                    reply.offsets.append(offset)
                    reply.sizes.append(nbytes)
                    done = len(reply.offsets)
                    encoder.expect = pull[done] if done < len(pull) else None
                    if write_slice is None:
                        continue
                    if lent is None:  # the slot keeps these bytes until our next request
                        await write_slice(done - 1, session.regions.reply[offset:offset + nbytes])
                        continue
                    await write_slice(done - 1, lent)
                    if store is not None and store.version(key) != event.version:  # lent: a store
                        raise TransportBroken(f"slice {str(key)!r} changed while it was sent")
                elif isinstance(event, ExchangeDone):
                    reply.summary.versions.extend(event.versions)
                    reply.summary.applied, reply.summary.dropped = event.applied, event.dropped
        return reply

    async def _push_pull(self, session: _Session, stamp: pb.Stamp,
                         items: Sequence[tuple[SliceKey, WireArray]], pull: Sequence[SliceKey],
                         timeout_s: float | None, packs: Sequence[PullPack] = ()) -> pb.TransportReply:
        """A small request through the plain push_pull handler (as gRPC's unary PushPull): one
        coroutine, where the Exchange core's tasks and events would cost more than the bytes."""
        result = await self._handlers.push_pull(codec.stamp_from_proto(stamp), items, pull, timeout_s, packs)
        reply = pb.TransportReply()
        reply.summary.applied, reply.summary.dropped = result.applied, result.dropped
        for pulled in result.slices:
            src = pulled.value.array.reshape(-1).view(np.uint8)
            offset = session.slot(pulled.key, src.nbytes)
            shared_pool().copy(session.regions.reply[offset:offset + src.nbytes], src)
            reply.offsets.append(offset)
            reply.sizes.append(src.nbytes)
            reply.summary.versions.append(pulled.version)
        return reply


class OpenTransportMethod:
    """The gRPC method that negotiates a fast path (registered beside the servicer's methods)."""

    def __init__(self, fast: FastPathServer) -> None:
        self._fast = fast

    @maps_errors
    async def OpenTransport(self, request: pb.OpenTransportRequest, context: grpc.aio.ServicerContext
                            ) -> pb.OpenTransportResponse:
        # A session acts for the worker it names: only that worker's credential may open one.
        check_acts_as(request.worker_id, "OpenTransport")
        return self._fast.open(request)
