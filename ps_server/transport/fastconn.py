"""One fast-path connection on the server's event loop: frames in, requests served, replies out.

A `BufferedProtocol`: the transport keeps the socket registered and reads straight into the
buffer we hand it, the frame header's scratch or (TCP) the session's page-aligned request
region, so bulk bytes land where the handlers read them without a copy, and a small request
costs no per-message registration. A large TCP request is served from its header on: the
handler applies each slice as soon as its bytes are in (`Inflow`) and each pulled slice goes out
as a SLICE frame as soon as it is ready, while later slices are still being received. Once its
data is in, the worker sends nothing while it waits for the reply, so anything that arrives
meanwhile (EOF above all: a dead worker) cancels the request at once: its session and segment
do not outlive the worker, even while a sync pull waits for minutes. Big replies are sent
straight from the reply region on a plain socket as far as it takes them; only when it is full
does a small piece go through the transport, whose buffer copies it, to learn when it drains.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, overload

import numpy as np
from google.protobuf.message import DecodeError
from pshard.common.errors import PSError, facts_json
from pshard.common.limits import DEFAULT_LIMITS
from pshard.common.wire import codec
from pshard.common.wire.codec import byte_view
from pshard.common.wire.fastwire import (
    HEADER_BYTES,
    HELLO,
    REPLY,
    REQUEST,
    SLICE,
    TransportBroken,
    decode_header,
    encode_header,
    encode_slice_meta,
    tune,
)
from pshard.common.wire.liveness import keep_alive
from pshard.common.wire.shm import Segment, packed, recv_with_fds
from pshard.ps_server.core.store import SliceMeta

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.transport")

_SCRATCH_BYTES = 64 * 1024  # a header and its metadata; grown for a request of very many slices
_WRITE_CHUNK_BYTES = 1 << 20
# A full socket: this much of a reply goes through the transport (copied into its buffer), which
# then tells us when the socket drained.
_NUDGE_BYTES = 64 * 1024
# TCP requests with more data than this are served while their data arrives.
PIPELINE_BYTES = 1 << 20
# Before its hello a connection is anyone's: it holds a scratch of this size and no more, for this long
# (a worker sends its hello right after connecting, or after the TLS handshake). A session id and a
# 32-byte secret take 50 bytes.
HELLO_TIMEOUT_S = 3.0
MAX_HELLO_BYTES = 4096
_HELLO_SCRATCH_BYTES = HEADER_BYTES + MAX_HELLO_BYTES
# A refused request's data is read into one buffer of this size, again and again, and dropped.
_SINK_BYTES = 1 << 20


# A request whose data is being received: header, pushed slices, their views, or its error, and the
# bytes it brings (its data over TCP, its views over shared memory).
_Pending = tuple[pb.ExchangeHeader, list[SliceMeta], list[np.ndarray], PSError | None, int]


class Inflow:
    """How much of a request's data has arrived, for a handler that runs while it arrives (TCP)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, total: int) -> None:
        self._loop = loop
        self.total = total
        self.got = 0
        self._want = 0
        self._waiter: asyncio.Future[None] | None = None

    def add(self, nbytes: int) -> None:
        self.got += nbytes
        if self._waiter is not None and self.got >= self._want and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, nbytes: int) -> None:
        """Until the first `nbytes` of the request's data are in (the connection's loss cancels)."""
        while self.got < min(nbytes, self.total):
            self._want = nbytes
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


# write_slice(index in the pull list, its bytes): a SLICE frame, sent before the reply (TCP).
SliceWriter = Callable[[int, np.ndarray], Awaitable[None]]


class Session(Protocol):
    worker_id: str
    kind: str
    regions: Segment


class Sessions(Protocol):
    """What the fast-path server provides to its connections."""

    # A peer silent this long is gone (common.wire.liveness): the job's heartbeat timeout.
    dead_after_s: float

    def attach(self, hello: bytes, connection: Connection) -> Session | None: ...

    def greet(self) -> bool:
        """Whether one more connection may wait for its hello (False: too many already do)."""
        ...

    def greeted(self) -> None:
        """A connection counted by `greet` sent its hello, or is gone."""
        ...

    async def serve(self, session: Session, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                    views: Sequence[np.ndarray], inflow: Inflow | None,
                    write_slice: SliceWriter | None) -> pb.TransportReply:
        """`inflow`: the data is still arriving (None: it is all in); `write_slice`: how to send
        pulled slices ahead of the reply (None: shared memory, they stay in the segment)."""
        ...

    def end(self, session: Session) -> None: ...

    def tally(self, session: Session, nbytes: int, reply: pb.TransportReply) -> float:
        """Record a request's outcome (the tarpit): the seconds not to read its connection from now."""
        ...


