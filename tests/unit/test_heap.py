"""HeapTrimmer (ps_server/heap.py): one trim after a burst of large requests, none for small ones."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from pshard.ps_server.heap import TRIM_AFTER_BYTES, HeapTrimmer, _malloc_trim

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
from pshard.common.rpc import CHUNK_BYTES, FRAME_SLACK_BYTES
from pshard.ps_server.heap import bound_heap
if sys.argv[1] in ("bound", "frame"):
    assert bound_heap()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))  # by default, freeing a 16 MiB mapping raises glibc's threshold to 16 MiB
# Above bound_heap's threshold; or a whole Exchange frame, which must stay below it.
chunk = libc.malloc(CHUNK_BYTES + FRAME_SLACK_BYTES if sys.argv[1] == "frame" else 8 << 20)
print(ctypes.c_size_t.from_address(chunk - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
"""


@pytest.mark.parametrize(("mode", "mmapped"), [("default", 0), ("bound", 2), ("frame", 0)])
def test_bound_heap_keeps_large_buffers_in_mappings_of_their_own(mode: str, mmapped: int) -> None:
    # In a process of its own: mallopt changes the whole process, and pytest's must stay as it was.
    # The default case shows what the setting is for: an 8 MiB buffer would land in (and fragment) a heap.
    # The frame case why the threshold is not lower: a stream's frames are reused from the heap, not
    # mapped (and page-faulted) anew for every message.
    out = subprocess.run([sys.executable, "-c", MMAPPED_PROBE, mode], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == mmapped
