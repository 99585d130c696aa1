"""The server's TLS fast-path connections, terminated off the event loop.

Through asyncio's TLS layer the server's one event-loop thread encrypted and decrypted every worker's
bytes, record by record, with a copy more: the dense step over TLS ran at about half its speed in
clear, with that thread the limit (issue 24). Here each accepted TLS connection gets two threads of
its own around a `TlsStream` (common/wire/tls_stream.py: OpenSSL over memory buffers, a megabyte of
records per system call, the GIL released while OpenSSL encrypts or decrypts): one decrypts what the
worker sends into one end of a unix socket pair, the other encrypts what comes out of it. The event
loop serves the pair's other end as it serves a clear TCP connection (fastconn.Connection, replies
sent straight from where they lie), so its thread does no cryptography, and the connections' ciphers
run in parallel with it and with each other.

The handshake runs in the connection's thread too, with the same context as before
(common/security/credentials.py: the CA, the CRL, a client certificate required), so mutual
authentication and every refusal are OpenSSL's, as they were; a refused handshake is logged with the
peer's address and OpenSSL's reason. Liveness is the TCP socket's (keepalives, TCP_USER_TIMEOUT):
when it breaks, the pair is shut down and the connection sees EOF; when the server closes its end,
the TCP socket is shut down.

A small call pays for each thread it passes through: a wake-up, tens of microseconds on a busy host,
against a few hundred for the whole call. So a small reply skips the encrypting thread: the event loop
encrypts it and sends it without waiting (`send_direct`), provided the thread has encrypted everything
the loop put in the pair before it (the records keep the order the loop wrote in) and is not sending;
what the socket does not take at once is sent by a thread that may wait. Likewise a small request
skips the decrypting thread: after a read that brought little with nothing more waiting (the end of a
burst: a small request, or the tail of a large one), that thread lends the TCP socket to the event loop
and waits; the loop decrypts what comes (a non-blocking read of at most 64 KiB) and hands it straight
to the Connection (`attach`, `Connection.feed`) once the Connection has read all the pair brought
before, or else into the pair: no thread is woken, and no pair crossed. As soon as a read fills that
much (bulk is coming), the pair has no room (the server is not reading), or the connection ends, the
loop gives the socket back, with what the pair did not take, and the thread deciphers the bulk as
before, beside the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Protocol

from pshard.common.wire.fastwire import tune
from pshard.common.wire.liveness import keep_alive
from pshard.common.wire.tls_stream import BATCH_BYTES, TlsStream

log = logging.getLogger("pshard.ps.transport")

# The event loop reads a lent TLS socket this much at a time; a read that fills it gives the socket back.
LEND_READ_BYTES = 64 * 1024

Peer = tuple[object, ...] | str


class Fed(Protocol):
    """The Connection serving a relay's pair, as the loop feeds it (ps_server/transport/fastconn.py)."""

    @property
    def from_pair(self) -> int: ...

    def feed(self, data: memoryview) -> int: ...


