"""Dynamic data shards (issue 21 item 6): each shard is one scheduled call, taken by whichever worker is free,
so a fast worker trains more shards than a slow one. The queue's position is the shards that finished and,
for a shard whose call failed part-way, how many of its batches were trained (`offsets`: the function's
`current().resume(batches)` counts those whose step and pushes ended). A global checkpoint commits the
position with the weights (ClusterCoordinator.save_checkpoint, after a join: every count it holds is in the
weights), and a shard scheduled again (after a failure, or by a coordinator launched again from that
checkpoint) resumes at its offset, so no sample is trained twice. Shards that finished after the checkpoint
are trained again: their updates went with the servers that the checkpoint replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pshard.common.errors import InvalidArgumentError
from pshard.coordinator.closures import RemoteValue

# (fn, args, kwargs, resume_at) -> the call: ClusterCoordinator's schedule, resuming the work at an offset.
Schedule = Callable[[Any, tuple[Any, ...], Mapping[str, Any] | None, int], RemoteValue]


class ShardQueue:
    """Shards 0..num_shards-1 of one dataset; `done`: those a restored checkpoint had trained, `offsets`:
    the batches it had trained of others (shard -> count)."""

    def __init__(self, name: str, num_shards: int, schedule: Schedule, done: Iterable[int] = (),
                 offsets: Mapping[int, int] | None = None) -> None:
        if num_shards < 1:
            raise InvalidArgumentError(f"shard_queue({name!r}): num_shards: got {num_shards}, expected >= 1")
        self.name, self.num_shards = name, num_shards
        self._schedule = schedule
        self._restored = frozenset(done)
        bad = sorted(s for s in self._restored if not 0 <= s < num_shards)
        if bad:
            raise InvalidArgumentError(f"shard_queue({name!r}): the checkpoint's shards {bad[:8]} are not "
                                       f"among 0..{num_shards - 1}")
        self._offsets = {int(s): int(n) for s, n in (offsets or {}).items()}
        bad = sorted(s for s, n in self._offsets.items()
                     if not 0 <= s < num_shards or s in self._restored or n < 0)
        if bad:
            raise InvalidArgumentError(f"shard_queue({name!r}): the checkpoint's offsets of shards {bad[:8]} "
                                       f"({[self._offsets[s] for s in bad[:8]]}) are not those of unfinished "
                                       f"shards among 0..{num_shards - 1} with a count >= 0")
        self._calls: dict[int, RemoteValue] = {}

    def pending(self) -> list[int]:
        """Shards neither restored as trained nor scheduled (a failed one is pending again)."""
        return [s for s in range(self.num_shards) if s not in self._restored and not self._live(s)]

    def schedule(self, fn: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
                 ) -> dict[int, RemoteValue]:
        """`fn(shard, *args, **kwargs)` for every pending shard, in shard order, each resuming at its offset
        (`current().resume(batches)` skips the batches trained already); their RemoteValues."""
        scheduled = {}
        for shard in self.pending():
            start = self.offset(shard)
            scheduled[shard] = self._calls[shard] = self._schedule(fn, (shard, *args), kwargs, start)
        return scheduled

    def offset(self, shard: int) -> int:
        """The batches of `shard` trained so far: by its last call (which failed part-way, or still runs),
        else as restored."""
        call = self._calls.get(shard)
        return call.progress if call is not None else self._offsets.get(shard, 0)

    def done(self) -> list[int]:
        """Shards trained: restored as such, or whose call finished without an error."""
        return sorted(self._restored | {s for s, r in self._calls.items() if r.succeeded()})

    def position(self) -> dict[str, Any]:
        """What a checkpoint keeps of this queue: the shards done, and the offsets of those begun (a
        checkpoint joins first: no call runs, so every count is in the weights it saves)."""
        done = set(self.done())
        offsets = {str(s): n for s in range(self.num_shards) if s not in done and (n := self.offset(s)) > 0}
        return {"num_shards": self.num_shards, "done": sorted(done), "offsets": offsets}

    def _live(self, shard: int) -> bool:
        call = self._calls.get(shard)
        return call is not None and (not call.done() or call.succeeded())
