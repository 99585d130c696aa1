"""The fast paths against a hostile peer: a worker cannot crash the server through its shared-memory
segment, and nobody without the session's secret gets onto the shm or TCP path. The store stays
unchanged every time."""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pshard.client import fast_session as fastpath
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.wire import fastwire, shm
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

WAIT_S = 10.0
ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
PARAMS = {"small": np.zeros(10, np.float32), "big": np.zeros((256, 1024), np.float32)}


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = Path(shm.DEFAULT_SHM_DIR)
    parent = base if base.is_dir() and os.access(base, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="pshard-test-", dir=parent))
    yield path
    leftovers = sorted(p.name for p in path.iterdir())
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    assert leftovers == [], "files left behind"


_create = shm.Segment.create  # the real one, which the tests below replace in the worker


def _grads(value: float) -> dict[str, np.ndarray]:
    return {k: np.full(v.shape, value, np.float32) for k, v in PARAMS.items()}


def _weights(wire, server) -> dict[str, tuple[bytes, int]]:
    return wire.read(server, PARAMS)


def _unsealed(request_bytes: int, reply_bytes: int) -> shm.Segment:
    """What a hostile worker offers: a well-formed segment whose size it can still change."""
    real = _create(request_bytes, reply_bytes)
    assert real.fd is not None
    size = os.fstat(real.fd).st_size
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.pwrite(fd, os.pread(real.fd, shm.PAGE, 0), 0)  # its header, nonce included
    hostile = shm.Segment(mmap.mmap(fd, size), real.request_bytes, real.reply_bytes, real.nonce, fd)
    real.close()
    return hostile


# ---- the segment cannot be shrunk under the server ----

def test_a_worker_that_keeps_its_segments_descriptor_cannot_resize_it_mid_session(
        shm_dir, start_server, new_client, wire, monkeypatch):
    kept: list[int] = []

    def create_and_keep(request_bytes: int, reply_bytes: int) -> shm.Segment:
        segment = _create(request_bytes, reply_bytes)
        kept.append(os.dup(segment.fd))  # type: ignore[arg-type]
        return segment

    monkeypatch.setattr(fastpath.Segment, "create", staticmethod(create_and_keep))
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    c = new_client([server], "w0", transport="shm", shm_dir=str(shm_dir))
    c.declare(PARAMS, ASYNC)
    c.push_pull(_grads(1.0), 0)
    assert c.transports == ["shm"] and len(kept) == 1
    before = _weights(wire, server)
    size = os.fstat(kept[0]).st_size
    try:
        for new_size in (0, shm.PAGE, size // 2, 2 * size):  # what used to SIGBUS the server
            with pytest.raises(PermissionError):
                os.ftruncate(kept[0], new_size)
        assert os.fstat(kept[0]).st_size == size
    finally:
        os.close(kept[0])
    assert _weights(wire, server) == before  # the attempts changed nothing
    weights = c.push_pull(_grads(1.0), 1)  # the same session goes on serving
    assert c.transports == ["shm"]
    np.testing.assert_array_equal(weights["big"], np.full((256, 1024), -2.0, np.float32))


def test_a_segment_the_worker_could_still_shrink_is_refused_and_the_worker_falls_back(
        shm_dir, start_server, new_client, wire, monkeypatch):
    kept: list[int] = []

    def create_unsealed(request_bytes: int, reply_bytes: int) -> shm.Segment:
        segment = _unsealed(request_bytes, reply_bytes)
        kept.append(os.dup(segment.fd))  # type: ignore[arg-type]
        return segment

    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    c = new_client([server], "w0", shm_dir=str(shm_dir))  # auto: shm first, then tcp
    c.declare(PARAMS, ASYNC)
    before = _weights(wire, server)
    monkeypatch.setattr(fastpath.Segment, "create", staticmethod(create_unsealed))
    weights = c.push_pull(_grads(1.0), 0)
    assert len(kept) == 1 and c.transports == ["tcp"]  # the server would not map it
    try:
        os.ftruncate(kept[0], 0)  # what would have been a SIGBUS: the server never mapped it
    finally:
        os.close(kept[0])
    np.testing.assert_array_equal(weights["small"], np.full(10, -1.0, np.float32))
    weights = c.push_pull(_grads(1.0), 1)
    np.testing.assert_array_equal(weights["small"], np.full(10, -2.0, np.float32))
    assert _weights(wire, server) != before and wire.stats(server).worker_transports == {"w0": "tcp"}


def test_a_shm_hello_with_an_unsealed_or_missing_descriptor_is_refused(shm_dir, start_server, new_client,
                                                                      wire):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    c = new_client([server], "w0", transport="grpc")
    c.declare(PARAMS, ASYNC)
    before = _weights(wire, server)
    request = pb.OpenTransportRequest(worker_id="w0", kind=pb.TRANSPORT_KIND_SHM, request_bytes=4096,
                                      reply_bytes=4096)
    for offer in ("unsealed", "none", "two"):
        reply = wire.stub(server).OpenTransport(request, timeout=WAIT_S)
        hello = pb.TransportHello(session=reply.session, secret=reply.secret).SerializeToString()
        frame = fastwire.encode_header(fastwire.HELLO, len(hello), 0) + hello
        segment = _unsealed(4096, 4096) if offer == "unsealed" else shm.Segment.create(4096, 4096)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(WAIT_S)
            sock.connect(str(shm_dir / reply.socket))
            if offer == "none":
                sock.sendall(frame)
            elif offer == "two":
                sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        np.array([segment.fd, segment.fd], np.int32).tobytes())])
            else:
                shm.send_fd(sock, frame, segment.fd)  # type: ignore[arg-type]
            assert sock.recv(1) == b""  # closed without the nonce
        if offer == "unsealed":
            os.ftruncate(segment.fd, 0)  # type: ignore[arg-type]  # the server never mapped it
        segment.close()
    assert _weights(wire, server) == before and not wire.stats(server).worker_transports


