"""The order in which `PSTrainer(overlap=True, priority=True)` sends a step's buckets (ByteScheduler's
layer priority), as a pure core: what goes next when the link frees up.

Backward produces the last layer's gradients first, but the next forward needs the first layer's
weights first. When the link is the bottleneck, buckets queue up while it sends; of the queued ones the
bucket nearest the model's input goes next, so that its pull, and the next forward's first layers, can
start while the later layers' pushes still travel. An older step's bucket always goes before a newer
step's. Buckets are cut at `bucket_bytes`, so a queued higher-priority bucket waits for at most one
bucket in flight.

Only pushes are reordered. A sync push never waits for the other workers, so any order of pushes is
safe; a pull does wait for them, and pulls therefore go in one fixed order, the same on every worker
(see pshard.worker.overlap).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PushQueue(Generic[T]):
    """Ready buckets, taken highest priority first: the oldest clock, then the bucket nearest the
    model's input (the highest `depth`; buckets are numbered from the last layer, 0, upwards).

    Thread-safe: hooks put from autograd's threads while the sending thread takes."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, T]] = []
        self._seq = itertools.count()  # ties (the same bucket twice, a misuse) stay first-in first-out
        self._lock = threading.Lock()

    def put(self, clock: int, depth: int, item: T) -> None:
        with self._lock:
            heapq.heappush(self._heap, (clock, -depth, next(self._seq), item))

    def take(self) -> T:
        """The most urgent item; IndexError when there is none (a take follows each put)."""
        with self._lock:
            return heapq.heappop(self._heap)[3]

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap)


def take_one(queue: PushQueue[Callable[[], None]]) -> None:
    """Run the most urgent queued send. The sending thread runs one of these per put, so it runs every
    send, each time the one that is most urgent when the link frees up."""
    queue.take()()
