"""A TLS connection for the fast path's worker side: the TLS state in memory, the socket our own.

An `ssl.SSLSocket` cannot be read by one thread while another writes to it (one OpenSSL connection
must not be used by two threads at once), so over TLS a large request was sent whole before its
reply was read, while in clear the sender thread writes it as the server already sends the pulled
slices back. It also works record by record: a 16 KiB record per `write` system call, and (OpenSSL
reads no further ahead than asked) one or two `recv` calls per record read.

Here the same OpenSSL connection runs on an `ssl.SSLObject` over memory BIOs (the handshake, the
certificate checks and the verification of the peer's host name are OpenSSL's, exactly as for an
SSLSocket from the same context): `send_all` encrypts up to 1 MiB of records and writes them with one
system call, and `recv_into` reads up to 1 MiB of records with one and decrypts them straight into the
caller's buffer. One lock guards the TLS state; encrypted bytes are queued in order and sent by one
thread at a time, so a sender thread and a reader thread may use one stream at once. One Python TLS
stream runs about 1.2x an SSLSocket's (`python -m bench.tls_ceiling`).

Kernel TLS (the socket option TCP_ULP "tls") would save the copies too, but needs a kernel with
CONFIG_TLS (neither this project's build machine nor its GPU machines have it), OpenSSL 3.2 to receive
TLS 1.3 in the kernel, and an SSLSocket, not an SSLObject, to hand the keys over: `kernel_tls_available()`
says whether a host offers it, and the worker logs which TLS its fast path runs.

Pure: no gRPC.
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

# Records encrypted per send system call, and bytes read per receive system call.
BATCH_BYTES = 1 << 20
_ULP_LIST = Path("/proc/sys/net/ipv4/tcp_available_ulp")


def kernel_tls_available() -> bool:
    """Whether this kernel offers kernel TLS (its `tls` module loaded or built in)."""
    try:
        return "tls" in _ULP_LIST.read_text().split()
    except OSError:
        return False


def wait_ready(sock: socket.socket | TlsStream, writable: bool, deadline: float | None) -> None:
    """Until a non-blocking `sock` can be written (read); TimeoutError at `deadline` (time.monotonic())."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if writable else select.POLLIN)
    left_ms = None if deadline is None else max(0.0, (deadline - time.monotonic()) * 1000)
    if not poller.poll(left_ms):
        raise TimeoutError("fast-path socket: no progress before the call's deadline")


