"""Frames of the fast-path socket (shared memory's doorbell, or the raw TCP transport).

A frame is a fixed 20-byte header (magic, kind, metadata length, data length), the metadata
(a small protobuf message the caller encodes), then `data length` raw bytes (TCP only: the
slices themselves; over shared memory the bytes are in the segment and the length is 0).
A large TCP reply sends each pulled slice as its own SLICE frame (metadata: the slice's index in
the request's pull list) as soon as the server has it, then the REPLY frame with the summary and
no data; a small one sends its slices inline after the REPLY's metadata.
One thread per connection reads straight into pre-allocated, page-aligned buffers with
`recv_into`, and writes numpy buffers with `sendmsg`, no copy. A worker's plain socket is
non-blocking, with the call's deadline kept here: a blocking socket with a timeout costs a poll
before every send and receive, and a reply that is microseconds away is waited for by spinning
(`Inbox.frame_head`) rather than by sleeping, whose wake-up costs more than a small request. Over TLS
the session's socket is a `TlsStream` (`tls_stream.py`), non-blocking as well: the same calls encrypt
and decrypt between the buffers and the socket in batches of records, and a small frame still goes
as one TLS record. An `ssl.SSLSocket` (which has no `sendmsg` nor receive flags) is taken too, with
its own timeout: tests speak to the server through one.

Pure: no gRPC.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
from pshard.common.errors import PSError
from pshard.common.wire.codec import byte_view
from pshard.common.wire.liveness import DEFAULT_DEAD_AFTER_S, keep_alive
from pshard.common.wire.tls_stream import TlsStream, wait_ready

_HEADER = struct.Struct("<4sB3xIQ")
HEADER_BYTES = _HEADER.size
_MAGIC = b"PSF1"
# Metadata is a header or a reply: a few KB per thousand slices. Larger is a broken or hostile peer.
MAX_META_BYTES = 16 * 2**20
# Over TLS, frames up to this size are joined and sent as one record (a copy is cheaper than a record).
_JOIN_BYTES = 64 * 1024

HELLO = 1
REQUEST = 2
REPLY = 3
SLICE = 4
KINDS = (HELLO, REQUEST, REPLY, SLICE)
_SLICE_META = struct.Struct("<I")
# What the fast path reads and writes: a socket (an SSLSocket too), or a TLS stream over one.
Stream: TypeAlias = "socket.socket | TlsStream"
# A fast-path connect that got no answer for this long is dropped by a firewall, not slow: on a
# network that answers, a lost SYN is sent again after 1 s and 3 s, both within it.
CONNECT_TIMEOUT_S = 4.0


class TransportBroken(PSError):
    """The fast path failed under a request (peer gone, socket reset, bad frame, segment gone):
    the request must complete over gRPC. Never a verdict on the request itself."""

    status = "UNAVAILABLE"


class PeerSilent(TransportBroken):
    """The peer answered nothing, not even the kernel's keepalive probes, until a deadline or the
    socket's liveness timeout (common.wire.liveness): its host is cut off or gone. Unlike a reset,
    sending the same request to the same address over gRPC would most likely wait as long again."""


class FastPortSilent(TransportBroken):
    """Connecting to a fast-path port got no answer at all, neither an accept nor a refusal: a
    firewall drops it. Trying again costs the same wait each time, so callers stop trying that port
    (gRPC, on its own port, carries the calls)."""


def encode_header(kind: int, meta_len: int, data_len: int) -> bytes:
    return _HEADER.pack(_MAGIC, kind, meta_len, data_len)


def decode_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(kind, metadata length, data length); TransportBroken for anything else."""
    magic, kind, meta_len, data_len = _HEADER.unpack(raw)
    if magic != _MAGIC or kind not in KINDS or meta_len > MAX_META_BYTES:
        raise TransportBroken(f"bad fast-path frame header (magic {magic!r}, kind {kind}, "
                              f"metadata {meta_len} bytes)")
    return kind, meta_len, data_len


def encode_slice_meta(index: int) -> bytes:
    return _SLICE_META.pack(index)


