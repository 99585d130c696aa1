"""TLS ceilings: one Python stream between two processes on 127.0.0.1, in clear, over an `ssl.SSLSocket`,
and over the fast path's `TlsStream` (common/wire/tls_stream.py), with the fast path's certificates (a
throw-away CA from `pshard certs`). What the raw TCP path with TLS is measured against (issue 24): where
the TLS stream reaches the clear one, the cipher and the copies are not the limit, and a gap between
W1 with TLS and W1 in clear lies in the servers' event loops.

    python -m bench.tls_ceiling [--mb 400] [--chunk-mb 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import sys
import time
from pathlib import Path

from bench.common import MB, emit
from bench.tls import make_pki

MODES = ("clear", "sslsocket", "tlsstream")


def _context(pki: str, server: bool) -> ssl.SSLContext:
    from pshard.common.security.credentials import SecurityConfig

    name, role = ("ps-0", "ps") if server else ("worker-0", "worker")
    security = SecurityConfig(*(Path(pki) / f for f in (f"{name}.pem", f"{name}-key.pem", "ca.pem")),
                              role=role, node_id=name)
    return security.server_ssl_context() if server else security.client_ssl_context()


def _wrap(sock: socket.socket, mode: str, pki: str, server: bool) -> object:
    from pshard.common.wire.fastwire import tune
    from pshard.common.wire.tls_stream import TlsStream

    tune(sock)
    if mode == "sslsocket":
        return _context(pki, server).wrap_socket(sock, server_side=server,
                                                 server_hostname=None if server else "127.0.0.1")
    if mode == "tlsstream":
        return TlsStream.connect(sock, _context(pki, server), None if server else "127.0.0.1")
    return sock


def stream(mode: str, pki: str, total_bytes: int, chunk_bytes: int) -> dict[str, object]:
    """MB/s of `total_bytes` sent in `chunk_bytes` writes by this process, read by a forked one."""
    from pshard.common.wire.fastwire import recv_into, send_frame

    listener = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:  # the receiver
        try:
            conn = _wrap(listener.accept()[0], mode, pki, server=True)
            buf = memoryview(bytearray(chunk_bytes))
            for _ in range(total_bytes // chunk_bytes):
                recv_into(conn, buf)  # type: ignore[arg-type]
            send_frame(conn, 1, b"")  # type: ignore[arg-type]
        finally:
            os._exit(0)
    sock = _wrap(socket.create_connection(listener.getsockname()), mode, pki, server=False)
    data = memoryview(bytearray(os.urandom(chunk_bytes)))
    start = time.perf_counter()
    for _ in range(total_bytes // chunk_bytes):
        _send(sock, data)
    recv_into(sock, bytearray(20))  # type: ignore[arg-type]  # the receiver's frame: all read
    elapsed = time.perf_counter() - start
    os.waitpid(pid, 0)
    cipher = sock.cipher() if mode != "clear" else None  # type: ignore[attr-defined]
    return {"mode": mode, "mb_per_s": round(total_bytes / MB / elapsed, 1),
            "cipher": cipher[0] if cipher else None}


def _send(sock: object, data: memoryview) -> None:
    from pshard.common.wire.tls_stream import TlsStream

    if isinstance(sock, TlsStream):
        sock.send_all([data])
    else:
        sock.sendall(data)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tls_ceiling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mb", type=int, default=400, help="bytes sent per mode, MB (default 400)")
    p.add_argument("--chunk-mb", type=int, default=8, help="bytes per write, MB (default 8)")
    p.add_argument("--only", default=",".join(MODES), help=f"modes (comma list of {','.join(MODES)})")
    args = p.parse_args(argv)
    pki = str(make_pki(1))
    chunk = args.chunk_mb * MB
    total = max(1, args.mb * MB // chunk) * chunk
    for mode in args.only.split(","):
        emit("ceiling_tls_single_stream", **stream(mode, pki, total, chunk))
    return 0


if __name__ == "__main__":
    sys.exit(main())
