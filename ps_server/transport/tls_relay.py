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
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable

from pshard.common.wire.fastwire import tune
from pshard.common.wire.liveness import keep_alive
from pshard.common.wire.tls_stream import BATCH_BYTES, TlsStream

log = logging.getLogger("pshard.ps.transport")

Peer = tuple[object, ...] | str


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

    `ready(end, peer)` is called (from the relay's thread) with the pair's end the server serves;
    `done()` once the handshake is over, whether it succeeded or not (the server counts connections
    that have not authenticated yet)."""

    def __init__(self, sock: socket.socket, peer: Peer, context: ssl.SSLContext, handshake_timeout_s: float,
                 dead_after_s: float, ready: Callable[[socket.socket, Peer], None],
                 done: Callable[[], None]) -> None:
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

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"tls-relay-{describe(self.peer)}", daemon=True).start()

    def close(self) -> None:
        """Break the connection (server stopping): the threads end, and close what they hold."""
        with self._lock:
            self._stopping = True
            sockets = [s for s in (self._sock, self._inner) if s is not None]
        for sock in sockets:
            _shutdown(sock)

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
                self._inner, self._running = inner, 2
        if stopping:
            for sock in (self._sock, inner, outer):
                sock.close()
            return
        threading.Thread(target=self._encrypt, args=(stream, inner), daemon=True,
                         name=f"tls-out-{describe(self.peer)}").start()
        self._ready(outer, self.peer)
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
        except OSError as err:
            log.info("fast path: TLS connection from %s ended: %s", describe(self.peer), err)
            _shutdown(inner)
        finally:
            self._finish()

    def _encrypt(self, stream: TlsStream, inner: socket.socket) -> None:
        """The server's replies, encrypted, to the worker; the server's close ends the TCP connection."""
        buf = memoryview(bytearray(BATCH_BYTES))
        try:
            while True:
                n = inner.recv_into(buf)
                if not n:
                    break
                stream.send_all([buf[:n]])
        except OSError:
            pass  # the worker is gone: the decrypting side sees it too, and tells the server
        finally:
            _shutdown(self._sock)
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running:
                return
        self._sock.close()
        if self._inner is not None:
            self._inner.close()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected, or closed already
        sock.shutdown(socket.SHUT_RDWR)
