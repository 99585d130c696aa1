"""HeapTrimmer (ps_server/heap.py): one trim after a burst of large requests, none for small ones."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from pshard.ps_server.heap import (
    MMAP_THRESHOLD_BYTES,
    STREAM_MMAP_THRESHOLD_BYTES,
    TRIM_AFTER_BYTES,
    HeapTrimmer,
    MmapRegime,
    _malloc_trim,
)

pytestmark = pytest.mark.skipif(_malloc_trim() is None, reason="no malloc_trim: not glibc")


def wait_for_trims(trimmer: HeapTrimmer, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while trimmer.trims < count:
        assert time.monotonic() < deadline, f"{trimmer.trims} trims after {timeout_s} s, expected {count}"
        time.sleep(0.005)


def test_a_burst_of_large_requests_is_followed_by_one_trim_once_quiet() -> None:
    trimmer = HeapTrimmer(quiet_s=0.2)
    try:
        trimmer.request_ended(TRIM_AFTER_BYTES - 1)  # small: nothing to give back
        for _ in range(20):
            trimmer.request_ended(TRIM_AFTER_BYTES)
        assert trimmer.trims == 0  # not during the burst
        wait_for_trims(trimmer, 1)
        trimmer.request_ended(4 * TRIM_AFTER_BYTES)
        wait_for_trims(trimmer, 2)
    finally:
        trimmer.close()


def test_sustained_large_traffic_still_trims_every_max_interval() -> None:
    trimmer = HeapTrimmer(quiet_s=0.05, max_interval_s=0.2)
    try:
        deadline = time.monotonic() + 10.0
        while trimmer.trims == 0 and time.monotonic() < deadline:
            trimmer.request_ended(TRIM_AFTER_BYTES)  # never quiet
            time.sleep(0.01)
        assert trimmer.trims >= 1
    finally:
        trimmer.close()


MMAPPED_PROBE = """
import ctypes, ctypes.util, sys
from pshard.ps_server.heap import bound_heap
if sys.argv[1] == "bound":
    assert bound_heap()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))  # by default, freeing a 4 MiB mapping raises glibc's threshold to 4 MiB
