"""Row partitions being copied to a server that is not a backup of their own (issue 20, `pshard rebalance`).
Pure: the scheduler's clock comes in as `now`, and which incarnations are live as `current`.

A move to a server without a copy of the partition is a planned failover after a targeted catch-up copy:

1. *copying*: the views name (partition, source, target); the source forwards the partition's rows to the
   target as to a backup (a full copy, chunked, then every change), and reports it with its in-sync
   backups once the target holds them all;
2. *switched*: on that report the scheduler switches the partition to the target under one new layout
   version (the source refuses it from then on, the workers re-route and resend); the views keep naming
   the copy until the target reports that layout, by which it took its copy over;
3. done: the copy leaves the views, and the source drops what is left of it on the target.

A crash before the switch rolls the move back (the layout never named the target: the source or the
target gone, a new process of either, which holds nothing of the copy, a scheduler restarted, which
forgot it, or a layout that gave the partition elsewhere meanwhile); after it, the move is complete (the
switch is one layout version, which a restarted scheduler gets back from the workers). So a partition
never has two owners or none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from pshard.common.cluster.view import PartitionCopy
from pshard.common.errors import InvalidArgumentError


@dataclass(frozen=True)
class Copy:
    partition: int
    source: str  # addresses
    target: str
    source_generation: int  # the incarnations the copy runs between
    target_generation: int
    started: float
    switched_at: int = 0  # the layout version that switched it (0: copying)
    nbytes: int = 0  # its rows' bytes when the copy began, as its source reported them
    bytes_left: int = 0  # of the copy, as the source last reported them (`pshard status`)

    def wire(self) -> PartitionCopy:
        return PartitionCopy(self.partition, self.source, self.target, self.switched_at)


class PartitionCopies:
    def __init__(self) -> None:
        self._copies: dict[int, Copy] = {}  # partition -> its copy

    def start(self, partition: int, source: tuple[str, int], target: tuple[str, int], now: float,
              nbytes: int = 0) -> bool:
        """A copy of `partition` from `source` to `target` (address, generation each); False when that very
        copy runs already (a retried request). Another copy of the partition in progress is refused."""
        running = self._copies.get(partition)
        if running is not None:
            if (running.target, running.target_generation, running.source) == (*target, source[0]):
                return False
            state = f"switched at layout version {running.switched_at}" if running.switched_at else "copying"
            raise InvalidArgumentError(f"move of row partition {partition} to {target[0]!r}: it is moving to "
                                       f"{running.target!r} already ({state}); wait for that move")
        self._copies[partition] = Copy(partition, source[0], target[0], source[1], target[1], now,
                                       nbytes=nbytes, bytes_left=nbytes)
        return True

    def between(self, source: str, target: str) -> Copy | None:
        """A copy from `source` to `target` not done yet (copying, or switched and not yet taken over). The
        target keeps one replica of its source for all the partitions copied to it, and drops it whole
        once it took a switched copy over: a second copy from the same source begun before that lost the
        rows it had sent (an acknowledged push lost, seen in tests/e2e/test_rebalance.py under load)."""
        return next((c for c in self._copies.values() if (c.source, c.target) == (source, target)), None)

    def copying(self, source: str, bytes_left: int) -> None:
        """`source`'s report of the bytes its slowest copy still lacks: each of its copies' bytes left."""
        for c in list(self._copies.values()):
            if c.source == source and not c.switched_at:
                self._copies[c.partition] = replace(c, bytes_left=max(0, min(c.nbytes, bytes_left)))

    def in_progress(self) -> tuple[Copy, ...]:
        """The copies not switched yet, for `pshard status` (the switched ones are moves in the MoveLog)."""
        return tuple(c for c in sorted(self._copies.values(), key=lambda c: c.partition) if not c.switched_at)

    def caught_up(self, source: str, reported: Mapping[str, int],
                  current: Callable[[str, int], bool]) -> list[Copy]:
        """The copies from `source` still copying whose target `source` reports holding them, as the
        incarnation the copy went to (`reported`: address -> generation, its in-sync report)."""
        return [c for c in self._copies.values() if c.source == source and not c.switched_at
                and reported.get(c.target) == c.target_generation and current(c.target, c.target_generation)]

    def switched(self, partition: int, layout_version: int) -> Copy:
        copy = self._copies[partition] = replace(self._copies[partition], switched_at=layout_version)
        return copy

    def taken(self, target: str, reported_layout: int) -> list[Copy]:
        """`target` routes by `reported_layout`: the switched copies to it that layout covers are taken over
        (done), and leave the views."""
        done = [c for c in self._copies.values()
                if c.target == target and c.switched_at and reported_layout >= c.switched_at]
        for c in done:
            del self._copies[c.partition]
        return done

    def gone(self, address: str) -> list[Copy]:
        """The process at `address` died, left or was replaced: every copy from or to it ends. Those still
        copying roll back (the layout never named their target); switched ones are complete, and nothing is
        left to forward."""
        ended = [c for c in self._copies.values() if address in (c.source, c.target)]
        for c in ended:
            del self._copies[c.partition]
        return ended

    def not_owned(self, owner_of: Callable[[int], str]) -> list[Copy]:
        """A new layout gave a copying partition to a server other than its source (a failover): the copy
        is of a state the source no longer serves, and rolls back."""
        stale = [c for c in self._copies.values() if not c.switched_at and owner_of(c.partition) != c.source]
        for c in stale:
            del self._copies[c.partition]
        return stale

    def get(self, partition: int) -> Copy | None:
        return self._copies.get(partition)

    def view(self) -> tuple[PartitionCopy, ...]:
        return tuple(c.wire() for c in sorted(self._copies.values(), key=lambda c: c.partition))