def decode_slice_meta(meta: bytes) -> int:
    """The pull-list index a SLICE frame carries; TransportBroken for anything else."""
    if len(meta) != _SLICE_META.size:
        raise TransportBroken(f"slice frame with {len(meta)} bytes of metadata, expected {_SLICE_META.size}")
    return int(_SLICE_META.unpack(meta)[0])


def send_frame(sock: Stream, kind: int, meta: bytes,
               data: Sequence[bytes | memoryview | np.ndarray] = (), deadline: float | None = None) -> None:
    """Header, metadata and data in as few system calls as the kernel allows (no joining copy).
    `deadline`: for a non-blocking socket, when to give up waiting for room to write."""
    views = [v for v in (byte_view(d) for d in data) if v.nbytes]
    parts = [memoryview(encode_header(kind, len(meta), sum(v.nbytes for v in views)) + meta), *views]
    if isinstance(sock, (ssl.SSLSocket, TlsStream)):
        if sum(p.nbytes for p in parts) <= _JOIN_BYTES:  # one record, one system call
            parts = [memoryview(b"".join(parts))]
        if isinstance(sock, TlsStream):
            sock.send_all(parts, deadline)
            return
        for part in parts:
            sock.sendall(part)
        return
    while parts:
        try:
            sent = sock.sendmsg(parts[:512])  # IOV_MAX is 1024 on Linux
        except BlockingIOError:
            wait_ready(sock, True, deadline)
            continue
        while sent:
            if sent >= parts[0].nbytes:
                sent -= parts[0].nbytes
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0


def recv_into(sock: Stream, buf: memoryview | np.ndarray, deadline: float | None = None) -> None:
    """Fill `buf` exactly; TransportBroken when the peer closes first. `deadline`: for a non-blocking
    socket, when to give up waiting for data."""
    view = byte_view(buf)
    got = 0
    flags = 0 if isinstance(sock, (ssl.SSLSocket, TlsStream)) else socket.MSG_WAITALL
    while got < view.nbytes:
        try:
            n = sock.recv_into(view[got:], view.nbytes - got, flags)
        except BlockingIOError:
            wait_ready(sock, False, deadline)
            continue
        if n == 0:
            raise TransportBroken(f"peer closed the connection ({got} of {view.nbytes} bytes read)")
        got += n