def describe(peer: Peer) -> str:
    """"10.0.0.4:51000" for an (address, port, ...) tuple."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer)


def handshake_failure(err: BaseException) -> str:
    """Why a handshake failed, in OpenSSL's words where it gave some (the verification's message for a
    certificate it refused)."""
    if isinstance(err, ssl.SSLCertVerificationError) and err.verify_message:
        return f"certificate verify failed: {err.verify_message}"
    reason = getattr(err, "reason", None)  # OpenSSL's; an SSLError raised in Python has none
    if isinstance(err, ssl.SSLError) and reason:
        return str(reason).lower().replace("_", " ")
    if isinstance(err, TimeoutError | socket.timeout):
        return "no complete handshake in time"
    if isinstance(err, ssl.SSLEOFError | ConnectionError):
        return "the peer closed the connection during the handshake"
    return f"{type(err).__name__}: {err}"


class TlsRelay:
    """One accepted TCP connection: the TLS handshake, then the relay between it and a unix socket pair.

    `ready(end, peer, relay)` is called (from the relay's thread) with the pair's end the server serves;
    `done()` once the handshake is over, whether it succeeded or not (the server counts connections
    that have not authenticated yet)."""

    def __init__(self, sock: socket.socket, peer: Peer, context: ssl.SSLContext, handshake_timeout_s: float,
                 dead_after_s: float, ready: Callable[[socket.socket, Peer, TlsRelay], None],
                 done: Callable[[], None], loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: the event loop that serves the pair, which reads small requests itself (None: the
        decrypting thread reads everything)."""
        self._sock = sock
        self.peer = peer
        self._context = context
        self._handshake_timeout_s = handshake_timeout_s
        self._dead_after_s = dead_after_s
        self._ready = ready
        self._done = done
        self._inner: socket.socket | None = None
        self._lock = threading.Lock()
        self._running = 0  # relay threads not finished: the last one closes both sockets
        self._stopping = False
        self._stream: TlsStream | None = None  # once the handshake is done
        self._encrypted = 0  # bytes the encrypting thread took from the pair and encrypted (it alone adds)
        self._loop = loop
        # The TCP socket lent to the loop: its descriptor while the loop reads it; set when it is given back,
        # with what the pair did not take.
        self._lent_fd: int | None = None
        self._back = threading.Event()
        self._leftover = b""
        self._small = memoryview(bytearray(LEND_READ_BYTES))  # the loop's reads, decrypted
        self._paired = 0  # bytes put in the pair (by the decrypting thread, or the loop while lent)
        self._connection: Fed | None = None  # the Connection serving the pair (on the loop)

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"tls-relay-{describe(self.peer)}", daemon=True).start()

    def close(self) -> None:
        """Break the connection (server stopping; on the event loop): the threads end, and close what
        they hold."""
        with self._lock:
            self._stopping = True
            sockets = [s for s in (self._sock, self._inner) if s is not None]
        for sock in sockets:
            _shutdown(sock)
        if self._lent_fd is not None:
            self._give_back(b"")

    def _run(self) -> None:
        try:
            tune(self._sock)
            keep_alive(self._sock, self._dead_after_s)
            self._sock.settimeout(self._handshake_timeout_s)
            stream = TlsStream.connect(self._sock, self._context, None)
            self._sock.settimeout(None)
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            self._done()
            self._sock.close()
            if not self._stopping:
                log.warning("fast path: refused a TLS connection from %s: the handshake failed: %s",
                            describe(self.peer), handshake_failure(err))
            return
        self._done()
        inner, outer = socket.socketpair()
        for end in (inner, outer):
            tune(end)
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._inner, self._running, self._stream = inner, 2, stream
        if stopping:
            for sock in (self._sock, inner, outer):
                sock.close()
            return
        threading.Thread(target=self._encrypt, args=(stream, inner), daemon=True,
                         name=f"tls-out-{describe(self.peer)}").start()
        self._ready(outer, self.peer, self)
        self._decrypt(stream, inner)

    def _decrypt(self, stream: TlsStream, inner: socket.socket) -> None:
        """The worker's bytes, decrypted, into the pair; its EOF (or a broken link) as the pair's."""
        buf = memoryview(bytearray(BATCH_BYTES))
        try:
            while True:
                n = stream.recv_into(buf)
                if not n:
                    inner.shutdown(socket.SHUT_WR)
                    break
                inner.sendall(buf[:n])
                self._paired += n
                if n < LEND_READ_BYTES and not _readable_now(self._sock) and self._lend():
                    inner.sendall(self._leftover)
                    self._paired += len(self._leftover)
                    stream.flush()
        except OSError as err:
            log.info("fast path: TLS connection from %s ended: %s", describe(self.peer), err)
            _shutdown(inner)
        finally:
            self._finish()

    def _encrypt(self, stream: TlsStream, inner: socket.socket) -> None:
        """The server's replies, encrypted, to the worker; the server's close ends the TCP connection."""
        buf = memoryview(bytearray(BATCH_BYTES))
        # Waiting in poll, not in recv: a thread asleep in a unix socket's recv is woken whenever the pair
        # makes room to write into this end (each time the loop reads a request the loop itself put there),
        # while poll wakes only for what it waits for.
        readable = select.poll()
        readable.register(inner, select.POLLIN)
        try:
            while True:
                readable.poll()
                n = inner.recv_into(buf)
                if not n:
                    break
                stream.send_all([buf[:n]])
                self._encrypted += n
        except OSError:
            pass  # the worker is gone: the decrypting side sees it too, and tells the server
        finally:
            _shutdown(self._sock)
            self._finish()

    def _lend(self) -> bool:
        """From the decrypting thread: the TCP socket to the event loop until it gives it back (False:
        not lent, no loop to lend it to)."""
        if self._loop is None or self._stopping:
            return False
        self._back.clear()
        self._leftover = b""
        try:
            self._loop.call_soon_threadsafe(self._watch)
        except RuntimeError:  # the loop closed: the server is gone
            return False
        while not self._back.wait(1.0):
            if self._loop.is_closed():  # it stopped without closing us: nothing reads for it any more
                break
        return True

    def _watch(self) -> None:
        """On the loop: read the lent socket when something comes."""
        if self._stopping:
            self._leftover = b""
            self._back.set()
            return
        self._lent_fd = self._sock.fileno()
        assert self._loop is not None
        self._loop.add_reader(self._lent_fd, self._readable)

    def _readable(self) -> None:
        """On the loop: what came, decrypted into the pair; the socket given back unless it was small."""
        stream, inner = self._stream, self._inner
        assert stream is not None and inner is not None
        try:
            got, read = stream.recv_nowait(self._small, LEND_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:  # a broken link or record: the thread sees the end and tells the server
            _shutdown(self._sock)
            self._give_back(b"")
            return
        sent = 0
        connection = self._connection
        if got and connection is not None and connection.from_pair == self._paired:
            # Everything put in the pair has been read from it: straight to the Connection, in order.
            sent = connection.feed(self._small[:got])
        if sent < got:
            try:
                to_pair = inner.send(self._small[sent:got], socket.MSG_DONTWAIT)
                self._paired += to_pair
                sent += to_pair
            except BlockingIOError:
                pass
            except OSError:
                _shutdown(self._sock)
        if not read or sent < got or read == LEND_READ_BYTES or got == len(self._small) or stream.queued:
            self._give_back(self._small[sent:got])

    def _give_back(self, leftover: memoryview | bytes) -> None:
        """On the loop: the socket back to the decrypting thread, which first puts `leftover` in the pair."""
        if self._lent_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._lent_fd)
        self._lent_fd = None
        self._leftover = bytes(leftover)
        self._back.set()

    def attach(self, connection: Fed | None) -> None:
        """On the loop: the Connection serving the pair (None: it is gone)."""
        self._connection = connection

    def send_direct(self, frame: bytes, written: int) -> bool:
        """On the event loop: `frame` encrypted and sent here, past the pair, when the encrypting thread
        has encrypted all `written` bytes the loop put in the pair and is not sending; False: not taken
        (the caller puts it in the pair). Never waits: what the socket does not take at once goes out
        from a thread of its own."""
        stream = self._stream
        if stream is None or written != self._encrypted:
            return False
        try:
            sent = stream.send_nowait(frame)
        except OSError:
            _shutdown(self._sock)  # the worker is gone: the decrypting thread tells the server
            return True
        if sent is None:
            return False
        if not sent:
            threading.Thread(target=self._flush, args=(stream,), daemon=True,
                             name=f"tls-flush-{describe(self.peer)}").start()
        return True

    def _flush(self, stream: TlsStream) -> None:
        try:
            stream.flush()
        except OSError:
            _shutdown(self._sock)

    def _finish(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running:
                return
        self._sock.close()
        if self._inner is not None:
            self._inner.close()


def _readable_now(sock: socket.socket) -> bool:
    """More has come already: a burst goes on (lending the socket to the loop then only costs wake-ups)."""
    return bool(select.select([sock], [], [], 0)[0])


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected, or closed already
        sock.shutdown(socket.SHUT_RDWR)
