"""Dynamic data shards (issue 21 item 6): each shard is one scheduled call, taken by whichever worker is free,
so a fast worker trains more shards than a slow one. The shards that finished are the queue's position, and
a global checkpoint commits it with the weights (ClusterCoordinator.save_checkpoint): a coordinator launched
again from that checkpoint schedules only the shards the restored weights have not seen, so no sample is
trained twice. Shards that finished after the checkpoint are trained again: their updates went with the
servers that the checkpoint replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pshard.common.errors import InvalidArgumentError
from pshard.coordinator.closures import RemoteValue

Schedule = Callable[[Any, tuple[Any, ...], Mapping[str, Any] | None], RemoteValue]


class ShardQueue:
    """Shards 0..num_shards-1 of one dataset; `done`: those a restored checkpoint had trained."""

    def __init__(self, name: str, num_shards: int, schedule: Schedule, done: Iterable[int] = ()) -> None:
        if num_shards < 1:
            raise InvalidArgumentError(f"shard_queue({name!r}): num_shards: got {num_shards}, expected >= 1")
        self.name, self.num_shards = name, num_shards
        self._schedule = schedule
        self._restored = frozenset(done)
        bad = sorted(s for s in self._restored if not 0 <= s < num_shards)
        if bad:
            raise InvalidArgumentError(f"shard_queue({name!r}): the checkpoint's shards {bad[:8]} are not "
                                       f"among 0..{num_shards - 1}")
        self._calls: dict[int, RemoteValue] = {}

    def pending(self) -> list[int]:
        """Shards neither restored as trained nor scheduled (a failed one is pending again)."""
        return [s for s in range(self.num_shards) if s not in self._restored and not self._live(s)]

    def schedule(self, fn: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
                 ) -> dict[int, RemoteValue]:
        """`fn(shard, *args, **kwargs)` for every pending shard, in shard order; their RemoteValues."""
        scheduled = {}
        for shard in self.pending():
            scheduled[shard] = self._calls[shard] = self._schedule(fn, (shard, *args), kwargs)
        return scheduled

    def done(self) -> list[int]:
        """Shards trained: restored as such, or whose call finished without an error."""
        return sorted(self._restored | {s for s, r in self._calls.items() if r.succeeded()})

    def position(self) -> dict[str, Any]:
        """What a checkpoint keeps of this queue."""
        return {"num_shards": self.num_shards, "done": self.done()}

    def _live(self, shard: int) -> bool:
        call = self._calls.get(shard)
        return call is not None and (not call.done() or call.succeeded())
