"""A parameter server's budget of in-flight request bytes: backpressure before memory runs out.

Every request reserves the bytes it brings before they are decoded (a unary call: its serialized
size; an Exchange stream: each frame as it arrives) and gives them back when it ends. A reservation
that would take the total past the limit is refused with `OverloadedError`, whose message names the
budget and what is in flight, and whose `retry_after_ms` tells the client when to come back.

One exception keeps every request possible: a request that holds nothing else's room (it is the
only one in flight) is admitted past the limit, so a declaration bigger than the budget still
completes when it is alone instead of being refused for ever. The bytes still have to arrive: nothing
here trusts what a header promises.

Pure: no grpc, no asyncio; unit-tested in tests/unit/test_budget.py.
"""

from __future__ import annotations

import threading
from types import TracebackType

from pshard.common.errors import OverloadedError

MIB = 2**20
DEFAULT_MAX_INFLIGHT_BYTES = 512 * MIB
# The hint grows with how far past the budget the server is: a slightly full server frees room
# within a few ms (one request ends), a server owed many times its budget needs longer.
MIN_RETRY_AFTER_MS = 20
MAX_RETRY_AFTER_MS = 1000


class InflightBudget:
    """Bytes held by requests in progress, at most `limit_bytes` (see the module docstring)."""

    def __init__(self, limit_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes: got {limit_bytes}, expected > 0")
        self.limit_bytes = limit_bytes
        # Handlers run on one event loop, but executor threads release too: a lock keeps it exact.
        self._lock = threading.Lock()
        self._in_flight = 0
        self.refused = 0  # requests turned away, for stats and tests
        self.peak = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def reservation(self, what: str) -> Reservation:
        """An empty reservation for one request; `what` names it in a refusal."""
        return Reservation(self, what)

    def _take(self, owner: Reservation, nbytes: int) -> None:
        with self._lock:
            others = self._in_flight - owner.held
            if others > 0 and self._in_flight + nbytes > self.limit_bytes:
                self.refused += 1
                raise OverloadedError(
                    f"{owner.what}: server busy, in-flight request bytes at their budget: "
                    f"{_mib(self._in_flight)} in flight + {_mib(nbytes)} requested > "
                    f"--max-inflight-mb {_mib(self.limit_bytes)}; retry later",
                    retry_after_ms=self._retry_after_ms(nbytes))
            self._in_flight += nbytes
            self.peak = max(self.peak, self._in_flight)

    def _give(self, owner: Reservation, nbytes: int) -> None:
        with self._lock:
            self._in_flight -= nbytes

    def _retry_after_ms(self, nbytes: int) -> int:
        over = (self._in_flight + nbytes) / self.limit_bytes  # > 1 when refused
        return int(min(MAX_RETRY_AFTER_MS, max(MIN_RETRY_AFTER_MS, MIN_RETRY_AFTER_MS * over * over)))


class Reservation:
    """The bytes one request holds; a context manager that gives them all back at exit."""

    def __init__(self, budget: InflightBudget, what: str) -> None:
        self._budget = budget
        self.what = what
        self.held = 0
        self.total = 0  # every byte ever held: what the request brought in

    def add(self, nbytes: int) -> None:
        """Hold `nbytes` more, or raise OverloadedError (holding nothing more)."""
        if nbytes < 0:
            raise ValueError(f"nbytes: got {nbytes}, expected >= 0")
        self._budget._take(self, nbytes)
        self.held += nbytes
        self.total += nbytes

    def release(self, nbytes: int | None = None) -> None:
        """Give back `nbytes` (default: everything held)."""
        nbytes = self.held if nbytes is None else min(nbytes, self.held)
        if nbytes:
            self._budget._give(self, nbytes)
            self.held -= nbytes

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"
