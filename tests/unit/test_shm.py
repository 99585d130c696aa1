"""Shared-memory segments and fast-path frames (ps_common.shm, ps_common.fastwire), without a server."""

from __future__ import annotations

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
from pshard.common import fastwire, shm
from pshard.common.errors import InvalidArgumentError
from pshard.common.fastwire import TransportBroken

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


def test_a_peer_maps_the_same_bytes_and_reads_the_creators_nonce(shm_dir):
    mine = shm.Segment.create(shm_dir, 5000, 100)
    theirs = shm.Segment.open(shm_dir, mine.path.name)
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
        assert mine.path.exists()  # the opener does not remove the creator's file by default
        mine.close()
    assert not mine.path.exists()


def test_only_pshard_segment_names_of_the_directory_can_be_opened(shm_dir):
    (shm_dir / "other.seg").write_bytes(b"x" * shm.PAGE)
    for name in ("other.seg", "../etc/passwd", "pshard-w-1-2-zz.seg"):
        with pytest.raises(InvalidArgumentError, match="not a pshard segment name"):
            shm.Segment.open(shm_dir, name)
    with pytest.raises(FileNotFoundError):
        shm.Segment.open(shm_dir, shm.segment_name())


def test_a_file_with_a_bad_header_is_refused(shm_dir):
    name = shm.segment_name()
    (shm_dir / name).write_bytes(b"\0" * 2 * shm.PAGE)
    with pytest.raises(InvalidArgumentError, match="bad header"):
        shm.Segment.open(shm_dir, name)


def test_segment_names_carry_pid_namespace_and_pid():
    name = shm.segment_name()
    assert shm.parse_segment_name(name) == (shm.pid_namespace(), os.getpid())
    assert shm.parse_segment_name("pshard-w-1-2.seg") is None


def test_the_sweep_removes_a_killed_creators_segment_and_spares_live_and_foreign_ones(shm_dir):
    code = ("import sys, time; from pshard.common import shm; "
            f"s = shm.Segment.create({str(shm_dir)!r}, 4096, 4096); "
            "print(s.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        orphan = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        assert orphan.exists()
        assert shm.sweep_orphans(shm_dir) == []  # its creator is alive
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT_S)
    assert orphan.exists()  # SIGKILL runs no clean-up
    live = shm.Segment.create(shm_dir, 4096, 4096)
    foreign = shm_dir / f"pshard-w-{shm.pid_namespace() + 1}-{child.pid}-0123456789abcdef.seg"
    foreign.write_bytes(b"")  # another pid namespace's: its pid means nothing here
    try:
        assert shm.sweep_orphans(shm_dir) == [orphan]
        assert live.path.exists() and foreign.exists()
    finally:
        live.close()


def test_private_regions_have_the_same_shape_and_no_file():
    regions = shm.Segment.private(100, 5000)
    assert regions.path is None and regions.nonce == b""
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
