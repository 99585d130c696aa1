"""Shared-memory segments and fast-path frames (common.wire.shm, common.wire.fastwire), without a server."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.wire import fastwire, shm
from pshard.common.wire.fastwire import TransportBroken

WAIT_S = 10.0


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A private directory on tmpfs when there is one (as in production), else on disk."""
    base = Path(shm.DEFAULT_SHM_DIR)
    if base.is_dir() and os.access(base, os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="pshard-test-", dir=base))
        yield path
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
    else:
        yield tmp_path


def test_regions_are_page_aligned_and_packed_offsets_too():
    assert shm.align(1) == shm.PAGE and shm.align(shm.PAGE) == shm.PAGE and shm.align(0) == 0
    offsets, total = shm.packed([10, shm.PAGE, 0, 3])
    assert offsets == [0, shm.PAGE, 2 * shm.PAGE, 2 * shm.PAGE]
    assert total == 3 * shm.PAGE


def _passed(segment: shm.Segment) -> int:
    """A copy of the creator's descriptor, as the peer gets it over a unix socket."""
    assert segment.fd is not None
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        shm.send_fd(left, b"hello", segment.fd)
        data, fds = shm.recv_with_fds(right, 100)
    assert data == b"hello" and len(fds) == 1
    return fds[0]


def test_a_peer_maps_the_same_bytes_and_reads_the_creators_nonce():
    mine = shm.Segment.create(5000, 100)
    theirs = shm.Segment.adopt(_passed(mine))
    try:
        assert theirs.nonce == mine.nonce and len(mine.nonce) == shm.NONCE_BYTES
        assert (theirs.request_bytes, theirs.reply_bytes) == (2 * shm.PAGE, shm.PAGE)
        for region in (mine.request, mine.reply):
            assert region.ctypes.data % shm.PAGE == 0  # copies at memory speed need page alignment
        mine.request[:4] = [1, 2, 3, 4]
        theirs.reply[-1] = 9
        assert list(theirs.request[:4]) == [1, 2, 3, 4] and mine.reply[-1] == 9
    finally:
        theirs.close()
        mine.close()


