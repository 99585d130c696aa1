"""A primary's lease from the scheduler: the time until which no failover can have moved its slices.

Pure: the clock is injected. The scheduler declares a server dead once it has heard nothing from it
for its heartbeat timeout, measured from the heartbeat's arrival, which is never before it was sent.
So a server whose heartbeat sent at `t` was answered knows it is still primary until `t + timeout`
on the scheduler's side; it keeps only `FRACTION` of that, as slack for the two clocks and for the
scheduler's expiry loop. Past it, the server may have been failed over behind a partition (its host
cut off while its process lives): it takes no write until a heartbeat is answered again, so a worker
that still routes to it (a call sent before the partition, delivered when the link returns) is told
to re-route rather than leave an update on a copy that is no longer the primary
(docs/architecture.md, 9 Failures).

A write that finds the lease expired waits for a renewal up to one more heartbeat timeout (`lapsed`):
on a loaded host an answer comes late and the write goes on unseen, while behind a partition the
scheduler has failed the server over by then and the worker, refused, re-routes. A pull waiting for a
sync clock ends, refused, once the lease has lapsed.

The lease is armed by the first answered heartbeat (or registration): a server that never followed a
scheduler (static quorum, tests) is never fenced by it.
"""

from __future__ import annotations

from collections.abc import Callable

from pshard.common.errors import FencedError

# The share of the heartbeat timeout a server trusts after a heartbeat's answer, counted from its sending.
FRACTION = 0.8


class SchedulerLease:
    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._until: float | None = None  # None: not armed
        self._timeout_s = 0.0
        self._renewed_at = 0.0
        self.fenced = 0  # writes refused while expired (logged on the first of each expiry)

    @property
    def armed(self) -> bool:
        return self._until is not None

    @property
    def expires_at(self) -> float | None:
        return self._until

    @property
    def lapses_at(self) -> float | None:
        """When a write stops waiting for a renewal: one heartbeat timeout after the lease's end."""
        return None if self._until is None else self._until + self._timeout_s

    def renew(self, sent_at: float, timeout_s: float) -> bool:
        """A heartbeat sent at `sent_at` was answered; `timeout_s` is the scheduler's heartbeat timeout.
        Returns whether the lease had expired (the server was fenced until now)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: got {timeout_s}, expected > 0")
        was_expired = self.expired()
        until = sent_at + FRACTION * timeout_s
        if self._until is None or until > self._until:
            self._until = until
        self._timeout_s = timeout_s
        self._renewed_at = self._now()
        return was_expired

    def expired(self) -> bool:
        return self._until is not None and self._now() >= self._until

    def lapsed(self) -> bool:
        lapses_at = self.lapses_at
        return lapses_at is not None and self._now() >= lapses_at

    def check(self, what: str) -> None:
        """FencedError naming `what` and the silence, when the lease has run out; else nothing."""
        if not self.expired():
            return
        self.fenced += 1
        silent_s = self._now() - self._renewed_at
        raise FencedError(
            f"{what}: refused, this server has had no heartbeat answered by the scheduler for "
            f"{silent_s:.1f} s (its lease ends at {FRACTION:g} x the {self._timeout_s:g} s heartbeat "
            "timeout): it may have been failed over, so it takes no write until the scheduler answers "
            "again; re-route by the newest layout", silent_ms=round(silent_s * 1000),
            timeout_ms=round(self._timeout_s * 1000))
