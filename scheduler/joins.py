"""The joins a scheduler has seen (issue 20, `pshard status`): a parameter server that registers for a
running job is a join in progress while it catches up, as the backup of the server before it in ring order,
with that server's slices and row partitions; then, once some of them switched owner under a new layout
version, while its own backups copy what it took (backing up: the moved slices and partitions have no
in-sync copy until they hold them); it is done once they do, or once rolled back (`rolled_back` says why)
when the joiner is gone before the switch: nothing moved, the old layout stays. Pure: the scheduler's
clock comes in as `now`."""

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
    layout_version: int = 0  # the layout that made the switch; 0 before it
    ended: float | None = None  # None: in progress
    rolled_back: str = ""  # why the joiner went before the switch; "" unless it did
    # Of the copy: as the donor last reported it while catching up, then as the joiner reports what its
    # own backups lack while backing up; 0 once done.
    bytes_left: int = 0

    @property
    def took(self) -> bool:
        """The switch made: the joiner serves what it took (its backups may still be copying it)."""
        return self.layout_version > 0

    @property
    def backing_up(self) -> bool:
        """Switched, and its backups do not hold all it took yet."""
        return self.took and not self.done


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
        """`node_id`'s join while it catches up (None once it switched, or none)."""
        key = self._latest.get(node_id)
        current = self._joins.current(key) if key is not None else None
        return current if current is not None and not current.took else None

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
                 layout_version: int) -> Join:
        """What the joiner took under `layout_version`: its backups copy it now (backing up)."""
        current = self.in_progress(node_id)
        if current is None:
            raise KeyError(node_id)
        return self._joins.replace(self._latest[node_id], replace(
            current, donor=donor, slices=slices, partitions=partitions, nbytes=nbytes,
            layout_version=layout_version, bytes_left=nbytes))

    def backing_up(self, address: str, reported_layout: int, bytes_left: int, backed_up: bool,
                   now: float) -> list[Join]:
        """What the joiner at `address` reports with a heartbeat: the layout it routes by, the bytes its
        backups lack, and whether the scheduler counts a backup of it in sync. A report for a layout older
        than the switch says nothing of what it took. Returns the joins it finished."""
        finished = []
        for key, join in self._joins.items():
            if not join.backing_up or join.address != address or reported_layout < join.layout_version:
                continue
            if backed_up:
                finished.append(self._joins.replace(key, replace(join, ended=now, bytes_left=0)))
            else:
                self._joins.replace(key, replace(join, bytes_left=max(0, min(join.nbytes, bytes_left))))
        return finished

    def gone(self, address: str, now: float) -> list[Join]:
        """The joiner at `address` died or left while backing up: its join ends there (a failover or a
        drain moved what it took on); returned so the scheduler can say so."""
        return [self._joins.replace(key, replace(join, ended=now)) for key, join in self._joins.items()
                if join.backing_up and join.address == address]

    def all(self) -> tuple[Join, ...]:
        """In the order they registered."""
        return self._joins.all()
