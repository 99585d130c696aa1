"""The drains a scheduler has seen (issue 20, `pshard status`): a server that asks to leave while its backup
holds no copy yet is refused and asks again, so a drain has a start (its first ask) before it is done (the
hand-over). Pure: the scheduler's clock comes in as `now`."""

from __future__ import annotations

from dataclasses import dataclass

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
        self._drains: dict[str, Drain] = {}
        self._keep_done = keep_done

    def refused(self, node_id: str, address: str, now: float) -> None:
        """A leave refused for now (no copy yet): the drain is in progress from its first ask on."""
        current = self._drains.get(node_id)
        if current is None or current.done:
            self._drains.pop(node_id, None)
            self._drains[node_id] = Drain(node_id, address, now)

    def handed_over(self, node_id: str, address: str, heir: str, slices: int, partitions: tuple[int, ...],
                    layout_version: int, now: float) -> Drain:
        current = self._drains.pop(node_id, None)
        started = current.started if current is not None and not current.done else now
        drain = Drain(node_id, address, started, heir, slices, partitions, layout_version, now)
        self._drains[node_id] = drain
        done = [d.node_id for d in self._drains.values() if d.done]
        for old in done[:max(0, len(done) - self._keep_done)]:
            del self._drains[old]
        return drain

    def all(self) -> tuple[Drain, ...]:
        """In the order they started asking (a server drained again counts from its new ask)."""
        return tuple(self._drains.values())
