"""Drains without replicas (issue 20): everything the drained server serves goes, by targeted catch-up
copies, to the servers `plan_drain` spreads it over, then switches under ONE new layout version. Pure: the
scheduler's clock comes in as `now`, and which incarnations are live as `current`.

A job with replicas drains onto the in-sync backup, which holds a copy already. Without replicas nothing
holds one, so the drain is a planned failover after copies, as `pshard rebalance` moves a row partition
(scheduler/partition_copies.py), but of a whole server at once:

1. *copying*: the views name, for each target, the slices and row partitions it takes from the source;
   the source forwards them as to a joiner (`Replicator.set_copies`, `TableReplication.set_copies`: a
   catch-up copy, then every change), and reports each target with its incarnation once it holds all;
2. *switched*: once every target is reported caught up, the scheduler installs the plan's layout under one
   new version (the source serves nothing from then on, and may leave); the views keep naming the copies
   until each target reports that layout, by which it took its copies over;
3. done: the copies leave the views.

The switch is one layout version for every item of the drain, never one per target: a crash before it
(the source, a target or a new process of either, whose copy is gone; the scheduler, which forgets the
drain, soft state; or a layout that changed under the plan) rolls the whole drain back to the layout in
force, and the operator's drain asks again, planned anew; a crash after it leaves the new layout in force.
So an item has exactly one owner at every layout version, the source's or its target's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.moves import Item, MovePlan
from pshard.common.errors import InvalidArgumentError
from pshard.common.types import SliceKey


@dataclass(frozen=True)
class DrainCopy:
    source: str  # addresses
    source_generation: int
    plan: MovePlan
    targets: Mapping[str, int]  # each target's address -> the incarnation its copy goes to
    started: float
    caught_up: frozenset[str] = frozenset()  # the targets the source reported holding their copies
    switched_at: int = 0  # the layout version that switched the drain (0: copying)
    taken: frozenset[str] = frozenset()  # the targets that report the switched layout

    def items_to(self, target: str) -> tuple[Item, ...]:
        index = self.plan.before.servers.index(target)
        return tuple(m.item for m in self.plan.moves_to(index))

    def slices_to(self, target: str) -> frozenset[SliceKey]:
        return frozenset(i for i in self.items_to(target) if isinstance(i, SliceKey))

    def partitions_to(self, target: str) -> frozenset[int]:
        return frozenset(i for i in self.items_to(target) if isinstance(i, int))

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes


class DrainCopies:
    def __init__(self) -> None:
        self._drains: dict[str, DrainCopy] = {}  # source address -> its drain

    def start(self, source: tuple[str, int], plan: MovePlan, current: Callable[[str, int], bool],
              generations: Mapping[str, int], now: float) -> bool:
        """The drain of `source` (address, generation) by `plan` (`plan_drain` of the layout in force):
        its targets' incarnations are `generations` (address -> generation). False when that very drain
        runs already (a retried ask). Changes nothing when refused (InvalidArgumentError)."""
        address, generation = source
        running = self._drains.get(address)
        if running is not None and running.source_generation == generation:
            return False
        index = _index(plan.before, address, "drain source")
        if any(m.source != index for m in plan.moves):
            raise InvalidArgumentError(f"drain of {address!r}: the plan moves items off servers "
                                       f"{sorted({m.source for m in plan.moves})}, expected only {index}")
        targets = {plan.before.servers[m.target] for m in plan.moves}
        missing = sorted(t for t in targets if t not in generations or not current(t, generations[t]))
        if missing:
            raise InvalidArgumentError(f"drain of {address!r}: targets {missing} are not live")
        for other in self._drains.values():
            # A server both draining and taking a drain's items would hand them on before holding them.
            clash = ({address} & set(other.targets)) | (targets & {other.source})
            if clash:
                state = f"switched at layout version {other.switched_at}" if other.switched_at else "copying"
                raise InvalidArgumentError(f"drain of {address!r}: {sorted(clash)[0]!r} is in the drain of "
                                           f"{other.source!r} ({state}); wait for that drain")
        self._drains[address] = DrainCopy(address, generation, plan, {t: generations[t] for t in targets},
                                          now)
        return True

    def reported(self, source: str, in_sync: Mapping[str, int], current: Callable[[str, int], bool]
                 ) -> DrainCopy | None:
        """`source`'s heartbeat reports the targets holding their copies (address -> generation): the
        drain, when every target of it has caught up and it is not switched yet (the caller switches it)."""
        drain = self._drains.get(source)
        if drain is None or drain.switched_at:
            return None
        held = {t for t, g in drain.targets.items() if in_sync.get(t) == g and current(t, g)}
        drain = self._drains[source] = dataclasses.replace(drain, caught_up=drain.caught_up | held)
        return drain if drain.caught_up == frozenset(drain.targets) else None

    def switch(self, source: str, layout: Layout, version: int) -> Layout:
        """The layout that makes the drain: the plan's, under `version`, when every target caught up and
        `layout` (the one in force) is still the plan's (InvalidArgumentError otherwise, nothing changed)."""
        drain = self._drains.get(source)
        if drain is None:
            raise InvalidArgumentError(f"switch of the drain of {source!r}: no drain of it is in progress")
        if drain.switched_at:
            raise InvalidArgumentError(f"switch of the drain of {source!r}: switched already at layout "
                                       f"version {drain.switched_at}")
        behind = sorted(set(drain.targets) - drain.caught_up)
        if behind:
            raise InvalidArgumentError(f"switch of the drain of {source!r}: targets {behind} have not "
                                       "caught up")
        if layout.version != drain.plan.before.version:
            raise InvalidArgumentError(f"switch of the drain of {source!r}: planned at layout version "
                                       f"{drain.plan.before.version}, the layout is version {layout.version}")
        if version <= layout.version:
            raise InvalidArgumentError(f"switch of the drain of {source!r}: version {version}, expected "
                                       f"above {layout.version}")
        self._drains[source] = dataclasses.replace(drain, switched_at=version)
        return dataclasses.replace(drain.plan.after, version=version)

    def took(self, target: str, reported_layout: int) -> list[DrainCopy]:
        """`target` routes by `reported_layout`: the switched drains whose every target did so are done and
        leave the views."""
        done = []
        for source, drain in list(self._drains.items()):
            if drain.switched_at and target in drain.targets and reported_layout >= drain.switched_at:
                drain = self._drains[source] = dataclasses.replace(drain, taken=drain.taken | {target})
                if drain.taken == frozenset(drain.targets):
                    done.append(self._drains.pop(source))
        return done

    def gone(self, address: str) -> list[DrainCopy]:
        """The process at `address` died, left or was replaced: the drains still copying from or to it roll
        back (the layout never named their targets); a switched one is complete, and nothing is left to copy
        from a source gone (its targets took over, or a failover of a target is what replicas are for)."""
        ended = [d for d in self._drains.values()
                 if not d.switched_at and (address == d.source or address in d.targets)]
        for d in ended:
            del self._drains[d.source]
        for d in [d for d in self._drains.values() if d.switched_at and address == d.source]:
            del self._drains[d.source]
        return ended

    def stale(self, layout_version: int) -> list[DrainCopy]:
        """A new layout came in force under drains still copying (a failover, a rebalance): their plans
        are of a layout gone, and roll back."""
        ended = [d for d in self._drains.values()
                 if not d.switched_at and d.plan.before.version != layout_version]
        for d in ended:
            del self._drains[d.source]
        return ended

    def get(self, source: str) -> DrainCopy | None:
        return self._drains.get(source)

    def copies_from(self, source: str) -> dict[str, tuple[frozenset[SliceKey], frozenset[int]]]:
        """What `source` copies to each target now (its views' part): the slices, and the row partitions."""
        drain = self._drains.get(source)
        if drain is None:
            return {}
        return {t: (drain.slices_to(t), drain.partitions_to(t)) for t in drain.targets}

    def all(self) -> tuple[DrainCopy, ...]:
        return tuple(self._drains[s] for s in sorted(self._drains))


def _index(layout: Layout, address: str, what: str) -> int:
    try:
        return layout.servers.index(address)
    except ValueError:
        raise InvalidArgumentError(f"{what}: got {address!r}, the layout (version {layout.version}) has "
                                   f"servers {list(layout.servers)}") from None
