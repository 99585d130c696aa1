"""The joins a scheduler has seen (issue 20, `pshard status`): a parameter server that registers for a
running job is a join in progress while it catches up, as the backup of the server before it in ring order,
with that server's slices; it is done once they switched owner under a new layout version, or once rolled
back (`rolled_back` says why) when the joiner is gone before the switch: nothing moved, the old layout
stays. Pure: the scheduler's clock comes in as `now`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pshard.scheduler.history import History
from pshard.scheduler.timed import Timed

KEEP_DONE = 32  # finished (switched or rolled back) joins kept for status; older ones are dropped first


@dataclass(frozen=True)
class Join(Timed):
    node_id: str
    address: str  # the joining server
    started: float  # the scheduler's clock at its registration
    donor: str = ""  # the server it copies from and took slices of; "" until that one reports
    slices: int = 0
    partitions: tuple[int, ...] = ()
    nbytes: int = 0  # the bytes of the slices and partitions it took
    layout_version: int = 0  # the layout that made the switch
    ended: float | None = None  # None: in progress
    rolled_back: str = ""  # why the joiner went before the switch; "" unless it did
    bytes_left: int = 0  # of the copy, as the donor last reported them; 0 once switched

    @property
    def took(self) -> bool:
        """Done with the switch made (a rolled-back join is done without one)."""
        return self.done and not self.rolled_back


class JoinLog:
    def __init__(self, keep_done: int = KEEP_DONE) -> None:
        # Keyed by registration: a joiner's rolled-back join stays listed beside its next one.
        self._joins: History[tuple[str, int], Join] = History(keep_done)
        self._latest: dict[str, tuple[str, int]] = {}  # each joiner's latest registration
        self._registrations = 0

    def registered(self, node_id: str, address: str, now: float) -> None:
        """A server beyond the layout registered: a join in progress. A new process of a joiner still
        in progress holds nothing of the old one's copy: that join is rolled back and this one starts."""
        self.rolled_back(node_id, now, "registered again (a new process holds nothing of the copy)")
        self._registrations += 1
        key = self._latest[node_id] = (node_id, self._registrations)
        self._joins.add(key, Join(node_id, address, now))

    def in_progress(self, node_id: str) -> Join | None:
        key = self._latest.get(node_id)
        return self._joins.current(key) if key is not None else None

    def copying(self, node_id: str, donor: str, bytes_left: int) -> None:
        """The donor's report of the bytes its backups (the joiner among them) still lack from its copy."""
        current = self.in_progress(node_id)
        if current is not None:
            self._joins.replace(self._latest[node_id],
                                replace(current, donor=donor, bytes_left=max(0, bytes_left)))

    def rolled_back(self, node_id: str, now: float, why: str) -> Join | None:
        """The joiner died or left before the switch: nothing moved, the old layout stays (a roll back,
        kept for status with `why`). The join rolled back, None if none was in progress."""
        current = self.in_progress(node_id)
        if current is None:
            return None
        ended = replace(current, ended=now, rolled_back=why or "gone")
        return self._joins.replace(self._latest[node_id], ended)

    def switched(self, node_id: str, donor: str, slices: int, partitions: tuple[int, ...], nbytes: int,
                 layout_version: int, now: float) -> Join:
        current = self.in_progress(node_id)
        if current is None:
            raise KeyError(node_id)
        return self._joins.replace(self._latest[node_id], replace(
            current, donor=donor, slices=slices, partitions=partitions, nbytes=nbytes,
            layout_version=layout_version, ended=now, bytes_left=0))

    def all(self) -> tuple[Join, ...]:
        """In the order they registered."""
        return self._joins.all()
