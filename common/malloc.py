"""glibc malloc settings for processes that stream 4 MiB gRPC messages (servers and workers).

Every Exchange frame is a fresh 4 MiB buffer several times over (the bytes gRPC hands to Python, the
frames we encode, gRPC's own copy of them). Whether such a buffer costs ~1,000 page faults depends on
two glibc settings:

- the mmap threshold: above it a buffer is a mapping of its own, faulted in anew every time;
- the trim threshold: once the free memory at the top of a heap exceeds it, free() gives it back to the
  kernel, so the next buffer carved there is faulted in anew too.

By default glibc raises both as it sees large buffers freed (the mmap threshold to the buffer's size,
up to 32 MiB, the trim threshold to twice that), but setting either by hand (mallopt) fixes both, and
the trim threshold then stays at 128 KiB. Measured on the 2x2 gRPC dense bench (issue 8): with the
servers' fixed thresholds and the workers' defaults, servers took 12-18k and workers 26-30k page faults
per step; with the trim threshold above a few frames, about 2k and 300, and the step's CPU fell to that
of the plain grpcio echo (ceiling (b)).

Elsewhere than glibc there is nothing to call and every function here does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable

# mallopt(3) parameters (malloc.h); the values are glibc's ABI.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# glibc's own default trim threshold, for a process that wants its heaps given back at once.
DEFAULT_TRIM_THRESHOLD_BYTES = 128 * 1024
# Where glibc's dynamic rule ends up once it has seen its largest buffer (DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit): buffers up to 32 MiB from the heaps, at most 64 MiB free kept on top of each heap.
STREAMING_MMAP_THRESHOLD_BYTES = 32 << 20
STREAMING_TRIM_THRESHOLD_BYTES = 64 << 20

Mallopt = Callable[[int, int], bool]


def libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def mallopt() -> Mallopt | None:
    """glibc's mallopt(param, value) -> success, or None off glibc."""
    call = getattr(libc(), "mallopt", None)
    if call is None:
        return None
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int

    def set_option(param: int, value: int) -> bool:
        return bool(call(param, value))  # mallopt returns 1 on success, 0 on error

    return set_option


_streaming_lock = threading.Lock()
_streaming_done = False


def keep_stream_buffers() -> bool:
    """Fix glibc's thresholds where its dynamic rule would end up after a 32 MiB buffer (module doc),
    once per process; False off glibc. For a process that streams large gRPC messages and does not
    bound its heap itself (a worker: the parameter server has its own regime, ps_server.heap)."""
    global _streaming_done
    with _streaming_lock:
        if _streaming_done:
            return True
        set_option = mallopt()
        if set_option is None:
            return False
        _streaming_done = (set_option(M_MMAP_THRESHOLD, STREAMING_MMAP_THRESHOLD_BYTES)
                           and set_option(M_TRIM_THRESHOLD, STREAMING_TRIM_THRESHOLD_BYTES))
        return _streaming_done