def push_metas(header: pb.ExchangeHeader) -> tuple[list[SliceMeta], list[int]]:
    """The pushed slices and their byte sizes, decoded and checked as the gRPC servicer does."""
    metas = [SliceMeta(codec.slice_id_from_proto(m.id), codec.dtype_from_proto(m.dtype, "push dtype"),
                       tuple(m.shape), codec.encoding_from_proto(m.encoding, "push encoding"))
             for m in header.push]
    return metas, [codec.nbytes_of(f"slice {str(m.key)!r}", m.dtype, m.shape) for m in metas]


def error_reply(err: PSError) -> pb.TransportReply:
    return pb.TransportReply(error_type=type(err).__name__, error_message=str(err),
                             error_facts=facts_json(err))


class Sink(Sequence[memoryview]):
    """Targets that take `nbytes` into one reused buffer: a refused request's data, read and dropped.
    O(1) memory whatever `nbytes` is: the targets are computed, not listed (a list of 1 MiB views of a
    header announcing 2**49 bytes was 2**29 references, 8 GiB)."""

    def __init__(self, nbytes: int) -> None:
        self._chunk = memoryview(bytearray(min(nbytes, _SINK_BYTES)))
        self._full, self._rest = divmod(nbytes, len(self._chunk)) if nbytes else (0, 0)

    def __len__(self) -> int:
        return self._full + (1 if self._rest else 0)

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | Sequence[memoryview]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._chunk if index < self._full else self._chunk[:self._rest]


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def receive_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, list[int]]:
    """The hello frame's metadata on a fresh unix socket (non-blocking) and the descriptors sent with
    it; reads nothing past the frame, so the first request stays in the socket for its connection.
    The caller owns the descriptors (they are closed here only when the frame is refused)."""
    fds: list[int] = []
    buf = b""
    try:
        need = HEADER_BYTES
        while len(buf) < need:
            await _readable(loop, sock)
            try:
                data, got = recv_with_fds(sock, need - len(buf), max_fds=4)
            except BlockingIOError:
                continue
            fds += got
            if not data:
                raise TransportBroken("the peer closed the connection during its hello")
            buf += data
            if len(buf) == HEADER_BYTES:
                kind, meta_len, data_len = decode_header(buf)
                if kind != HELLO or data_len or meta_len > MAX_HELLO_BYTES:
                    raise TransportBroken(f"expected a hello frame, got kind {kind}")
                need = HEADER_BYTES + meta_len
        return buf[HEADER_BYTES:], fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


async def send_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket, meta: bytes) -> None:
    """The server's answer to a shm hello: the nonce it read in the segment."""
    await loop.sock_sendall(sock, encode_header(HELLO, len(meta), 0) + meta)


_EAGER_TASKS = sys.version_info >= (3, 12)


def run_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
                ) -> asyncio.Task[None] | None:
    """Run `coro` now, inside this callback, up to its first real wait; the rest as a task (None: it
    finished). A small request is then served with no task and no extra turn of the loop (an epoll
    call and a task step: a tenth of a small push+pull's server time), as Python 3.12's eager tasks do.

    From 3.12 on it is one: asyncio.wait_for (and asyncio.timeout) there need a current task, which
    the hand-driven first step below has not, and the GPU machine's 3.12 broke every shm request that
    waited in that step ("Timeout should be used inside a task"; docs/operations/gpu.md)."""
    if _EAGER_TASKS:
        task: asyncio.Task[None] = asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
        if task.done():
            task.result()  # as below: an exception of the eager part is raised here, not left in a task
            return None
        return task
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return loop.create_task(_resume(coro, waiting))


