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

- A fixed mmap threshold of 1 MiB. By default glibc raises its threshold to the size of every mmapped
  chunk it frees (up to 32 MiB), so after the first few 4 MiB requests every later one is carved from
  a heap and leaves a hole there. With the threshold fixed, a large buffer is its own mapping and its
  pages go back to the kernel the moment it is freed.
- At most two arenas. gRPC's threads each get an arena of their own by default (8 per core), and each
  keeps its own free memory.

Measured with tests/e2e/test_flood.py (16 clients, 4 MiB requests, 2 cores): peak RSS 411 MiB over a
63 MiB baseline without them, 240 MiB with them.

A mapping per buffer has a price, though: its pages are faulted in anew every time, ~1,000 faults
per 4 MiB. Exchange streams allocate and free a frame's worth by the hundred every step (the bytes
gRPC hands to Python, our encoded replies, gRPC's copy of them), and at 1 MiB that was a quarter of
the servers' CPU in the 2x2 gRPC dense bench (0.36-0.44 s per step against 0.29-0.31 s with frames
from the heap). So `MmapRegime` raises the threshold just above a frame while large bytes come only
on streams, and lowers it back at the first large unary request or unread refusal (a flood's shape:
pshard's own client sends unary requests under 1 MiB); the flood test measured 243-435 MiB peaks
with the raised threshold always on, against 277-339 MiB at 1 MiB. A fixed mmap threshold also
fixes glibc's trim threshold at 128 KiB, so a freed frame on top of a heap went back to the kernel
and the next one was faulted in anew just the same (12-18k faults per dense step on the two
servers): the streaming regime raises the trim threshold with the mmap threshold, and the bounded
one brings both back (pshard.common.malloc).

Elsewhere than glibc there is nothing to call and both do nothing.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

from pshard.common.malloc import (
    DEFAULT_TRIM_THRESHOLD_BYTES,
    M_ARENA_MAX,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    STREAMING_TRIM_THRESHOLD_BYTES,
    libc,
    mallopt,
)
from pshard.common.rpc.options import CHUNK_BYTES, FRAME_SLACK_BYTES

# Requests smaller than this never trigger a trim: they leave too little behind to matter.
TRIM_AFTER_BYTES = 1 << 20
MMAP_THRESHOLD_BYTES = 1 << 20
# While only streams bring large bytes: above a whole Exchange frame (a chunk and its header).
STREAM_MMAP_THRESHOLD_BYTES = CHUNK_BYTES + FRAME_SLACK_BYTES + (1 << 20)
# The raised threshold comes back only this long after the last large unary request.
STREAM_AFTER_UNARY_S = 10.0
ARENA_MAX = 2
# The threshold setter once bound_heap() ran; None until then (tests, in-process servers): the
# process's malloc is left as it is.
_threshold_setter: Callable[[int], object] | None = None


def bound_heap(mmap_threshold: int = MMAP_THRESHOLD_BYTES, arena_max: int = ARENA_MAX) -> bool:
    """Keep freed large buffers out of the heaps (see the module docstring); False off glibc.

    Call it early: arenas already created stay, and the threshold counts from then on.
    """
    set_option = mallopt()
    if set_option is None:
        return False
    if not (set_option(M_MMAP_THRESHOLD, mmap_threshold) and set_option(M_ARENA_MAX, arena_max)):
        return False

    def set_threshold(nbytes: int) -> object:
        # The trim threshold goes with it: a streaming heap keeps a few frames' worth on top (else
        # every freed frame there is given back and the next one faulted in), a bounded one none.
        streaming = nbytes > MMAP_THRESHOLD_BYTES
        trim = STREAMING_TRIM_THRESHOLD_BYTES if streaming else DEFAULT_TRIM_THRESHOLD_BYTES
        set_option(M_TRIM_THRESHOLD, trim)
        return set_option(M_MMAP_THRESHOLD, nbytes)

    global _threshold_setter
    _threshold_setter = set_threshold
    return True


class MmapRegime:
    """Which mmap threshold the process runs with: streaming (frames from the heaps) or bounded.

    `large_request(stream)` for each request of at least TRIM_AFTER_BYTES: a unary one (as it arrives,
    and again as it ends) lowers the threshold to MMAP_THRESHOLD_BYTES at once; a stream, as it ends,
    raises it to STREAM_MMAP_THRESHOLD_BYTES once `hold_s` passed since the last unary one. Glibc
    reads the threshold at each allocation, and a chunk is freed the way it was allocated, so the
    switch is safe at any moment.
    """

    def __init__(self, set_threshold: Callable[[int], object] | None, hold_s: float = STREAM_AFTER_UNARY_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._set = set_threshold
        self._hold_s = hold_s
        self._now = now
        self.streaming = False  # bound_heap() starts the process bounded
        self._unary_at = -hold_s

    def large_request(self, stream: bool) -> None:
        if self._set is None:
            return
        if not stream:
            self._unary_at = self._now()
            if self.streaming:
                self.streaming = False
                self._set(MMAP_THRESHOLD_BYTES)
        elif not self.streaming and self._now() - self._unary_at >= self._hold_s:
            self.streaming = True
            self._set(STREAM_MMAP_THRESHOLD_BYTES)


def _malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(libc(), "malloc_trim", None)
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
                 now: Callable[[], float] = time.monotonic, regime: MmapRegime | None = None) -> None:
        """`regime`: told of every large request (default: one switching this process's threshold
        if bound_heap() ran, else doing nothing)."""
        self.regime = regime if regime is not None else MmapRegime(_threshold_setter, now=now)
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

    def request_started(self, nbytes: int) -> None:
        """A unary request of `nbytes` arrived: a large one bounds the heap before its handler (and the
        requests queued behind it) allocate more (see MmapRegime)."""
        if nbytes >= TRIM_AFTER_BYTES:
            self.regime.large_request(stream=False)

    def request_ended(self, nbytes: int, stream: bool = False) -> None:
        """`stream`: the request was an Exchange stream (see MmapRegime)."""
        if nbytes >= TRIM_AFTER_BYTES:
            self._wake.set()
            self.regime.large_request(stream)

    def unread_refused(self) -> None:
        """A request was refused unread (ps_server.transport.tarpit): gRPC's core had buffered some of
        its bytes, how many is not known here, in small chunks that stay in the heap until a trim."""
        self._wake.set()
        self.regime.large_request(stream=False)

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
