"""The worker's side of the fast paths (same-host shared memory, raw TCP) to one parameter server.

Negotiated over gRPC (`OpenTransport`), which hands out a session secret and where to connect.
For shm the worker creates a sealed memfd segment with a nonce inside, connects to the server's unix
socket in the shared directory and sends the secret with the segment's descriptor; the server
answers with the nonce it read (proof that both map the same memory, so it is automatic: another
host or directory fails here and the next transport is tried). For tcp, a socket to the server's
fast-path port, whose first frame carries the secret. A request is the ExchangeHeader the gRPC
path would send; over shm the gradients are written into the segment first and the pulled slices
read from it afterwards, over TCP they travel inline and are received straight into the caller's
arrays when no dtype conversion is needed (docs/architecture.md, 11 Transports). A large TCP
request is written by the session's sender thread while the caller reads the reply's slices, which
the server sends as each is ready (SLICE frames), before the reply's summary.

A failure of the path itself raises `TransportBroken`: the caller completes the request over gRPC
(the server drops what it already applied, by its (worker, clock, slice) keys) and closes this path.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import numpy as np
from pshard.common.chunks import shared_pool
from pshard.common.errors import rebuild
from pshard.common.rpc.status import error_from_rpc_error
from pshard.common.wire.fastwire import (
    HELLO,
    REPLY,
    REQUEST,
    SLICE,
    Inbox,
    PeerSilent,
    Stream,
    TransportBroken,
    decode_slice_meta,
    encode_header,
    open_session,
    send_frame,
    tune,
)
from pshard.common.wire.liveness import DEFAULT_DEAD_AFTER_S
from pshard.common.wire.shm import Segment, connect, packed, parse_socket_name, send_fd, sweep_orphans
from pshard.common.wire.tls_stream import TlsStream, kernel_tls_available

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc

log = logging.getLogger("pshard.client.fastpath")

KINDS = {"shm": pb.TRANSPORT_KIND_SHM, "tcp": pb.TRANSPORT_KIND_TCP}
# A session's room for sparse-table requests, each way, beside its dense slices: 8 MiB is a step of
# 30,000 rows of dim 64 per server; a larger table request goes over gRPC (client.tables).
TABLE_ROOM_BYTES = 8 * 2**20
_swept = threading.Event()  # the orphan sweep runs once per process
_told_tls = threading.Event()  # which TLS the fast path runs is logged once per process
# A reply that came within this long after its request makes the next one wait for its reply by
# spinning on the socket, up to this long, before sleeping: a small push+pull's reply comes in about
# that time, and the wake-up of a sleeping thread costs tens of microseconds (more on a busy machine).
# Slower replies (big steps, waits for other workers) are slept for at once.
_SPIN_S = 300e-6
# TCP requests (plain or TLS) with more data than this are sent by the session's sender thread while the
# caller reads the reply (the server sends pulled slices while it still receives): the handoff
# costs two thread wake-ups, tens of microseconds, nothing beside a megabyte.
_PIPELINE_BYTES = 1 << 20

# place(index, bytes of pulled slice `index` in its wire dtype): copies them where they belong.
Place = Callable[[int, np.ndarray], None]
# direct(index): a uint8 view of where slice `index`'s bytes go unchanged, or None (they need a cast).
Direct = Callable[[int], "np.ndarray | None"]


class _Sender:
    """A thread that writes one request at a time while its caller reads the reply."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pshard-fastpath-sender", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def wait(self) -> BaseException | None:
        """How the last job submitted ended: None, or what it raised."""
        return self._done.get()

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as err:  # handed to the caller
                self._done.put(err)
            else:
                self._done.put(None)


def _handoff(segment: Segment, shm_dir: str, name: str, hello: bytes, timeout_s: float) -> socket.socket:
    """Connect to the server's unix socket `name` in `shm_dir`, send the hello with the segment's
    descriptor and check the nonce the server read in it: the connected socket."""
    if parse_socket_name(name) is None:
        raise TransportBroken(f"the server named no hand-off socket in the shared directory ({name!r})")
    assert segment.fd is not None
    try:
        sock = connect(Path(shm_dir) / name, timeout_s)
    except OSError as err:
        raise TransportBroken(f"shm hand-off through {shm_dir}/{name}: {err}") from None
    try:
        tune(sock)
        send_fd(sock, encode_header(HELLO, len(hello), 0) + hello, segment.fd)
        kind, nonce, data_len = Inbox(sock, 256).frame_head()
    except (OSError, TransportBroken) as err:
        sock.close()
        raise TransportBroken(f"shm hand-off through {shm_dir}/{name}: {err}") from None
    segment.release_fd()  # the server holds its own (or refused it): the mappings keep the memory
    if kind != HELLO or data_len or not hmac.compare_digest(nonce, segment.nonce):
        sock.close()
        raise TransportBroken("the server read another nonce in the segment")
    return sock


def _broken(kind: str, err: OSError | ValueError) -> TransportBroken:
    """What a failure of the path under a request means for the caller: ETIMEDOUT (the kernel's
    keepalive or user timeout) or the call's deadline is a silent peer, anything else a broken path."""
    cls = PeerSilent if isinstance(err, TimeoutError) else TransportBroken
    return cls(f"{kind} transport: {type(err).__name__}: {err}")