chunk = libc.malloc(2 << 20)
print(ctypes.c_size_t.from_address(chunk - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
"""


@pytest.mark.parametrize(("mode", "mmapped"), [("default", 0), ("bound", 2)])
def test_bound_heap_keeps_large_buffers_in_mappings_of_their_own(mode: str, mmapped: int) -> None:
    # In a process of its own: mallopt changes the whole process, and pytest's must stay as it was.
    # The default case shows what the setting is for: a 2 MiB buffer would land in (and fragment) a heap.
    out = subprocess.run([sys.executable, "-c", MMAPPED_PROBE, mode], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == mmapped


FRAME_PROBE = """
import ctypes, ctypes.util, sys
from pshard.common.rpc.options import CHUNK_BYTES, FRAME_SLACK_BYTES
from pshard.ps_server.heap import TRIM_AFTER_BYTES, HeapTrimmer, bound_heap
assert bound_heap()
trimmer = HeapTrimmer()
for kind in sys.argv[1:]:  # requests that ended, in order
    trimmer.request_ended(TRIM_AFTER_BYTES, stream=kind == "stream")
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
chunk = libc.malloc(CHUNK_BYTES + FRAME_SLACK_BYTES)  # a whole Exchange frame
print(ctypes.c_size_t.from_address(chunk - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
trimmer.close()
"""


@pytest.mark.parametrize(("requests", "mmapped"), [((), 2), (("stream",), 0), (("stream", "unary"), 2),
                                                   (("stream", "unary", "stream"), 2)])
def test_frames_come_from_the_heap_only_while_large_requests_are_streams(requests: tuple[str, ...],
                                                                          mmapped: int) -> None:
    # A stream's frames are reused from the heap, not mapped (and page-faulted) anew for every
    # message; a large unary request (a flood's shape) bounds the heap again, and a stream right
    # after it does not undo that.
    out = subprocess.run([sys.executable, "-c", FRAME_PROBE, *requests], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == mmapped


class Recorder:
    def __init__(self) -> None:
        self.thresholds: list[int] = []

    def __call__(self, nbytes: int) -> object:
        self.thresholds.append(nbytes)
        return 1


def test_the_threshold_is_raised_by_streams_and_lowered_by_unary_requests_until_they_stop() -> None:
    clock = [100.0]
    setter = Recorder()
    regime = MmapRegime(setter, hold_s=10.0, now=lambda: clock[0])
    regime.large_request(stream=True)
    regime.large_request(stream=True)  # already raised: mallopt is not called again
    assert setter.thresholds == [STREAM_MMAP_THRESHOLD_BYTES] and regime.streaming
    regime.large_request(stream=False)
    assert setter.thresholds[-1] == MMAP_THRESHOLD_BYTES and not regime.streaming
    clock[0] += 9.9
    regime.large_request(stream=True)  # too soon after the unary request
    assert not regime.streaming
    regime.large_request(stream=False)  # a later unary request starts the wait again
    clock[0] += 9.9
    regime.large_request(stream=True)
    assert not regime.streaming
    clock[0] += 0.1
    regime.large_request(stream=True)
    assert regime.streaming
    assert setter.thresholds == [STREAM_MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_BYTES,
                                 STREAM_MMAP_THRESHOLD_BYTES]


def test_an_unread_refusal_or_a_large_unary_arrival_bounds_the_heap_and_small_requests_do_not() -> None:
    setter = Recorder()
    trimmer = HeapTrimmer(regime=MmapRegime(setter, hold_s=0.0))
    try:
        trimmer.request_ended(TRIM_AFTER_BYTES - 1, stream=True)
        assert setter.thresholds == []
        trimmer.request_ended(TRIM_AFTER_BYTES, stream=True)
        trimmer.unread_refused()
        assert setter.thresholds == [STREAM_MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_BYTES]
        trimmer.regime = MmapRegime(setter, hold_s=0.0)
        trimmer.request_ended(TRIM_AFTER_BYTES, stream=True)
        trimmer.request_started(TRIM_AFTER_BYTES - 1)  # small unary requests are pshard's own
        trimmer.request_started(TRIM_AFTER_BYTES)  # a large one bounds the heap as it arrives
        assert setter.thresholds[2:] == [STREAM_MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_BYTES]
    finally:
        trimmer.close()


def test_without_bound_heap_the_process_threshold_is_left_alone() -> None:
    # pytest's process never ran bound_heap(): its trimmer's regime has nothing to call.
    trimmer = HeapTrimmer()
    try:
        trimmer.request_ended(TRIM_AFTER_BYTES, stream=True)
        assert not trimmer.regime.streaming
    finally:
        trimmer.close()


TOP_PROBE = """
import ctypes, ctypes.util, sys
from pshard.ps_server.heap import TRIM_AFTER_BYTES, HeapTrimmer, bound_heap
assert bound_heap()
trimmer = HeapTrimmer()
for kind in sys.argv[1:]:  # requests that ended, in order
    trimmer.request_ended(TRIM_AFTER_BYTES, stream=kind == "stream")
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
chunks = [libc.malloc(512 << 10) for _ in range(16)]  # 8 MiB of heap (below either mmap threshold)
for chunk in reversed(chunks):
    libc.free(chunk)
print(libc.mallinfo2().keepcost)  # free bytes kept on top of the heap
trimmer.close()
"""


@pytest.mark.parametrize(("requests", "kept"), [((), False), (("stream",), True),
                                                (("stream", "unary"), False)])
def test_a_streaming_heap_keeps_freed_frames_and_a_bounded_one_gives_them_back(requests: tuple[str, ...],
                                                                               kept: bool) -> None:
    # A fixed mmap threshold also fixes glibc's trim threshold at 128 KiB: without raising it, a frame
    # freed on top of the heap went back to the kernel and the next one was faulted in anew.
    out = subprocess.run([sys.executable, "-c", TOP_PROBE, *requests], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert (int(out) >= 8 << 20) is kept, f"{int(out)} bytes kept on top of the heap"


STREAM_BUFFERS_PROBE = """
import ctypes, ctypes.util, sys
from pshard.common.malloc import keep_stream_buffers
if sys.argv[1] == "kept":
    assert keep_stream_buffers() and keep_stream_buffers()  # once per process, idempotent
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
chunk = libc.malloc(8 << 20)  # two frames' worth, before any large buffer was freed
print(ctypes.c_size_t.from_address(chunk - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
"""


@pytest.mark.parametrize(("mode", "mmapped"), [("default", 2), ("kept", 0)])
def test_a_streaming_worker_takes_frames_from_the_heap_from_the_first(mode: str, mmapped: int) -> None:
    # pshard.common.malloc.keep_stream_buffers, which PSClient calls before its first large Exchange:
    # glibc's state after a 32 MiB buffer, at once (its default maps an 8 MiB buffer until one was freed).
    out = subprocess.run([sys.executable, "-c", STREAM_BUFFERS_PROBE, mode], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == mmapped