def test_nobody_can_shrink_or_grow_a_segment_once_created():
    segment = shm.Segment.create(4096, 4096)
    try:
        assert segment.fd is not None
        size = os.fstat(segment.fd).st_size
        for new_size in (0, shm.PAGE, size + shm.PAGE):
            with pytest.raises(PermissionError):
                os.ftruncate(segment.fd, new_size)
        with pytest.raises(PermissionError):
            os.pwrite(segment.fd, b"x", size)  # a write past the end would grow it
        assert os.fstat(segment.fd).st_size == size
    finally:
        segment.close()


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_only_a_memfd_sealed_against_any_change_of_size_is_adopted(shm_dir):
    sealed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    plain_file = os.open(shm_dir / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain_file, 3 * shm.PAGE)
    for fd in (_memfd(3 * shm.PAGE, 0), _memfd(3 * shm.PAGE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL),
               _memfd(3 * shm.PAGE, fcntl.F_SEAL_GROW), plain_file, os.open("/dev/null", os.O_RDWR)):
        with pytest.raises(InvalidArgumentError, match="not a memfd sealed"):
            shm.Segment.adopt(fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # adopt closed it, refused or not
    for fd in (_memfd(3 * shm.PAGE, sealed), _memfd(100, sealed)):
        with pytest.raises(InvalidArgumentError, match=r"bad header|smaller than its header"):
            shm.Segment.adopt(fd)
    fd = _memfd(3 * shm.PAGE, sealed | fcntl.F_SEAL_WRITE)
    with pytest.raises(InvalidArgumentError, match="cannot be mapped for writing"):
        shm.Segment.adopt(fd)


def test_socket_names_carry_pid_namespace_and_pid():
    name = shm.socket_name()
    assert shm.parse_socket_name(name) == (shm.pid_namespace(), os.getpid())
    assert shm.parse_socket_name("pshard-s-1-2.sock") is None
    assert shm.parse_socket_name("../pshard-s-1-2-0123456789abcdef.sock") is None


def test_the_sweep_removes_a_killed_servers_socket_and_spares_live_and_foreign_ones(shm_dir):
    code = ("import sys, time; from pshard.common.wire import shm; "
            f"s, path = shm.listen({str(shm_dir)!r}); "
            "print(path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        orphan = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        assert orphan.exists()
        assert shm.sweep_orphans(shm_dir) == []  # its creator is alive
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT_S)
    assert orphan.exists()  # SIGKILL runs no clean-up
    live, live_path = shm.listen(shm_dir)
    foreign = shm_dir / f"pshard-s-{shm.pid_namespace() + 1}-{child.pid}-0123456789abcdef.sock"
    foreign.write_bytes(b"")  # another pid namespace's: its pid means nothing here
    try:
        assert shm.sweep_orphans(shm_dir) == [orphan]
        assert live_path.exists() and foreign.exists()
    finally:
        live.close()
        shm.remove(live_path)
    assert not live_path.exists()


def test_a_socket_in_a_directory_too_deep_for_sockaddr_un_still_listens_and_connects(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    listener, path = shm.listen(deep)
    try:
        assert path.parent == deep and path.exists()
        with shm.connect(path, WAIT_S) as client:
            server, _ = listener.accept()
            with server:
                client.sendall(b"ok")
                assert server.recv(2) == b"ok"
    finally:
        listener.close()
        shm.remove(path)
    assert not path.exists()


def test_private_regions_have_the_same_shape_and_no_descriptor():
    regions = shm.Segment.private(100, 5000)
    assert regions.fd is None and regions.nonce == b""
    assert (regions.request_bytes, regions.reply_bytes) == (shm.PAGE, 2 * shm.PAGE)
    regions.reply[:] = 7
    regions.close()
    assert regions.closed and regions.reply.size == 0


# ---- fast-path frames ----

def test_frames_carry_metadata_and_numpy_data_into_preallocated_buffers():
    left, right = socket.socketpair()
    with left, right:
        data = [np.arange(300_000, dtype=np.float32), np.arange(7, dtype=np.int64)]
        sender = threading.Thread(target=fastwire.send_frame, args=(left, fastwire.REQUEST, b"meta", data))
        sender.start()  # bigger than the socket buffer: the send must go in pieces while we read
        kind, meta, data_len = fastwire.recv_frame_head(right)
        assert (kind, meta, data_len) == (fastwire.REQUEST, b"meta", 300_000 * 4 + 7 * 8)
        first, second = np.empty(300_000, np.float32), np.empty(7, np.int64)
        fastwire.recv_into(right, first.view(np.uint8))
        fastwire.recv_into(right, second.view(np.uint8))
        sender.join(WAIT_S)
        np.testing.assert_array_equal(first, data[0])
        np.testing.assert_array_equal(second, data[1])


def test_discard_keeps_the_stream_in_step():
    left, right = socket.socketpair()
    with left, right:
        fastwire.send_frame(left, fastwire.REQUEST, b"", [b"x" * 5000])
        fastwire.send_frame(left, fastwire.REPLY, b"next")
        _, _, data_len = fastwire.recv_frame_head(right)
        fastwire.discard(right, data_len)
        assert fastwire.recv_frame_head(right) == (fastwire.REPLY, b"next", 0)


def test_a_peer_that_closes_or_sends_garbage_breaks_the_path():
    left, right = socket.socketpair()
    with left, right:
        left.sendall(fastwire.encode_header(fastwire.REPLY, 0, 100)[:10])
        left.close()
        with pytest.raises(TransportBroken, match="peer closed"):
            fastwire.recv_frame_head(right)
    with pytest.raises(TransportBroken, match="bad fast-path frame header"):
        fastwire.decode_header(b"HTTP" + bytes(fastwire.HEADER_BYTES - 4))
    with pytest.raises(TransportBroken, match="bad fast-path frame header"):
        fastwire.decode_header(fastwire.encode_header(fastwire.REQUEST, fastwire.MAX_META_BYTES + 1, 0))


def test_the_inbox_hands_out_bytes_read_past_a_header_and_grows_for_big_metadata():
    left, right = socket.socketpair()
    with left, right:
        inbox = fastwire.Inbox(right, size=64)
        data = np.arange(10, dtype=np.float32)
        fastwire.send_frame(left, fastwire.REPLY, b"m" * 10, [data])  # all of it fits one read
        fastwire.send_frame(left, fastwire.REPLY, b"x" * 100)  # metadata bigger than the buffer
        kind, meta, data_len = inbox.frame_head()
        assert (kind, meta, data_len) == (fastwire.REPLY, b"m" * 10, 40)
        got = np.empty(10, np.float32)
        inbox.read_into(got.view(np.uint8))
        np.testing.assert_array_equal(got, data)
        assert inbox.frame_head() == (fastwire.REPLY, b"x" * 100, 0)
        left.close()
        with pytest.raises(TransportBroken, match="peer closed"):
            inbox.frame_head()