class FastPath:
    def __init__(self, kind: str, sock: Stream, segment: Segment | None, scratch: Segment | None) -> None:
        self.kind = kind
        self.tls = isinstance(sock, TlsStream)
        sock.settimeout(0.0)  # deadlines are kept by the Inbox and send_frame (fastwire says why)
        self._sock = sock
        self._inbox = Inbox(sock)
        self._spin = False  # the last reply came within _SPIN_S
        self._sent = 0.0  # when the request in flight was sent (perf_counter)
        self._segment = segment  # shm: the shared regions
        self._scratch = scratch  # tcp: where pulled slices that need a cast land first
        self._lock = threading.Lock()  # one request at a time: the regions hold one request's bytes
        self._sender: _Sender | None = None  # started for the first large request (TCP)
        self._sending = False  # the sender thread is writing the request in flight
        self._copies = shared_pool()  # copies into and out of the segment, multi-MiB each: on a few threads
        self.closed = False

    @classmethod
    def open(cls, kind: str, stub: pb_grpc.ParameterServerServiceStub, address: str, worker_id: str, *,
             request_bytes: int, reply_bytes: int, shm_dir: str, timeout_s: float,
             ssl_context: ssl.SSLContext | None = None,
             dead_after_s: float = DEFAULT_DEAD_AFTER_S, wait_for_ready: bool = True) -> FastPath:
        """Negotiate and connect; a PSError says why this kind is not possible with this server.

        `ssl_context` (a client context: our certificate, the job's CA): TCP runs over TLS, the
        server authenticated by its certificate and the host name we reached it by, as gRPC does.
        Shared memory needs none: the bytes never leave the host, and the session's secret came
        over the authenticated gRPC channel. `dead_after_s`: a server silent this long (its host
        cut off) breaks the TCP session (common.wire.liveness): the job's heartbeat timeout.
        `wait_for_ready`: False fails at once on a server that is down instead of waiting for it."""
        segment = scratch = None
        sock: Stream | None = None
        try:
            request = pb.OpenTransportRequest(worker_id=worker_id, kind=KINDS[kind],
                                              request_bytes=request_bytes, reply_bytes=reply_bytes)
            if kind == "shm":
                if not _swept.is_set():
                    _swept.set()
                    sweep_orphans(shm_dir)
                try:
                    segment = Segment.create(request_bytes, reply_bytes)
                except OSError as err:
                    raise TransportBroken(f"cannot create a segment: {err.strerror or err}") from None
            else:
                scratch = Segment.private(0, reply_bytes)
            try:
                reply = stub.OpenTransport(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
            except grpc.RpcError as err:
                raise error_from_rpc_error(err) from err
            hello = pb.TransportHello(session=reply.session, secret=reply.secret).SerializeToString()
            if segment is not None:
                sock = _handoff(segment, shm_dir, reply.socket, hello, timeout_s)
                return cls(kind, sock, segment, scratch)
            try:
                sock = open_session(address, reply.port, hello, timeout_s, ssl_context, dead_after_s)
            except OSError as err:
                raise TransportBroken(f"cannot connect to port {reply.port}: {err}") from None
            if isinstance(sock, TlsStream) and not _told_tls.is_set():
                _told_tls.set()
                log.info("fast path over TLS (%s, %s): encrypted in user space, in batches of records "
                         "(kernel TLS: %s)", sock.version(), (sock.cipher() or ("?",))[0],
                         "offered here, not used" if kernel_tls_available() else "not in this kernel")
            return cls(kind, sock, segment, scratch)
        except BaseException:
            for region in (segment, scratch):
                if region is not None:
                    region.close()
            if sock is not None:
                sock.close()
            raise

    def close(self) -> None:
        """Close the socket (the server ends the session) and unmap the segment."""
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            if self._sender is not None:
                self._sender.close()
            for region in (self._segment, self._scratch):
                if region is not None:
                    region.close()

    def call(self, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray], place: Place, direct: Direct,
             timeout_s: float) -> pb.ExchangeSummary:
        """One request: push `buffers` (in header order) and pull `header.pull`; the summary.

        A PSError the server raised is raised as such; any failure of the path is TransportBroken.
        """
        self.start(header, buffers, timeout_s)
        return self.finish(header, place, direct)

    def start(self, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray], timeout_s: float) -> None:
        """Send a request, and hold the session until `finish` reads its reply: a caller with requests
        to several servers sends them all before it waits for the first reply, on one thread."""
        self._lock.acquire()
        try:
            if self.closed:
                raise TransportBroken(f"{self.kind} transport closed")
            self._inbox.deadline = time.monotonic() + timeout_s
            self._send(header, buffers)
        except (OSError, ValueError) as err:  # ValueError: a region unmapped under us (closed)
            self._lock.release()
            raise _broken(self.kind, err) from err
        except BaseException:
            self._lock.release()
            raise

    def finish(self, header: pb.ExchangeHeader, place: Place, direct: Direct) -> pb.ExchangeSummary:
        """Read the reply of the request `start` sent (the same header) and release the session."""
        try:
            try:
                reply = self._receive(header, place, direct)
            except BaseException:
                if self._sending:  # the path is dropped: stop the sender at once
                    with contextlib.suppress(OSError):
                        self._sock.shutdown(socket.SHUT_RDWR)
                raise
            finally:
                sent = self._sent_all()
            if sent is not None:  # the reply came (an error, early) but the request did not all go
                raise sent
        except (OSError, ValueError) as err:
            raise _broken(self.kind, err) from err
        finally:
            self._lock.release()
        if reply.error_type:
            raise rebuild(reply.error_type, reply.error_message, reply.error_facts)
        return reply.summary

    def _send(self, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray]) -> None:
        views = [np.ascontiguousarray(b).reshape(-1).view(np.uint8) for b in buffers]
        segment = self._segment
        if segment is not None:
            offsets, total = packed([v.nbytes for v in views])
            if total > segment.request_bytes:
                raise TransportBroken(f"request of {total} bytes exceeds the segment's "
                                      f"{segment.request_bytes}")
            for offset, view in zip(offsets, views, strict=True):
                self._copies.copy(segment.request[offset:offset + view.nbytes], view)
            views = []
        meta, deadline = header.SerializeToString(), self._inbox.deadline
        if sum([v.nbytes for v in views]) > _PIPELINE_BYTES:
            if self._sender is None:
                self._sender = _Sender()
            self._sending = True
            self._sender.submit(lambda: self._send_all(meta, views, deadline))
        else:
            send_frame(self._sock, REQUEST, meta, views, deadline)
        self._sent = time.perf_counter()

    def _send_all(self, meta: bytes, views: Sequence[np.ndarray], deadline: float | None) -> None:
        """On the sender thread. A failure shuts the socket down, so the caller's read ends at once
        rather than at the deadline (the server waits for the rest of the request)."""
        try:
            send_frame(self._sock, REQUEST, meta, views, deadline)
        except BaseException:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            raise

    def _sent_all(self) -> BaseException | None:
        """Once the request in flight is all sent (at once unless the sender thread writes it): how
        its sending ended."""
        if not self._sending:
            return None
        self._sending = False
        assert self._sender is not None
        return self._sender.wait()
    def _receive(self, header: pb.ExchangeHeader, place: Place, direct: Direct) -> pb.TransportReply:
        segment = self._segment
        kind, meta, data_len = self._inbox.frame_head(_SPIN_S if self._spin else 0.0)
        self._spin = time.perf_counter() - self._sent <= _SPIN_S
        pulled = int(header.table.pull) if header.op == pb.EXCHANGE_OP_TABLE else len(header.pull)
        streamed: list[int] = []  # sizes of the slices that came ahead of the reply (TCP)
        while kind == SLICE and segment is None:
            index = decode_slice_meta(meta)
            if index != len(streamed) or index >= pulled:
                raise TransportBroken(f"slice frame {index} out of order ({len(streamed)} of {pulled} read)")
            self._read_slice(index, data_len, place, direct)
            streamed.append(data_len)
            kind, meta, data_len = self._inbox.frame_head()
        if kind != REPLY:
            raise TransportBroken(f"expected a reply frame, got kind {kind}")
        reply = pb.TransportReply.FromString(meta)
        if reply.error_type:
            return reply
        if len(reply.sizes) != pulled:
            raise TransportBroken(f"reply has {len(reply.sizes)} slices, {pulled} were pulled")
        if streamed:
            if streamed != list(reply.sizes) or data_len:
                raise TransportBroken(f"reply lists slices of {list(reply.sizes)} bytes, {streamed} came "
                                      f"ahead of it and {data_len} with it")
            return reply
        if segment is not None:
            for index, (offset, size) in enumerate(zip(reply.offsets, reply.sizes, strict=True)):
                if offset + size > segment.reply_bytes:
                    raise TransportBroken(f"reply slice at {offset}+{size} is outside the segment")
                target = direct(index)
                if target is not None and target.nbytes == size:  # one copy, no conversion to look up
                    self._copies.copy(target, segment.reply[offset:offset + size])
                else:
                    place(index, segment.reply[offset:offset + size])
            return reply
        if data_len != sum(reply.sizes):
            raise TransportBroken(f"reply announces {data_len} bytes, its slices {sum(reply.sizes)}")
        for index, size in enumerate(reply.sizes):
            self._read_slice(index, size, place, direct)
        return reply

    def _read_slice(self, index: int, size: int, place: Place, direct: Direct) -> None:
        """Pulled slice `index` from the socket: straight into the caller's array when no cast is needed."""
        target = direct(index)
        if target is not None and target.nbytes == size:
            self._inbox.read_into(target)
            return
        scratch = self._scratch
        assert scratch is not None
        if size > scratch.reply_bytes:
            raise TransportBroken(f"pulled slice of {size} bytes exceeds the scratch buffer")
        self._inbox.read_into(scratch.reply[:size])
        place(index, scratch.reply[:size])
