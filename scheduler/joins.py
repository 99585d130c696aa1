"""The joins a scheduler has seen (issue 20, `pshard status`): a parameter server that registers for a
running job is a join in progress while it catches up, as the backup of the server before it in ring order,
with that server's slices; it is done once they switched owner under a new layout version. Pure: the
scheduler's clock comes in as `now`."""

from __future__ import annotations

from dataclasses import dataclass

from pshard.scheduler.history import History
from pshard.scheduler.timed import Timed

KEEP_DONE = 32  # finished joins kept for status; older ones are dropped first


@dataclass(frozen=True)
class Join(Timed):
    node_id: str
    address: str  # the joining server
    started: float  # the scheduler's clock at its registration
    donor: str = ""  # the server it copied from and took slices of; "" until known
    slices: int = 0
    partitions: tuple[int, ...] = ()
    nbytes: int = 0  # the bytes of the slices and partitions it took
    layout_version: int = 0  # the layout that made the switch
    ended: float | None = None  # None: in progress


class JoinLog:
    def __init__(self, keep_done: int = KEEP_DONE) -> None:
        self._joins: History[str, Join] = History(keep_done)

    def registered(self, node_id: str, address: str, now: float) -> None:
        """A server beyond the layout registered: a join in progress (a new process starts it again)."""
        self._joins.add(node_id, Join(node_id, address, now))

    def in_progress(self, node_id: str) -> Join | None:
        return self._joins.current(node_id)

    def dropped(self, node_id: str) -> None:
        """The joiner died or left before the switch: nothing moved, the old layout stays (a roll back)."""
        if self._joins.current(node_id) is not None:
            self._joins.remove(node_id)

    def switched(self, node_id: str, donor: str, slices: int, partitions: tuple[int, ...], nbytes: int,
                 layout_version: int, now: float) -> Join:
        current = self._joins.remove(node_id)
        return self._joins.add(node_id, Join(node_id, current.address, current.started, donor, slices,
                                             partitions, nbytes, layout_version, now))

    def all(self) -> tuple[Join, ...]:
        """In the order they registered."""
        return self._joins.all()
