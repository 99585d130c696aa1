"""A TCP link on 127.0.0.1 that a test can cut and heal like a cable, while both ends live on.

A forwarder on port 0 relays each connection to `target`. Cut, it moves no byte either way: what is
sent waits in the kernel's buffers, as behind a link that is down, and new connections are accepted
but carry nothing. Healed, the bytes go on where they stopped (TCP delivers them late, never lost),
so a call sent before the cut arrives after it, which is what a partition does to a request in flight.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_POLL_S = 0.05


class CuttableLink:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._up = threading.Event()
        self._up.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, name="link-accept", daemon=True)]
        self._threads[0].start()

    def cut(self) -> None:
        self._up.clear()

    def heal(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed.set()
        self._up.set()
        with self._lock:
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in list(self._threads):
            thread.join(timeout=5.0)

    def __enter__(self) -> CuttableLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            ready, _, _ = select.select([self._listener], [], [], _POLL_S)
            if not ready:
                continue
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self._target, timeout=5.0)
            except OSError:
                continue
            far.settimeout(None)
            with self._lock:
                self._sockets += [near, far]
            for src, dst in ((near, far), (far, near)):
                thread = threading.Thread(target=self._pump, args=(src, dst), name="link-pump", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._closed.is_set():
            if not self._up.wait(_POLL_S):
                continue  # cut: leave the bytes unread, in the kernel's buffers
            try:
                ready, _, _ = select.select([src], [], [], _POLL_S)
                if not ready:
                    continue
                data = src.recv(1 << 16)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                while not self._up.wait(_POLL_S):  # cut between the read and the send: hold them
                    if self._closed.is_set():
                        return
                dst.sendall(data)
            except OSError:
                return
