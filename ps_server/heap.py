"""Giving freed request memory back to the operating system (glibc), so RSS returns after a burst.

A burst of large requests leaves glibc's heaps full of free chunks: gRPC reads a message in many
small buffers, each thread allocates from its own arena, and glibc hands memory back only from the
top of a heap. Measured on a flood of 4 MiB requests, the server kept ~2 GiB of free memory for
good. `malloc_trim(0)` returns every free page of every arena (madvise), so the server calls it once
a burst of large requests has ended, on a thread of its own (ctypes releases the GIL).

A trim holds glibc's arena locks while it walks the heaps, so every allocation of the event loop
waits for it: trimming every half second during a flood raised a small request's p99 from 19 to
44 ms. Hence the trim waits for a quiet moment (no large request ended for `quiet_s`), and under
sustained large traffic happens at most every `max_interval_s`.

Trimming alone is late: during a flood the heaps grow before any quiet moment comes. Two glibc
settings keep them from growing in the first place (`bound_heap`, called once at server start):

- A fixed mmap threshold just above an Exchange frame (a 4 MiB chunk and its header: 5 MiB). By
  default glibc raises its threshold to the size of every mmapped chunk it frees (up to 32 MiB), so
  after the first few large requests every later one is carved from a heap and leaves a hole there.
  With the threshold fixed, a larger buffer is its own mapping and its pages go back to the kernel
  the moment it is freed. Not lower: a stream's frames are allocated and freed by the hundred every
  step (gRPC's copy, the bytes handed to Python, our encoded replies), and a mapping costs ~1,000
  page faults per 4 MiB each time. At a 1 MiB threshold that was a quarter of the servers' CPU in
  the 2x2 gRPC dense bench (0.36-0.44 s per step against 0.29-0.31 s at 5 MiB, interleaved runs).
- At most two arenas. gRPC's threads each get an arena of their own by default (8 per core), and each
  keeps its own free memory.

Measured with tests/e2e/test_flood.py (16 clients, 4 MiB requests, 2 cores): peak RSS 411 MiB over a
63 MiB baseline without them, 240 MiB with a 1 MiB threshold, 251-263 MiB with 5 MiB.

Elsewhere than glibc there is nothing to call and both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

from pshard.common.rpc import CHUNK_BYTES, FRAME_SLACK_BYTES

# Requests smaller than this never trigger a trim: they leave too little behind to matter.
TRIM_AFTER_BYTES = 1 << 20
# mallopt(3) parameters (malloc.h); the values are glibc's ABI.
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = CHUNK_BYTES + FRAME_SLACK_BYTES + (1 << 20)  # see the module docstring
ARENA_MAX = 2


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def bound_heap(mmap_threshold: int = MMAP_THRESHOLD_BYTES, arena_max: int = ARENA_MAX) -> bool:
    """Keep freed large buffers out of the heaps (see the module docstring); False off glibc.

    Call it early: arenas already created stay, and the threshold counts from then on.
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on error.
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_ARENA_MAX, arena_max))


def _malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


class HeapTrimmer:
    """`request_ended(nbytes)` after each request; a thread of its own trims after large ones.

    The last large request of a burst is always followed by a trim, `quiet_s` later, so RSS comes
    back without a later request to trigger it.
    """

    def __init__(self, quiet_s: float = 0.5, max_interval_s: float = 10.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._quiet_s = quiet_s
        self._max_interval_s = max_interval_s
        self._now = now
        self._trim = _malloc_trim()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self.trims = 0
        self._thread: threading.Thread | None = None
        if self._trim is not None:
            self._thread = threading.Thread(target=self._loop, name="ps-heap-trim", daemon=True)
            self._thread.start()

    def request_ended(self, nbytes: int) -> None:
        if nbytes >= TRIM_AFTER_BYTES:
            self._wake.set()

    def unread_refused(self) -> None:
        """A request was refused unread (ps_server.tarpit): gRPC's core had buffered some of its bytes,
        how many is not known here, in small chunks that stay in the heap until a trim."""
        self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        assert self._trim is not None
        while True:
            self._wake.wait()
            started = self._now()
            while not self._closed.is_set():  # until quiet, or too long since the first wake-up
                self._wake.clear()
                if self._closed.wait(self._quiet_s):
                    return
                if not self._wake.is_set() or self._now() - started > self._max_interval_s:
                    break
            if self._closed.is_set():
                return
            self._trim(0)
            self.trims += 1
