"""Each parameter server's load (issue 20: `pshard status`, `pshard rebalance`): bytes in and out per
second, and rows per second of each table row partition it serves, from the counters its heartbeats
carry. Pure: the scheduler's clock comes in as `now`.

A rate is the growth of a counter between the oldest report kept within `window_s` and the newest, so a
single late or early heartbeat does not make a spike. A counter that went down belongs to a new process
(a server restarted at the same address): its reports start over.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pshard.common.cluster.layout import MAX_ROW_PARTITIONS
from pshard.common.errors import InvalidArgumentError

WINDOW_S = 10.0  # rates over about this much of the newest reports


@dataclass(frozen=True)
class Counters:
    """One heartbeat's counters: cumulative bytes, cumulative rows per partition, and each partition's
    bytes held now."""

    bytes_in: int = 0
    bytes_out: int = 0
    rows: Mapping[int, int] = field(default_factory=dict)
    partition_bytes: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerLoad:
    address: str
    bytes_in_per_s: float = 0.0
    bytes_out_per_s: float = 0.0
    rows_per_s: Mapping[int, float] = field(default_factory=dict)  # partition -> rows/s
    partition_bytes: Mapping[int, int] = field(default_factory=dict)  # partition -> bytes held


class LoadMeter:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not window_s > 0:
            raise InvalidArgumentError(f"load window_s: got {window_s}, expected > 0")
        self._window_s = window_s
        self._reports: dict[str, deque[tuple[float, Counters]]] = {}

    @staticmethod
    def check(address: str, counters: Counters) -> None:
        """Refuse counters naming a row partition no layout can have (before anything is recorded)."""
        named = {*counters.rows, *counters.partition_bytes}
        bad = sorted(p for p in named if not 0 <= p < MAX_ROW_PARTITIONS)
        if bad:
            raise InvalidArgumentError(f"server {address} load: got row partitions {bad[:8]}, expected 0 to "
                                       f"{MAX_ROW_PARTITIONS - 1}")

    def report(self, address: str, counters: Counters, now: float) -> None:
        """A server's heartbeat counters at `now` (the scheduler's clock)."""
        self.check(address, counters)
        kept = self._reports.setdefault(address, deque())
        if kept and _restarted(kept[-1][1], counters):
            kept.clear()
        kept.append((now, counters))
        # Keep the newest report older than the window: the rate then spans at least the window.
        while len(kept) > 2 and kept[1][0] <= now - self._window_s:
            kept.popleft()

    def forget(self, address: str) -> None:
        """A server that died or left: it serves nothing any more."""
        self._reports.pop(address, None)

    def load(self, address: str) -> ServerLoad:
        """The server's rates between its oldest and newest kept reports (zeros before two)."""
        kept = self._reports.get(address)
        if not kept:
            return ServerLoad(address)
        (t0, first), (t1, last) = kept[0], kept[-1]
        held = dict(last.partition_bytes)
        if t1 <= t0:
            return ServerLoad(address, rows_per_s={p: 0.0 for p in last.rows}, partition_bytes=held)
        dt = t1 - t0
        rows = {}
        for p, n in last.rows.items():
            # From the first report that named it: a partition that moved here was counted before.
            since, n0 = next((t, c.rows[p]) for t, c in kept if p in c.rows)
            rows[p] = max(0, n - n0) / (t1 - since) if t1 > since else 0.0
        return ServerLoad(address, (last.bytes_in - first.bytes_in) / dt,
                          (last.bytes_out - first.bytes_out) / dt, rows, held)

    def loads(self) -> tuple[ServerLoad, ...]:
        return tuple(self.load(a) for a in self._reports)

    @property
    def window_s(self) -> float:
        return self._window_s

    def sampled_s(self, address: str) -> float:
        """How many seconds the server's kept reports span (0 before two): its rates are over that long,
        which is at least the window once it has reported for longer (a restart starts it over)."""
        kept = self._reports.get(address)
        return kept[-1][0] - kept[0][0] if kept else 0.0


def _restarted(before: Counters, after: Counters) -> bool:
    return (after.bytes_in < before.bytes_in or after.bytes_out < before.bytes_out
            or any(after.rows.get(p, 0) < n for p, n in before.rows.items() if p in after.rows))


def partition_loads(loads: Sequence[ServerLoad], owners: Sequence[str]) -> tuple[list[float], list[int]]:
    """Rows/s and bytes of each row partition, as `plan_rebalance` takes them: `owners[p]` is the address
    of partition p's server, whose report counts (a server that just lost it may report it a moment
    longer); a partition its server has not reported counts 0."""
    by_address = {load.address: load for load in loads}
    rates, sizes = [0.0] * len(owners), [0] * len(owners)
    for p, address in enumerate(owners):
        load = by_address.get(address)
        if load is not None:
            rates[p] = load.rows_per_s.get(p, 0.0)
            sizes[p] = load.partition_bytes.get(p, 0)
    return rates, sizes
