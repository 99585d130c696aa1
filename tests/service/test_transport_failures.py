"""Fast paths that break, are refused, or lose a peer: every step still completes (over gRPC),
nothing is applied twice, no stranger gets in, and no shared-memory segment is left behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import PSError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.wire import fastwire, shm
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

WAIT_S = 10.0
SYNC = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0))
ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
PARAMS = {"small": np.zeros(10, np.float32), "big": np.zeros((512, 1024), np.float32)}


def _tmpfs_dir() -> Path:
    base = Path(shm.DEFAULT_SHM_DIR)
    if base.is_dir() and os.access(base, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="pshard-test-", dir=base))
    return Path(tempfile.mkdtemp(prefix="pshard-test-"))


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """Set up first (the first argument of each test), so it is checked after clients and servers closed."""
    path = _tmpfs_dir()
    yield path
    leftovers = sorted(p.name for p in path.iterdir())
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    assert leftovers == [], "segments left behind"


def _until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.01)


def _grads(value: float) -> dict[str, np.ndarray]:
    return {k: np.full(v.shape, value, np.float32) for k, v in PARAMS.items()}


# ---- a path cut mid-step ----

@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_path_cut_while_the_pull_waits_completes_over_grpc_and_applies_the_push_once(
        shm_dir, start_server, new_client, wire, transport):
    server = start_server(ServerSettings(static_quorum={"w0": 0, "w1": 0}, shm_dir=str(shm_dir)))
    w0, w1 = (new_client([server], w, transport=transport, shm_dir=str(shm_dir)) for w in ("w0", "w1"))
    for w in (w0, w1):
        w.declare(PARAMS, SYNC)
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(w0.push_pull, _grads(1.0), 0)
        wire.wait_stats(server, lambda s: s.pulls_waiting == 1, "w0's push landed, its pull waits")
        assert w0.transports == [transport]
        assert server.running.fast.disconnect("w0") == 1  # the socket resets under the waiting call
        # w0 resends the whole step over gRPC: its push is a duplicate now, and is dropped.
        wire.wait_stats(server, lambda s: s.pushes_dropped == 2, "w0's resent push dropped")
        w1.push_pull(_grads(3.0), 0)
        weights = step.result(timeout=WAIT_S)
    assert (w0.last_result.applied, w0.last_result.dropped) == (0, 2)
    for key, value in weights.items():
        np.testing.assert_array_equal(value, np.full(PARAMS[key].shape, -2.0, np.float32))
    assert w0.transports == ["grpc"] and w1.transports == [transport]
    stats = wire.stats(server)
    assert stats.pushes_applied == 4 and stats.worker_transports == {"w1": transport}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_path_cut_between_steps_sends_the_next_step_over_grpc(shm_dir, start_server, new_client, wire,
                                                                transport):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    w0 = new_client([server], "w0", transport=transport, shm_dir=str(shm_dir))
    w0.declare(PARAMS, ASYNC)
    w0.push_pull(_grads(1.0), 0)
    assert server.running.fast.disconnect("w0") == 1
    _until(lambda: not wire.stats(server).worker_transports, "the server ended the session")
    weights = w0.push_pull(_grads(1.0), 1)  # the dead socket is found out by this step
    assert (w0.last_result.applied, w0.last_result.dropped) == (2, 0)
    np.testing.assert_array_equal(weights["big"], np.full(PARAMS["big"].shape, -2.0, np.float32))
    assert w0.transports == ["grpc"]


# ---- negotiation ----

def test_without_a_shared_directory_auto_takes_tcp_and_shm_alone_takes_grpc(shm_dir, start_server, new_client,
                                                                             wire, tmp_path):
    server = start_server(ServerSettings(shm_dir=str(tmp_path)))  # not the workers' directory
    auto = new_client([server], "auto", shm_dir=str(shm_dir))
    only_shm = new_client([server], "shm", transport="shm", shm_dir=str(shm_dir))
    for c in (auto, only_shm):
        c.declare(PARAMS, ASYNC)
        c.push_pull(_grads(1.0), 0)
    assert auto.transports == ["tcp"] and only_shm.transports == ["grpc"]
    assert wire.stats(server).worker_transports == {"auto": "tcp"}
    assert list(shm_dir.iterdir()) == []  # the refused segment went at once


@pytest.mark.parametrize(("offered", "expected"), [("grpc", "grpc"), ("tcp", "tcp"), ("shm", "shm")])
def test_auto_takes_the_best_transport_the_server_offers(shm_dir, start_server, new_client, offered,
                                                         expected):
    server = start_server(ServerSettings(transport=offered, shm_dir=str(shm_dir)))
    c = new_client([server], "w0", shm_dir=str(shm_dir))
    c.declare(PARAMS, ASYNC)
    weights = c.push_pull(_grads(1.0), 0)
    assert c.transports == [expected]
    np.testing.assert_array_equal(weights["small"], np.full(10, -1.0, np.float32))


def test_a_stranger_without_the_session_secret_is_disconnected(shm_dir, start_server, new_client):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    c = new_client([server], "w0", transport="tcp")
    c.declare(PARAMS, ASYNC)
    c.push_pull(_grads(1.0), 0)  # a real session exists; its secret is not ours
    for hello in (pb.TransportHello(session=1, secret=b"guess").SerializeToString(), b"garbage"):
        with socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as sock:
            fastwire.send_frame(sock, fastwire.HELLO, hello)
            request = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL).SerializeToString()
            fastwire.send_frame(sock, fastwire.REQUEST, request)
            try:
                answer = sock.recv(1)
            except ConnectionResetError:  # closed with our unread request in its buffer
                answer = b""
            assert answer == b""  # closed without an answer
    weights = c.push_pull(_grads(1.0), 1)
    np.testing.assert_array_equal(weights["small"], np.full(10, -2.0, np.float32))
    assert c.transports == ["tcp"]


# ---- peers killed: nothing leaks ----

def _mapped_segments() -> int:
    """Segments this process maps (its in-process servers' and clients'): memfds have no file."""
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{shm.MEMFD_NAME}" in line for line in maps)


def _worker_process(address: str, shm_dir: Path) -> subprocess.Popen[str]:
    code = (
        "import numpy as np\n"
        "from pshard.client.ps_client import PSClient\n"
        "from pshard.common.job import JobConfig, OptimizerConfig\n"
        f"c = PSClient([{address!r}], 'doomed', transport='shm', shm_dir={str(shm_dir)!r}, timeout_s=60)\n"
        "c.declare({'a': np.zeros(1000, np.float32)}, JobConfig(mode='sync', "
        "optimizer=OptimizerConfig(name='sgd', lr=1.0)))\n"
        "c.push_pull({'a': np.ones(1000, np.float32)}, 0)\n")
    return subprocess.Popen([sys.executable, "-c", code], text=True)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_workers_segment_is_unmapped_once_the_server_notices(shm_dir, start_server, wire, sig):
    before = _mapped_segments()
    server = start_server(ServerSettings(static_quorum={"doomed": 0, "other": 0}, shm_dir=str(shm_dir)))
    worker = _worker_process(server.address, shm_dir)
    try:
        wire.wait_stats(server, lambda s: s.pulls_waiting == 1 and s.worker_transports == {"doomed": "shm"},
                        "the worker's step waits over shm")
        assert _mapped_segments() > before
        assert len(list(shm_dir.iterdir())) == 1  # the server's hand-off socket; segments have no file
    finally:
        worker.send_signal(sig)  # a bare PSClient process: SIGTERM kills it without clean-up too
        worker.wait(WAIT_S)
    _until(lambda: _mapped_segments() == before, "the server unmapped the dead worker's segment")
    assert not wire.stats(server).worker_transports


def test_a_restarted_server_sweeps_the_sockets_its_dead_peers_left(shm_dir, start_server):
    code = ("import time; from pshard.common.wire import shm; "
            f"s, path = shm.listen({str(shm_dir)!r}); "
            "print(path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        orphan = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT_S)
    assert orphan.exists()  # both ends died: nobody was left to remove it
    start_server(ServerSettings(shm_dir=str(shm_dir)))
    assert not orphan.exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_whose_server_is_killed_mid_step_unmaps_its_segment(shm_dir, new_client, sig):
    before = _mapped_segments()
    server = subprocess.Popen(
        [sys.executable, "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--shm-dir", str(shm_dir),
         "--workers", "w0,w1", "--no-scheduler"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        port = int(re.search(r"listening on port (\d+)", line).group(1))  # type: ignore[union-attr]
        c = new_client([f"127.0.0.1:{port}"], "w0", transport="shm", shm_dir=str(shm_dir), timeout_s=2.0,
                       retry_budget_s=1.0)
        c.declare(PARAMS, SYNC)
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(c.push_pull, _grads(1.0), 0)  # waits for w1, who never comes
            _until(lambda: c.transports == ["shm"] and len(list(shm_dir.iterdir())) == 1, "step under way")
            server.send_signal(sig)  # SIGTERM: a graceful stop, which closes the session itself
            with pytest.raises(PSError):
                step.result(timeout=3 * WAIT_S)
        assert c.transports == ["grpc"]
        assert _mapped_segments() == before  # the survivor unmapped its segment at once
    finally:
        server.kill()
        server.wait(WAIT_S)
    if sig == signal.SIGKILL:  # a dead server's socket stays until its successor sweeps it
        left = [p.name for p in shm_dir.iterdir()]
        assert [p.name for p in shm.sweep_orphans(shm_dir)] == left
    assert list(shm_dir.iterdir()) == []


def test_a_worker_opening_sessions_in_a_loop_keeps_only_its_newest_few(shm_dir, start_server, new_client,
                                                                       wire):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    c = new_client([server], "w0", transport="tcp")
    c.declare(PARAMS, ASYNC)
    c.push_pull(_grads(1.0), 0)  # its session is connected
    request = pb.OpenTransportRequest(worker_id="w0", kind=pb.TRANSPORT_KIND_TCP, request_bytes=4096,
                                      reply_bytes=4096)
    for _ in range(4):
        wire.stub(server).OpenTransport(request, timeout=WAIT_S)
    _until(lambda: not wire.stats(server).worker_transports, "the oldest (connected) session was closed")
    weights = c.push_pull(_grads(1.0), 1)  # the worker finds its path closed and carries on over gRPC
    np.testing.assert_array_equal(weights["small"], np.full(10, -2.0, np.float32))
    assert c.transports == ["grpc"]
