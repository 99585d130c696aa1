"""The partition moves a scheduler has made (issue 20, `pshard rebalance`, `pshard status`, the metrics).
Pure: the scheduler's clock comes in as `now`.

A row partition moves to an in-sync backup of its server at once, because that backup holds a copy
already, and to any other server after a catch-up copy (scheduler/partition_copies.py): either way the
switch is one new layout version, and the move is kept here from its switch on, timed from the copy's
start. It is done when the partition has a backup again: the new server reports, for a layout at least
as new as the switch, a backup that holds every row it serves (in a job without replicas, once it
reports that layout). In between, its backups are copying, and the bytes they still lack (its
heartbeats' `copy_bytes_left`) are the move's bytes left. Drains are counted here too, as moves of their
own kind, so that the metrics count every move and its duration in one place.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pshard.scheduler.history import History
from pshard.scheduler.timed import Timed

KEEP_DONE = 64  # finished moves kept for status; older ones are dropped first
# Move durations, in seconds (pshard_scheduler_move_seconds): a switch to a backup is immediate, a copy
# of a large partition to the new server's backups takes seconds to minutes.
MOVE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
REBALANCE, DRAIN, JOIN = "rebalance", "drain", "join"


@dataclass(frozen=True)
class PartitionMove(Timed):
    partition: int
    source: str  # addresses
    target: str
    layout_version: int  # the layout that switched it
    nbytes: int  # its rows' bytes when it moved
    started: float
    bytes_left: int  # of nbytes, what the target's backups still lack
    ended: float | None = None

    @property
    def bytes_copied(self) -> int:
        return self.nbytes - self.bytes_left


@dataclass(frozen=True)
class MoveStats:
    """What the metrics read (pshard.common.metrics.SchedulerCollector), copied on the scheduler's loop."""

    finished: Mapping[str, int]  # kind -> moves done
    buckets: tuple[tuple[str, float], ...]  # the duration histogram, cumulative, as Prometheus wants it
    seconds_sum: float
    in_progress: tuple[PartitionMove, ...]
    automatic: int = 0  # moves the automatic rebalance started (`pshard scheduler --rebalance-auto`)


class MoveLog:
    def __init__(self, keep_done: int = KEEP_DONE) -> None:
        self._moves: History[int, PartitionMove] = History(keep_done)
        self._switches = itertools.count()  # the moves' keys: a partition may move again
        self.finished: collections.Counter[str] = collections.Counter()  # kind -> moves done
        self.bucket_counts = [0] * (len(MOVE_BUCKETS) + 1)  # the last one is +Inf
        self.seconds_sum = 0.0
        self.automatic = 0  # moves the automatic rebalance started (scheduler/auto_rebalancer.py)

    def switched(self, partition: int, source: str, target: str, layout_version: int, nbytes: int,
                 now: float) -> PartitionMove:
        """A partition switched to `target`: in progress until the target's backups hold it again."""
        return self._moves.add(next(self._switches), PartitionMove(partition, source, target, layout_version,
                                                                  nbytes, now, bytes_left=nbytes))

    def progress(self, target: str, reported_layout: int, bytes_left: int, backed_up: bool,
                 now: float) -> list[PartitionMove]:
        """What `target` reports with a heartbeat: the layout it routes by, the bytes its backups lack,
        and whether the scheduler counts a backup of it in sync now. Returns the moves it finished."""
        finished = []
        for key, move in self._moves.items():
            if move.done or move.target != target or reported_layout < move.layout_version:
                continue
            if backed_up:
                done = self._moves.replace(key, replace(move, bytes_left=0, ended=now))
                self._count(REBALANCE, done.seconds(now))
                finished.append(done)
            else:
                self._moves.replace(key, replace(move, bytes_left=max(0, min(move.nbytes, bytes_left))))
        return finished

    def gone(self, target: str, now: float) -> list[PartitionMove]:
        """`target` died or left before its backups held the moved partitions: those moves end there (a
        failover or a drain moved the partitions on); returned so the scheduler can say so."""
        return [self._moves.replace(key, replace(move, ended=now)) for key, move in self._moves.items()
                if not move.done and move.target == target]

    def drained(self, seconds: float) -> None:
        """A drain handed a server's slices and partitions to its backup after `seconds`."""
        self._count(DRAIN, seconds)

    def joined(self, seconds: float) -> None:
        """A server that registered for the running job took slices `seconds` after it registered."""
        self._count(JOIN, seconds)

    def all(self) -> tuple[PartitionMove, ...]:
        """In progress first, then done, each in the order they switched."""
        return (*self._moves.in_progress(), *self._moves.done())

    def stats(self) -> MoveStats:
        return MoveStats(dict(self.finished), tuple(self.cumulative()), self.seconds_sum,
                         self._moves.in_progress(), self.automatic)

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
