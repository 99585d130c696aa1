"""The drains a scheduler has seen (issue 20, `pshard status`): a server that asks to leave while its backup
holds no copy yet is refused and asks again, so a drain has a start (its first ask) before it is done (the
hand-over). Pure: the scheduler's clock comes in as `now`."""

from __future__ import annotations

from dataclasses import dataclass

from pshard.scheduler.history import History
from pshard.scheduler.timed import Timed

KEEP_DONE = 32  # finished drains kept for status; older ones are dropped first


@dataclass(frozen=True)
class Drain(Timed):
    node_id: str
    address: str
    started: float  # the scheduler's clock at the first ask
    heir: str = ""  # the server that took over what it served; "" while in progress
    slices: int = 0
    partitions: tuple[int, ...] = ()
    layout_version: int = 0  # the layout that made the hand-over
    ended: float | None = None  # None: in progress


class DrainLog:
    def __init__(self, keep_done: int = KEEP_DONE) -> None:
        self._drains: History[str, Drain] = History(keep_done)

    def refused(self, node_id: str, address: str, now: float) -> None:
        """A leave refused for now (no copy yet): the drain is in progress from its first ask on."""
        if self._drains.current(node_id) is None:
            self._drains.add(node_id, Drain(node_id, address, now))

    def handed_over(self, node_id: str, address: str, heir: str, slices: int, partitions: tuple[int, ...],
                    layout_version: int, now: float) -> Drain:
        current = self._drains.current(node_id)
        started = current.started if current is not None else now
        return self._drains.add(node_id, Drain(node_id, address, started, heir, slices, partitions,
                                               layout_version, now))

    def all(self) -> tuple[Drain, ...]:
        """In the order they started asking (a server drained again counts from its new ask)."""
        return self._drains.all()