# ---- no session secret, no path ----

def _refused_over_tcp(port: int, hello: bytes) -> bool:
    """Whether the server closed a TCP fast-path connection whose first frame is `hello`, without
    answering the request that follows it."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        fastwire.send_frame(sock, fastwire.HELLO, hello)
        fastwire.send_frame(sock, fastwire.REQUEST, pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL,
                                                                      ).SerializeToString())
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:  # closed with our unread request in its buffer
            return True


def _refused_over_shm(path: Path, hello: bytes) -> bool:
    """Whether the server closed a shm hand-off that offers a valid sealed segment with `hello`."""
    segment = shm.Segment.create(4096, 4096)
    try:
        with shm.connect(path, WAIT_S) as sock:
            shm.send_fd(sock, fastwire.encode_header(fastwire.HELLO, len(hello), 0) + hello,
                        segment.fd)  # type: ignore[arg-type]
            return sock.recv(1) == b""
    finally:
        segment.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_peer_without_the_session_secret_is_refused_and_changes_nothing(shm_dir, start_server, new_client,
                                                                          wire, kind):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    c = new_client([server], "w0", transport="grpc")
    c.declare(PARAMS, ASYNC)
    c.push_pull(_grads(1.0), 0)
    before = _weights(wire, server)
    kinds = {"shm": pb.TRANSPORT_KIND_SHM, "tcp": pb.TRANSPORT_KIND_TCP}
    sessions = {k: wire.stub(server).OpenTransport(pb.OpenTransportRequest(
        worker_id="w0", kind=v, request_bytes=4096, reply_bytes=4096), timeout=WAIT_S)
        for k, v in kinds.items()}
    mine, other = sessions[kind], sessions["tcp" if kind == "shm" else "shm"]
    socket_path = shm_dir / sessions["shm"].socket

    def refused(hello: bytes) -> bool:
        return (_refused_over_shm(socket_path, hello) if kind == "shm"
                else _refused_over_tcp(server.running.fast.port, hello))

    def hello(session: int, secret: bytes) -> bytes:
        return pb.TransportHello(session=session, secret=secret).SerializeToString()

    wrong = bytes(b ^ 1 for b in mine.secret)
    attempts = (hello(mine.session, b""), hello(mine.session, wrong), hello(mine.session, mine.secret[:16]),
                hello(0, mine.secret), hello(other.session, other.secret), b"", b"\xff garbage")
    for attempt in attempts:
        assert refused(attempt)
    assert not wire.stats(server).worker_transports
    assert _weights(wire, server) == before
    # The session itself was not spent by the strangers: its worker still connects, once.
    assert not refused(hello(mine.session, mine.secret))
    assert refused(hello(mine.session, mine.secret))
    assert _weights(wire, server) == before