def recv_exact(sock: Stream, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_frame_head(sock: Stream) -> tuple[int, bytes, int]:
    """(kind, metadata, data length): the data, if any, is for the caller to read where it belongs."""
    kind, meta_len, data_len = decode_header(recv_exact(sock, HEADER_BYTES))
    return kind, recv_exact(sock, meta_len), data_len


class Inbox:
    """Reads frames from a socket with as few system calls as possible: a header and its metadata
    usually come in one read, and bytes read past them are handed out first. A non-blocking socket
    waits until `deadline` (time.monotonic(); None: for ever)."""

    def __init__(self, sock: Stream, size: int = 64 * 1024) -> None:
        self._sock = sock
        self._buf = memoryview(bytearray(size))
        self._start = self._end = 0
        self.deadline: float | None = None
        self._spin_until = 0.0  # time.perf_counter(): retry a non-blocking read until then, then poll

    def _fill(self, n: int) -> None:
        """At least `n` bytes buffered (growing the buffer for a very large metadata)."""
        if self._end - self._start >= n:
            return
        if self._start + n > len(self._buf):
            pending = bytes(self._buf[self._start:self._end])
            if n > len(self._buf):
                self._buf = memoryview(bytearray(n))
            self._buf[:len(pending)] = pending
            self._start, self._end = 0, len(pending)
        while self._end - self._start < n:
            try:
                got = self._sock.recv_into(self._buf[self._end:])
            except ssl.SSLWantWriteError:  # TLS 1.3 may have to write (a key update) to read on
                wait_ready(self._sock, True, self.deadline)
                continue
            except (BlockingIOError, ssl.SSLWantReadError):
                if time.perf_counter() >= self._spin_until:
                    wait_ready(self._sock, False, self.deadline)
                else:  # let a runnable peer have this core (on a busy machine it may be the server)
                    os.sched_yield()
                continue
            if got == 0:
                raise TransportBroken(f"peer closed the connection ({self._end - self._start} of {n} "
                                      "bytes read)")
            self._end += got

    def frame_head(self, spin_s: float = 0.0) -> tuple[int, bytes, int]:
        """(kind, metadata, data length) of the next frame; its data is read with `read_into`.
        `spin_s`: on a non-blocking socket, keep trying to read for that long before sleeping in poll
        (a reply expected within microseconds: a sleeping thread's wake-up costs tens of them)."""
        self._spin_until = time.perf_counter() + spin_s if spin_s else 0.0
        self._fill(HEADER_BYTES)
        self._spin_until = 0.0
        kind, meta_len, data_len = decode_header(self._buf[self._start:self._start + HEADER_BYTES])
        self._start += HEADER_BYTES
        self._fill(meta_len)
        meta = bytes(self._buf[self._start:self._start + meta_len])
        self._start += meta_len
        if self._start == self._end:
            self._start = self._end = 0
        return kind, meta, data_len

    def read_into(self, buf: memoryview | np.ndarray) -> None:
        view = byte_view(buf)
        have = min(self._end - self._start, view.nbytes)
        if have:
            view[:have] = self._buf[self._start:self._start + have]
            self._start += have
            if self._start == self._end:
                self._start = self._end = 0
        if have < view.nbytes:
            recv_into(self._sock, view[have:], self.deadline)


def discard(sock: Stream, n: int) -> None:
    """Read and drop `n` bytes (data of a request that is refused), keeping the stream in step."""
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        chunk = scratch[:min(n, len(scratch))]
        recv_into(sock, chunk)
        n -= len(chunk)


def tune(sock: socket.socket) -> None:
    """No Nagle delay (doorbells are tiny). A unix socket gets big buffers (slices are megabytes); a TCP
    socket keeps the kernel's autotuned ones: setting SO_SNDBUF/SO_RCVBUF locks them (to twice the
    value, at most net.core.*mem_max), and a locked 4 MiB held 30 to 60 ms of a 1 Gbit/s link, so a process
    that waited that long for a CPU stalled its flows (zero windows). Autotuning grows them with the
    bandwidth-delay product, up to net.ipv4.tcp_rmem/tcp_wmem's limits (issue 19: W1 on the test bed's
    1 Gbit/s links, median 1.42 s a step against 2.08 s locked, nine alternating pairs at load 11 to 28)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 * 2**20)


def host_of(address: str) -> str:
    """The host part of a gRPC target "host:port" ("[::1]:5000" -> "::1")."""
    return address.rsplit(":", 1)[0].strip("[]")


def open_session(address: str, port: int, hello: bytes, timeout_s: float,
                 ssl_context: ssl.SSLContext | None,
                 dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> Stream:
    """A session's socket: connected to `port` on the host of gRPC target `address`, tuned, kept
    alive (a peer silent for `dead_after_s` breaks it: common.wire.liveness), under TLS when
    `ssl_context` is given (a TlsStream; the server's name checked against `address`'s host), its hello frame
    sent. OSError, the socket closed, if any of it fails (a worker's session and the servers'
    replication link open theirs alike); FastPortSilent when the connect got no answer within
    CONNECT_TIMEOUT_S."""
    host = host_of(address)
    connect_s = min(timeout_s, CONNECT_TIMEOUT_S)
    try:
        sock = socket.create_connection((host, port), timeout=connect_s)
    except TimeoutError:
        raise FastPortSilent(f"fast-path port {port} on {host} gave no answer within {connect_s:g} s "
                             "(a firewall drops it?): open TCP port "
                             f"{port} on {host} to the workers and servers, or pin it with `pshard ps "
                             "--fast-port N` and open that one; gRPC carries the calls meanwhile") from None
    try:
        sock.settimeout(timeout_s)
        tune(sock)
        keep_alive(sock, dead_after_s)
        if ssl_context is not None:
            stream = TlsStream.connect(sock, ssl_context, host)
            send_frame(stream, HELLO, hello)
            return stream
        send_frame(sock, HELLO, hello)
    except BaseException:
        sock.close()
        raise
    return sock