class TlsStream:
    """A client TLS connection over a connected TCP socket; `connect` runs the handshake. It is used as
    a socket (`recv_into`, `settimeout`, `fileno`, `shutdown`, `close`) plus `send_all`. The socket's
    timeout applies to each system call as on a plain socket: 0.0 makes `recv_into` raise
    BlockingIOError when no whole record is in, and `send_all` then waits for room until its deadline."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str | None) -> None:
        """`server_hostname` None: the server's side of the connection."""
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_hostname is None,
                                     server_hostname=server_hostname)
        self._state = threading.Lock()  # the SSLObject and its two BIOs
        self._sending = threading.Lock()  # taken before _state: one thread sends the queue at a time
        self._queue: collections.deque[memoryview] = collections.deque()  # encrypted, in order, to send
        self._raw = bytearray(BATCH_BYTES)

    @classmethod
    def connect(cls, sock: socket.socket, context: ssl.SSLContext, server_hostname: str | None) -> TlsStream:
        """The handshake over `sock` (within its timeout): ssl.SSLError (an OSError) when a side refuses
        the other's certificate, or the name, as SSLSocket's handshake raises it."""
        stream = cls(sock, context, server_hostname)
        stream._handshake()
        return stream

    def _handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._take_encrypted()
                self._drain(None)
                data = self._sock.recv(BATCH_BYTES)
                if not data:
                    raise ssl.SSLEOFError("the peer closed the connection in the TLS handshake") from None
                self._incoming.write(data)
        self._take_encrypted()
        self._drain(None)

    # ---- socket-like ----

    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def version(self) -> str | None:
        return self._tls.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self._tls.cipher()

    def getpeercert(self) -> dict[str, object] | None:
        return self._tls.getpeercert()  # type: ignore[return-value]

    # ---- data ----

    def recv_into(self, buffer: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        """Decrypt into `buffer` (at most `nbytes`) what has come; 0 when the peer closed. One system call
        at most, unless it brought only part of a record."""
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        got = 0
        if self._incoming.pending or self._tls.pending():  # else nothing to decrypt: straight to the socket
            with self._state:
                got = self._decrypt_into(view)
        while not got:
            n = self._sock.recv_into(self._raw)  # BlockingIOError, TimeoutError: as a plain socket's
            if not n:
                return 0
            with self._state:
                self._incoming.write(memoryview(self._raw)[:n])
                got = self._decrypt_into(view)
                answered = self._take_encrypted()  # TLS 1.3 may answer what it read (a key update)
            if answered:
                self._try_drain(None)
        return got

    def recv_nowait(self, buffer: memoryview, limit: int) -> tuple[int, int]:
        """From a thread that must not block (the server's event loop): one system call that does not
        wait reads at most `limit` encrypted bytes, decrypted into `buffer`: (bytes decrypted, bytes
        read), (0, 0) when the peer closed; BlockingIOError when nothing came. Only one thread may read
        a stream at a time."""
        n = self._sock.recv_into(self._raw, min(limit, len(self._raw)), socket.MSG_DONTWAIT)
        if not n:
            return 0, 0
        with self._state:
            self._incoming.write(memoryview(self._raw)[:n])
            got = self._decrypt_into(memoryview(buffer).cast("B"))
            self._take_encrypted()
        return got, n

    @property
    def queued(self) -> bool:
        """Encrypted bytes wait to be sent (TLS 1.3 may answer what it read): `flush` sends them."""
        return bool(self._queue)

    def _decrypt_into(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            try:
                # With a buffer, read returns the count it decrypted into it (typeshed says bytes).
                n = cast(int, self._tls.read(len(view) - got, view[got:]))  # type: ignore[arg-type]
            except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                break
            if not n:
                break
            got += n
        return got

    def send_all(self, parts: Sequence[memoryview], deadline: float | None = None) -> None:
        """Encrypt and send `parts`, in batches of records; `deadline` (time.monotonic()): when a
        non-blocking socket stops waiting for room."""
        with self._sending:
            for part in parts:
                for start in range(0, len(part), BATCH_BYTES):
                    with self._state:
                        self._tls.write(part[start:start + BATCH_BYTES])
                        self._take_encrypted()
                    self._drain(deadline)
        self._try_drain(deadline)

    def send_nowait(self, data: bytes | memoryview) -> bool | None:
        """Encrypt and send `data` from a thread that must not block (the server's event loop): None
        when another thread is sending (nothing was taken: the caller sends it some other way), True
        when it all went out, False when the socket did not take all of it: the rest stays queued, in
        order, for `flush` on a thread that may wait (or the next sender). A broken socket raises."""
        if not self._sending.acquire(blocking=False):
            return None
        try:
            with self._state:
                self._tls.write(data)
                self._take_encrypted()
            while self._queue:
                chunk = self._queue.popleft()
                try:
                    sent = self._sock.send(chunk, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._queue.appendleft(chunk)
                    raise
                if sent < len(chunk):
                    self._queue.appendleft(chunk[sent:])
                    return False
            return True
        finally:
            self._sending.release()

    def flush(self, deadline: float | None = None) -> None:
        """Send what is queued (waiting for room), unless another thread is sending it."""
        self._try_drain(deadline)

    def _take_encrypted(self) -> bool:
        """Queue what the TLS layer encrypted, in its order (the caller holds _state)."""
        if not self._outgoing.pending:
            return False
        self._queue.append(memoryview(self._outgoing.read()))
        return True

    def _try_drain(self, deadline: float | None) -> None:
        """Send what is queued, unless another thread sends: the holder of _sending looks again once it
        lets go, so bytes queued while it sent are never left behind."""
        while self._queue and self._sending.acquire(blocking=False):
            try:
                self._drain(deadline)
            finally:
                self._sending.release()

    def _drain(self, deadline: float | None) -> None:
        """Send the queue (the caller holds _sending, or is alone: the handshake)."""
        while self._queue:
            data = self._queue.popleft()
            try:
                while len(data):
                    try:
                        data = data[self._sock.send(data):]
                    except BlockingIOError:
                        wait_ready(self._sock, True, deadline)
            finally:
                if len(data):
                    self._queue.appendleft(data)