async def _resume(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    """Drive `coro` on from where run_eagerly left it, waiting for what it waits for: it resumes as
    under a task of its own (it reads the awaited future's result or exception itself), and a
    cancel of this task reaches it as a CancelledError."""
    while True:
        cancelled = False
        try:
            if waiting is None:  # a bare yield (asyncio.sleep(0)): one turn of the loop
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False  # as a task's step does with what coro yields
                await waiting
        except asyncio.CancelledError:
            # The awaited future cancelled is coro's to see; this task cancelled is thrown into it.
            cancelled = waiting is None or not waiting.cancelled()
        except Exception:  # coro reads the future's exception itself when resumed
            pass
        try:
            waiting = coro.throw(asyncio.CancelledError()) if cancelled else coro.send(None)
        except StopIteration:
            return


class Relay(Protocol):
    """The TLS connection a relayed Connection's pair leads to (ps_server/transport/tls_relay.py)."""

    def send_direct(self, frame: bytes, written: int) -> bool:
        """Encrypt and send a small `frame` from the loop, past the pair, if the relay has encrypted all
        `written` bytes put in the pair so far (else, or when another thread sends, False: nothing taken)."""
        ...

    def attach(self, connection: Connection | None) -> None:
        """The Connection serving the pair (None once it is gone): what the loop decrypts may go straight
        to it (`Connection.feed`)."""
        ...


class Connection(asyncio.BufferedProtocol):
    def __init__(self, sessions: Sessions, loop: asyncio.AbstractEventLoop, session: Session | None = None,
                 *, peer: object = None, relay: Relay | None = None) -> None:
        """`session`: already attached (shm, whose hello came with the segment), else the first frame
        must name one with its secret. `relay`: this is the clear end of a TLS connection whose cipher
        runs in threads (ps_server/transport/tls_relay.py), a unix socket served as a plain TCP one;
        `peer`: the worker's address, for the logs (else the socket's peer)."""
        self._sessions = sessions
        self._loop = loop
        self._peer = peer
        self._relay = relay
        self._written = 0  # bytes handed to the transport or the socket (a relay's pair: to encrypt)
        self._received = 0  # bytes in: read by the transport, or fed by a relay past its pair
        self._fed = 0
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = session
        # Small until the hello: a connection that never authenticates holds 4 KiB, not 64.
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES if session is not None else _HELLO_SCRATCH_BYTES))
        self._have = 0  # bytes of the scratch filled
        self._greeting = False  # counted among the connections waiting for their hello
        # A request's data (TCP): where its bytes go, which target is being filled and how far.
        self._targets: Sequence[memoryview] = []
        self._target = 0
        self._filled = 0
        self._pending: _Pending | None = None
        self._inflow: Inflow | None = None  # a request served while its data arrives
        # The last request's push list (a header's repeated field), with its slices and views decoded.
        self._layout: tuple[Sequence[pb.SliceMeta], list[SliceMeta], list[np.ndarray], int, list[memoryview]
                            ] | None = None
        self._serving = False  # a request is complete and its reply not yet being written
        self._task: asyncio.Task[None] | None = None  # what is left of serving one that had to wait
        self._drained: asyncio.Future[None] | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._raw: socket.socket | None = None  # plain TCP: our own handle to send replies from
        self._streamed = 0  # SLICE frames sent for the request being served

    @property
    def sends_directly(self) -> bool:
        """A reply written is in the kernel once the write returns (plain TCP: no transport buffer
        or TLS layer holds on to the caller's bytes)."""
        return self._raw is not None

    # ---- asyncio callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._relay is not None:
            self._relay.attach(self)
        tune(transport.get_extra_info("socket"))
        # A worker whose host is cut off ends its session (and what it holds) within the heartbeat
        # timeout, as its gRPC channel would, instead of when the kernel gives up after minutes.
        keep_alive(transport.get_extra_info("socket"), self._sessions.dead_after_s)
        transport.set_write_buffer_limits(high=0)  # pause_writing as soon as anything is queued
        sock = transport.get_extra_info("socket")
        if sock.family in (socket.AF_INET, socket.AF_INET6) or self._relay is not None:
            self._raw = socket.socket(sock.family, sock.type, fileno=os.dup(sock.fileno()))
            self._raw.setblocking(False)
        if self.session is None:
            if not self._sessions.greet():
                log.warning("fast path: refused a connection from %s: too many connections without a hello",
                            self._peer_name())
                transport.abort()
                return
            self._greeting = True
            self._hello_timer = self._loop.call_later(HELLO_TIMEOUT_S, self.abort, "no hello in time")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._targets:
            return self._targets[self._target][self._filled:]
        if self._have == len(self._scratch):  # a frame bigger than the scratch: grow it (rare)
            grown = memoryview(bytearray(2 * len(self._scratch)))
            grown[:self._have] = self._scratch
            self._scratch = grown
        return self._scratch[self._have:]

    def buffer_updated(self, nbytes: int) -> None:
        self._received += nbytes
        try:
            if self._targets:  # a request's data: it may arrive while the request is served
                self._filled += nbytes
                if self._inflow is not None:
                    self._inflow.add(nbytes)
                self._advance_targets()
            elif self._serving:
                raise TransportBroken("the worker sent bytes while its request was served")
            else:
                self._have += nbytes
                self._parse()
        except TransportBroken as err:
            self.abort(str(err))

    @property
    def from_pair(self) -> int:
        """Bytes read from the socket (a relay's pair), not fed."""
        return self._received - self._fed

    def feed(self, data: memoryview) -> int:
        """Bytes a relay decrypted on the loop, taken as the transport takes what it reads, without the
        pair's two system calls and the loop's second pass; stops where the connection stops reading
        (the tarpit, a refusal). How many were taken: the rest goes through the pair."""
        transport = self.transport
        taken = 0
        while (taken < len(data) and transport is not None and transport.is_reading()
               and not transport.is_closing()):
            buf = self.get_buffer(len(data) - taken)
            n = min(len(buf), len(data) - taken)
            buf[:n] = data[taken:taken + n]
            self._fed += n
            taken += n
            self.buffer_updated(n)
        return taken

    def eof_received(self) -> bool:
        self.abort("the worker closed the connection")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._relay is not None:
            self._relay.attach(None)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._greeted()
        if self._task is not None:
            self._task.cancel()
        if self._drained is not None:
            self._drained.cancel()  # a reply being written ends quietly: the connection is gone
        self._layout = None  # views of the region: the segment can only be unmapped without them
        self._inflow = None
        if self._raw is not None:
            self._raw.close()
        if self.session is not None:
            session, self.session = self.session, None
            self._sessions.end(session)

    def pause_writing(self) -> None:
        self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---- frames ----

    def abort(self, why: str) -> None:
        if self.session is not None:
            log.info("worker %s: %s transport closed (%s)", self.session.worker_id, self.session.kind, why)
        if self.transport is not None:
            self.transport.abort()

    def _greeted(self) -> None:
        if self._greeting:
            self._greeting = False
            self._sessions.greeted()

    def _peer_name(self) -> object:
        if self._peer is not None or self.transport is None:
            return self._peer
        return self.transport.get_extra_info("peername")

    def _refuse_hello(self, why: str) -> None:
        log.warning("fast path: refused a connection from %s: %s", self._peer_name(), why)
        raise TransportBroken(f"refused a connection: {why}")

    def _parse(self) -> None:
        if self._have < HEADER_BYTES:
            return
        kind, meta_len, data_len = decode_header(self._scratch[:HEADER_BYTES])
        if self.session is None and (kind != HELLO or data_len or meta_len > MAX_HELLO_BYTES):
            # Checked on the header alone: metadata announced before the secret is never buffered.
            self._refuse_hello(f"its first frame (kind {kind}, {meta_len} bytes of metadata, {data_len} of "
                               f"data) is not a hello of at most {MAX_HELLO_BYTES} bytes")
        end = HEADER_BYTES + meta_len
        if self._have < end:
            if end > len(self._scratch):  # room for exactly this frame's metadata (at most MAX_META_BYTES)
                grown = memoryview(bytearray(end))
                grown[:self._have] = self._scratch[:self._have]
                self._scratch = grown
            return
        meta = bytes(self._scratch[HEADER_BYTES:end])
        extra = self._scratch[end:self._have]  # data that came with the header (TCP)
        if self.session is None:
            if self._hello_timer is not None:
                self._hello_timer.cancel()
            self._greeted()
            self.session = self._sessions.attach(meta, self)
            if self.session is None:
                self._refuse_hello("no valid session secret")
            # The first request may have come in the same read.
            rest = bytes(extra)
            self._scratch = memoryview(bytearray(max(_SCRATCH_BYTES, len(rest))))
            self._scratch[:len(rest)] = rest
            self._have = len(rest)
            self._parse()
            return
        if kind != REQUEST:
            raise TransportBroken(f"expected a request frame, got kind {kind}")
        self._request(meta, data_len, extra)

    def _request(self, meta: bytes, data_len: int, extra: memoryview) -> None:
        session = self.session
        assert session is not None
        inline = session.kind == "tcp"
        # Checked on the header alone, before anything is decoded, allocated or looped over: no request
        # can bring more than the session's request region (negotiated, and bounded by the shard's size);
        # over shared memory the data is in the segment and a frame brings none. A frame past that is
        # not a request this server could serve, so its connection is closed rather than read for ever.
        most = session.regions.request_bytes if inline else 0
        if data_len > most:
            raise TransportBroken(f"request announces {data_len} data bytes, at most {most} expected "
                                  f"(the session's request region over {session.kind})")
        try:
            header = pb.ExchangeHeader.FromString(meta)
        except DecodeError as err:
            raise TransportBroken(f"undecodable request header: {err}") from None
        error: PSError | None = None
        views: list[np.ndarray] = []
        metas: list[SliceMeta] = []
        targets: Sequence[memoryview]
        try:
            # Before any slice is decoded: a 16 MiB header can name millions (the gRPC servicer's limit).
            DEFAULT_LIMITS.check_count("fast-path request push", len(header.push))
            DEFAULT_LIMITS.check_count("fast-path request pull", len(header.pull))
            metas, views, pushed, targets = self._push_layout(header, session)
            if data_len != (pushed if inline else 0):
                raise TransportBroken(f"request announces {data_len} data bytes, its header {pushed}")
            if not inline:
                targets = []
        except PSError as err:  # the answer is this error; its data (if any) is read and dropped
            error = err
            targets = Sink(data_len) if inline else []
        # Its bytes, for the tarpit: over TCP the data it announced (its views, when decoded, are that
        # data); over shared memory the views of the segment.
        nbytes = data_len if inline else sum([v.nbytes for v in views])
        self._pending = (header, metas, views, error, nbytes)
        self._have = 0
        self._targets, self._target, self._filled = targets, 0, 0
        if (error is None and inline and header.op == pb.EXCHANGE_OP_PUSH_PULL
                and data_len - len(extra) > PIPELINE_BYTES):
            # Served from now on: each slice is applied, and pulled, as soon as its bytes are in (other
            # ops, tables and replication, are served once all their bytes are in, as before).
            self._inflow = Inflow(self._loop, data_len)
            self._start_serving()
        if len(extra):
            self._fill_from(extra)
        else:
            self._advance_targets()

    def _push_layout(self, header: pb.ExchangeHeader, session: Session
                     ) -> tuple[list[SliceMeta], list[np.ndarray], int, list[memoryview]]:
        """The pushed slices, their views of the request region, their bytes and the byte views data
        is received into (TCP). Every step of a worker pushes the same slices, so they are decoded once
        and reused while the header's push list is unchanged (comparing it costs a sixth of decoding
        it: a tenth of a small request's server time)."""
        cached = self._layout
        if cached is not None and cached[0] == header.push:
            return cached[1:]
        metas, sizes = push_metas(header)
        offsets, total = packed(sizes)
        if total > session.regions.request_bytes:
            raise TransportBroken(f"request needs {total} bytes, the session's region has "
                                  f"{session.regions.request_bytes}")
        request = session.regions.request
        views = [request[o:o + n] for o, n in zip(offsets, sizes, strict=True)]
        self._layout = (header.push, metas, views, sum(sizes), [byte_view(v) for v in views if v.nbytes])
        return self._layout[1:]

    def _fill_from(self, data: memoryview) -> None:
        data = memoryview(bytes(data))  # the scratch is reused: keep these bytes apart
        while len(data):
            if not self._targets:
                raise TransportBroken("the worker sent more data than its request announced")
            target = self._targets[self._target]
            n = min(len(data), len(target) - self._filled)
            target[self._filled:self._filled + n] = data[:n]
            data = data[n:]
            self._filled += n
            if self._inflow is not None:
                self._inflow.add(n)
            self._advance_targets()

    def _advance_targets(self) -> None:
        while self._targets and self._filled == len(self._targets[self._target]):
            self._target, self._filled = self._target + 1, 0
            if self._target == len(self._targets):
                self._targets = []
        if not self._targets:
            self._inflow = None
            if self._pending is not None:
                self._start_serving()

    def _start_serving(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        self._serving = True
        self._task = run_eagerly(self._loop, self._serve(*pending, self._inflow))

    # ---- serving ----

    async def _serve(self, header: pb.ExchangeHeader, metas: list[SliceMeta], views: list[np.ndarray],
                     error: PSError | None, nbytes: int, inflow: Inflow | None) -> None:
        session = self.session
        assert session is not None and self.transport is not None
        self._streamed = 0
        try:
            if error is not None:
                reply = error_reply(error)
            else:
                reply = await self._sessions.serve(session, header, metas, views, inflow,
                                                   self._write_slice if session.kind == "tcp" else None)
            # From here on, bytes from the worker are the rest of this request's data (a reply that
            # came before it, an error), then its next request.
            self._serving = False
            data = []
            if session.kind == "tcp" and not reply.error_type and not self._streamed:
                region = session.regions.reply
                data = [region[o:o + n] for o, n in zip(reply.offsets, reply.sizes, strict=True)]
            await self._write(reply.SerializeToString(), data)
            hold_s = self._sessions.tally(session, nbytes, reply)
            if hold_s > 0:
                self._hold(hold_s)
        except asyncio.CancelledError:
            return  # the connection is gone (connection_lost ended the session)
        except TransportBroken as err:
            self.abort(str(err))
        finally:
            self._serving = False

    def _hold(self, hold_s: float) -> None:
        """Read nothing of this connection for `hold_s` (the tarpit: its requests keep being wasted)."""
        transport = self.transport
        assert transport is not None
        transport.pause_reading()

        def resume() -> None:
            if not transport.is_closing():
                transport.resume_reading()

        self._loop.call_later(hold_s, resume)

    async def _write_slice(self, index: int, data: np.ndarray) -> None:
        """Pulled slice `index` of the request being served, as a SLICE frame, before its reply."""
        self._streamed += 1
        await self._write(encode_slice_meta(index), [data], SLICE)

    async def _write(self, meta: bytes, data: Sequence[np.ndarray], kind: int = REPLY) -> None:
        transport = self.transport
        assert transport is not None
        size = sum([d.nbytes for d in data])
        head = encode_header(kind, len(meta), size) + meta
        if size <= _SCRATCH_BYTES:  # small: one system call for all of it
            frame = b"".join([head, *[byte_view(d) for d in data]]) if data else head
            # Over TLS, encrypted and sent from here: through the pair it would wait for the relay's
            # thread to wake up, tens of microseconds of a small call's few hundred (issue 24).
            if self._relay is not None and self._relay.send_direct(frame, self._written):
                return
            transport.write(frame)  # not through _to_transport: a small step's calls count
            self._written += len(frame)
            return
        self._to_transport(head)
        for part in data:
            view = byte_view(part)
            if self._raw is not None:
                await self._send(view)
                continue
            for start in range(0, len(view), _WRITE_CHUNK_BYTES):
                if self._drained is not None:
                    await self._drained  # only what the socket did not take is ever copied
                    self._drained = None
                self._to_transport(view[start:start + _WRITE_CHUNK_BYTES])

    async def _send(self, view: memoryview) -> None:
        """`view` on the plain socket, straight from where it lies, as fast as the worker reads it."""
        transport, raw = self.transport, self._raw
        assert transport is not None and raw is not None
        while len(view):
            if self._drained is not None:
                await self._drained
                self._drained = None
            if transport.is_closing():
                raise asyncio.CancelledError()  # the connection is gone: connection_lost cancels us
            if not transport.get_write_buffer_size():  # in order: nothing of ours is queued before
                try:
                    sent = raw.send(view)
                    self._written += sent
                    view = view[sent:]
                except BlockingIOError:
                    pass
                except OSError as err:
                    raise TransportBroken(f"reply not sent: {err}") from None
                if not len(view):
                    return
            # The socket is full: a small piece is queued (copied) by the transport, which waits
            # for room and resumes us once it sent the piece.
            self._to_transport(view[:_NUDGE_BYTES])
            view = view[_NUDGE_BYTES:]

    def _to_transport(self, data: bytes | memoryview) -> None:
        assert self.transport is not None
        self.transport.write(data)
        self._written += memoryview(data).nbytes
