"""The partition moves a scheduler has made (issue 20, `pshard rebalance`, `pshard status`, the metrics).
Pure: the scheduler's clock comes in as `now`.

A row partition moves to an in-sync backup of its server: the switch is one new layout version, made at
once, because that backup holds a copy already. The move is done when the partition has a backup again:
the new server reports, for a layout at least as new as the switch, a backup that holds every row it
serves. In between, its backups are copying, and the bytes they still lack (its heartbeats'
`copy_bytes_left`) are the move's bytes left. Drains are counted here too, as moves of their own kind,
so that the metrics count every move and its duration in one place.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping
from dataclasses import dataclass, replace

KEEP_DONE = 64  # finished moves kept for status; older ones are dropped first
# Move durations, in seconds (pshard_scheduler_move_seconds): a switch to a backup is immediate, a copy
# of a large partition to the new server's backups takes seconds to minutes.
MOVE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
REBALANCE, DRAIN, JOIN = "rebalance", "drain", "join"


@dataclass(frozen=True)
class PartitionMove:
    partition: int
    source: str  # addresses
    target: str
    layout_version: int  # the layout that switched it
    nbytes: int  # its rows' bytes when it moved
    started: float
    bytes_left: int  # of nbytes, what the target's backups still lack
    ended: float | None = None

    @property
    def done(self) -> bool:
        return self.ended is not None

    @property
    def bytes_copied(self) -> int:
        return self.nbytes - self.bytes_left

    def seconds(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.started


@dataclass(frozen=True)
class MoveStats:
    """What the metrics read (pshard.common.metrics.SchedulerCollector), copied on the scheduler's loop."""

    finished: Mapping[str, int]  # kind -> moves done
    buckets: tuple[tuple[str, float], ...]  # the duration histogram, cumulative, as Prometheus wants it
    seconds_sum: float
    in_progress: tuple[PartitionMove, ...]


class MoveLog:
    def __init__(self, keep_done: int = KEEP_DONE) -> None:
        self._moves: list[PartitionMove] = []
        self._keep_done = keep_done
        self.finished: collections.Counter[str] = collections.Counter()  # kind -> moves done
        self.bucket_counts = [0] * (len(MOVE_BUCKETS) + 1)  # the last one is +Inf
        self.seconds_sum = 0.0

    def switched(self, partition: int, source: str, target: str, layout_version: int, nbytes: int,
                 now: float) -> PartitionMove:
        """A partition switched to `target`: in progress until the target's backups hold it again."""
        move = PartitionMove(partition, source, target, layout_version, nbytes, now, bytes_left=nbytes)
        self._moves.append(move)
        return move

    def progress(self, target: str, reported_layout: int, bytes_left: int, backed_up: bool,
                 now: float) -> list[PartitionMove]:
        """What `target` reports with a heartbeat: the layout it routes by, the bytes its backups lack,
        and whether the scheduler counts a backup of it in sync now. Returns the moves it finished."""
        finished = []
        for i, move in enumerate(self._moves):
            if move.done or move.target != target or reported_layout < move.layout_version:
                continue
            if backed_up:
                move = replace(move, bytes_left=0, ended=now)
                finished.append(move)
                self._count(REBALANCE, move.seconds(now))
            else:
                move = replace(move, bytes_left=max(0, min(move.nbytes, bytes_left)))
            self._moves[i] = move
        if finished:
            self._trim()
        return finished

    def gone(self, target: str, now: float) -> list[PartitionMove]:
        """`target` died or left before its backups held the moved partitions: those moves end there (a
        failover or a drain moved the partitions on); returned so the scheduler can say so."""
        ended = []
        for i, move in enumerate(self._moves):
            if not move.done and move.target == target:
                self._moves[i] = move = replace(move, ended=now)
                ended.append(move)
        return ended

    def drained(self, seconds: float) -> None:
        """A drain handed a server's slices and partitions to its backup after `seconds`."""
        self._count(DRAIN, seconds)

    def joined(self, seconds: float) -> None:
        """A server that registered for the running job took slices `seconds` after it registered."""
        self._count(JOIN, seconds)

    def all(self) -> tuple[PartitionMove, ...]:
        """In progress first, then done, each in the order they switched."""
        return tuple([m for m in self._moves if not m.done] + [m for m in self._moves if m.done])

    def stats(self) -> MoveStats:
        return MoveStats(dict(self.finished), tuple(self.cumulative()), self.seconds_sum,
                         tuple(m for m in self._moves if not m.done))

    def cumulative(self) -> list[tuple[str, float]]:
        """The duration histogram's buckets as Prometheus wants them."""
        out, total = [], 0
        for bound, count in zip((*map(repr, MOVE_BUCKETS), "+Inf"), self.bucket_counts, strict=True):
            total += count
            out.append((bound, float(total)))
        return out

    def _count(self, kind: str, seconds: float) -> None:
        self.finished[kind] += 1
        self.bucket_counts[bisect.bisect_left(MOVE_BUCKETS, seconds)] += 1
        self.seconds_sum += seconds

    def _trim(self) -> None:
        done = [m for m in self._moves if m.done]
        drop = {id(m) for m in done[:max(0, len(done) - self._keep_done)]}
        self._moves = [m for m in self._moves if id(m) not in drop]
