"""Large element-wise array work split into chunks over a few threads.

numpy releases the GIL inside its loops on large arrays, so one multi-MiB slice's optimizer update or
copy can use several cores: a single thread reaches a fraction of the memory bandwidth a socket has
(the GPU check's ResNet-18 measured a server's update at ~20 ms/step on one thread). Element-wise
operations on disjoint chunks give exactly the bits of the whole-array operation, so chunking changes
timing only, never a result.

The calling thread takes the first chunk itself and the pool's threads the others, so a pool of
`threads` uses `threads - 1` helper threads, and a pool of 1 is plain inline work (small hosts and
small arrays pay nothing). A task never submits a task, so concurrent callers cannot deadlock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# Below this many elements per chunk a helper thread's hand-off (tens of µs) costs more than it saves.
MIN_CHUNK_ELEMENTS = 128 * 1024
# Chunk boundaries fall on multiples of this many elements: whole cache lines, aligned SIMD loops.
_ALIGN = 64
# More threads than this stop helping: a few cores saturate a socket's memory bandwidth.
MAX_DEFAULT_THREADS = 8


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads(cores: int | None = None) -> int:
    """Half the available cores (the host also runs workers, other servers, gRPC), 1 to 8."""
    cores = available_cores() if cores is None else cores
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))


def split(n: int, parts: int, min_chunk: int = MIN_CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering range(n): at most `parts`, each (but the last) at least `min_chunk`
    elements and a multiple of the alignment."""
    if n <= 0:
        return [(0, 0)]
    count = max(1, min(parts, n // max(1, min_chunk)))
    step = -(-n // count)
    step = -(-step // _ALIGN) * _ALIGN
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


class ChunkPool:
    """`threads` threads (the caller's included) that run one array operation's chunks at once."""

    def __init__(self, threads: int, min_chunk: int = MIN_CHUNK_ELEMENTS) -> None:
        if threads < 1:
            raise ValueError(f"threads: got {threads}, expected >= 1")
        if min_chunk < 1:
            raise ValueError(f"min_chunk: got {min_chunk}, expected >= 1")
        self.threads = threads
        self.min_chunk = min_chunk
        self._executor = (ThreadPoolExecutor(threads - 1, thread_name_prefix="pshard-chunks")
                          if threads > 1 else None)

    def ranges(self, n: int, min_chunk: int | None = None) -> list[tuple[int, int]]:
        """How an operation over `n` elements is cut (one range: it runs inline)."""
        return split(n, self.threads, self.min_chunk if min_chunk is None else min_chunk)

    def splits(self, n: int, min_chunk: int | None = None) -> bool:
        """Whether an operation over `n` elements is cut in more than one range (`len(ranges) > 1`).
        Answered without cutting for a pool of one thread or an array under two chunks: every small
        push+pull asks it, where the cut cost more than the copy (issue 18's latency drift)."""
        chunk = self.min_chunk if min_chunk is None else min_chunk
        return self.threads > 1 and n >= 2 * chunk and len(split(n, self.threads, chunk)) > 1

    def run(self, fn: Callable[[int, int], None], n: int, min_chunk: int | None = None) -> None:
        """`fn(lo, hi)` for every chunk of range(n), all done when this returns; the first error raised."""
        ranges = self.ranges(n, min_chunk)
        if len(ranges) == 1 or self._executor is None:
            for lo, hi in ranges:
                fn(lo, hi)
            return
        futures: list[Future[None]] = [self._executor.submit(fn, lo, hi) for lo, hi in ranges[1:]]
        try:
            fn(*ranges[0])
        finally:
            # Every chunk must be finished before the caller reuses or releases the arrays.
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """np.copyto(dst, src) for C-contiguous arrays of the same size (dtype conversion allowed)."""
        if dst.size != src.size:
            raise ValueError(f"copy: destination has {dst.size} elements, source {src.size}")
        if self._executor is None:  # one thread (the default): the whole copy, without asking how to cut it
            np.copyto(dst, src.reshape(dst.shape), casting="unsafe")
            return
        # A copy is one pass, cheaper per element than an update's several: chunks of as many bytes
        # as an update's chunk of float32 (byte views of network buffers count bytes).
        min_chunk = max(1, self.min_chunk * 4 // dst.itemsize)
        whole = not (dst.flags.c_contiguous and src.flags.c_contiguous)
        if whole or not self.splits(dst.size, min_chunk):
            np.copyto(dst, src.reshape(dst.shape), casting="unsafe")
            return
        d, s = dst.reshape(-1), src.reshape(-1)
        self.run(lambda lo, hi: np.copyto(d[lo:hi], s[lo:hi], casting="unsafe"), d.size, min_chunk)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


_shared: ChunkPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> ChunkPool:
    """The process's pool: one thread (inline work) unless `configure_shared_pool` set it first.

    One thread is the default because that measured fastest where it matters: on the GPU check's H200
    (16 cores, two servers and a worker on one host, torch using 16 threads), a pool of 8 made
    ResNet-18's shared-memory copies slower (12.0 -> 21.4 ms a step) and SGD's update no faster
    (21.4 vs 22.9 ms), and PSTrainer's ratio to local torch.optim fell from 0.353 to 0.300; only
    Adam's update gained (83 -> 43 ms). So a pool is opt-in, where the cores are really free."""
    global _shared
    pool = _shared  # set once, read on every small request: no lock once it is there
    if pool is not None:
        return pool
    with _shared_lock:
        if _shared is None:
            _shared = ChunkPool(1)
        return _shared


def configure_shared_pool(threads: int) -> ChunkPool:
    """Size the process's pool (an entry point's flag; 0 = `default_threads()`), once, before work starts.

    Slices made before keep the pool they were given: it is not closed, only no longer handed out."""
    global _shared
    if threads < 0:
        raise ValueError(f"threads: got {threads}, expected >= 0 (0 = half the available cores, 1 to 8)")
    with _shared_lock:
        wanted = threads or default_threads()
        if _shared is None or _shared.threads != wanted:
            _shared = ChunkPool(wanted)
        return _shared
