"""A parameter server's budget of in-flight request bytes: backpressure before memory runs out.

Every request reserves the bytes it brings before they are decoded (a unary call: its serialized
size; an Exchange stream: each frame as it arrives) and gives them back when it ends. A reservation
that would take the total past the limit is refused with `OverloadedError`, whose message names the
budget and what is in flight, and whose `retry_after_ms` tells the client when to come back.

One exception keeps every request possible: a request that holds nothing else's room (it is the
only one in flight) is admitted past the limit, so a declaration bigger than the budget still
completes when it is alone instead of being refused for ever. The bytes still have to arrive: nothing
here trusts what a header promises.

A second, per-peer budget (`WasteTarpit`) is for peers that ignore refusals: a connection whose
requests keep being refused, or keep changing nothing (pushes that are all duplicates), has its
requests held for a while and then refused unread. See the class docstring.

Pure: no grpc, no asyncio; unit-tested in tests/unit/test_budget.py (the gRPC adapter of the
tarpit is ps_server/transport/tarpit.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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


# A peer that wasted this many request bytes in a row (one 4 MiB request) is held when it comes back
# early. Measured with tests/e2e/test_flood.py: at 8 MiB the flood's first reads, 16 connections at
# once, took the server's RSS to 300-440 MiB; at 4 MiB to 210-270 MiB.
DEFAULT_WASTE_LIMIT_BYTES = 4 * MIB
# Long enough that a flooding client, however slow to send again, comes back early: at 50 ms the
# flood's clients (nice 19 on a loaded machine) came back late and were read two or three times as
# often, at the start when they all are (peak RSS 330-380 MiB in 2 of 5 runs; ~200 MiB at 0.2 s).
FIRST_HOLD_S = 0.2
MAX_HOLD_S = 1.0
MAX_PEERS = 4096


@dataclass
class _Waster:
    wasted: int = 0  # request bytes refused or changing nothing, in a row
    hold_s: float = 0.0  # how long its next early request is held (0: not held yet)
    until: float = 0.0  # requests before this are held, then refused unread


class WasteTarpit:
    """Peers whose requests keep being wasted are held, then refused without being read.

    A request is wasted when it is refused for something the client got wrong (a bad or unknown
    key, a malformed message, a caller without the right) or when it changes nothing (every pushed
    gradient a duplicate). Reading such a request is the expensive part: a 4 MiB message is copied
    twice into Python and parsed on the event loop that also serves every other worker's steps.
    Once a peer (a connection) has wasted `limit_bytes` in a row, its next request that comes back
    before `until` is not read: it is held `hold_s` and then refused with RESOURCE_EXHAUSTED and a
    retry hint of the same length. A client that waits as asked comes back after `until` and is
    read as usual (one that succeeds is forgotten); a client that does not, a flood, is held again,
    twice as long each time up to `max_hold_s`, and sends one request per hold instead of as many
    as the server can read. Small mistakes never add up to a hold: only wasted bytes count.

    One event loop drives it (no lock). At most `max_peers` peers are remembered, the oldest
    forgotten first.
    """

    def __init__(self, limit_bytes: int = DEFAULT_WASTE_LIMIT_BYTES, first_hold_s: float = FIRST_HOLD_S,
                 max_hold_s: float = MAX_HOLD_S, max_peers: int = MAX_PEERS,
                 now: Callable[[], float] = time.monotonic) -> None:
        if limit_bytes <= 0 or not 0 < first_hold_s <= max_hold_s or max_peers <= 0:
            raise ValueError(f"WasteTarpit: got limit_bytes={limit_bytes}, first_hold_s={first_hold_s}, "
                             f"max_hold_s={max_hold_s}, max_peers={max_peers}")
        self.limit_bytes = limit_bytes
        self._first_hold_s = first_hold_s
        self._max_hold_s = max_hold_s
        self._max_peers = max_peers
        self._now = now
        self._peers: dict[str, _Waster] = {}
        self.held = 0  # requests held and refused unread, for stats and tests

    def admit(self, peer: str) -> float | None:
        """None: read and serve `peer`'s request. Else the seconds to hold it before refusing it unread."""
        waster = self._peers.get(peer)
        if waster is None or waster.hold_s == 0 or self._now() >= waster.until:
            return None
        hold_s = waster.hold_s
        # Back no sooner than the hold plus the hint; each early comeback doubles the next hold.
        waster.until = self._now() + 2 * hold_s
        waster.hold_s = min(2 * hold_s, self._max_hold_s)
        self.held += 1
        return hold_s

    def served(self, peer: str, nbytes: int, wasted: bool) -> bool:
        """Record a request of `peer` that was read (`nbytes`): True when the peer is held from now on."""
        if not wasted:
            self._peers.pop(peer, None)
            return False
        waster = self._peers.pop(peer, None) or _Waster()
        self._peers[peer] = waster  # the most recent last: the oldest are forgotten first
        while len(self._peers) > self._max_peers:
            del self._peers[next(iter(self._peers))]
        waster.wasted += nbytes
        if waster.wasted < self.limit_bytes:
            return False
        started = waster.hold_s == 0
        waster.hold_s = self._first_hold_s if started else min(2 * waster.hold_s, self._max_hold_s)
        waster.until = self._now() + waster.hold_s
        return started

    def hold_left(self, peer: str) -> float:
        """Seconds `peer` is held from now (0: it is not): a fast-path connection stops being read for
        that long, since its frames cannot be refused unread as a gRPC call can
        (ps_server/transport/fastconn.py)."""
        waster = self._peers.get(peer)
        if waster is None or waster.hold_s == 0:
            return 0.0
        left = waster.until - self._now()
        if left <= 0:
            return 0.0
        self.held += 1
        return left

    def retry_after_ms(self, hold_s: float) -> int:
        return max(1, round(hold_s * 1000))

    def describe(self, peer: str) -> str:
        waster = self._peers.get(peer)
        return _mib(waster.wasted if waster is not None else 0)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"
