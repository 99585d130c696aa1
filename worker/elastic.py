"""The shard plan of an elastic job: which samples each worker trains at each clock. Pure: numpy only.

The plan is fixed by the job, not by who is in it (docs/architecture.md, 8 Workers):

- Each epoch shuffles the n samples with the same permutation everywhere (seeded by seed and epoch,
  as `worker.data.shard` does) and cuts it into the *union batches* of its clocks, each
  `world_size x batch_size` samples, where world_size is the number of trainers TF_CONFIG lists (the
  world the job started with). So an epoch always takes the same clocks, whoever trains it.
- At clock t, the trainers live in the scheduler's current view (the sync quorum), ordered by rank,
  split t's union batch: the one at position i of m takes `union[i::m]`. A worker that joins or leaves
  changes m from the next clock on, so the union batch, the learning rate's meaning and the number
  of clocks stay those of the original job; a joined worker makes each clock cheaper for the others.
- With the original world, the piece of rank r at step s of an epoch is exactly batch s of
  `shard(n, r, world, epoch, seed)`, so a job nobody joins trains what it always trained.
- A piece left empty (a short last union batch with fewer samples than trainers) becomes one sample
  of it: every member of a sync quorum must push each clock, or it never completes.
- The view that splits a clock is the `Roster`'s, not the scheduler's latest: a restarted scheduler
  knows only the nodes that registered with it so far, and the workers re-register a few heartbeats
  apart, so for a moment their latest views differed and so did their pieces (issue 23, item 11). A
  node missing from a view (never a departure: a running scheduler keeps dead and departed nodes, and
  says so) keeps its last known state, for as long as the servers wait for it to re-register.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
from pshard.common.cluster.view import TRAINER_ROLES, ClusterView, Node


@dataclass(frozen=True)
class ClockPlan:
    n: int  # training samples
    batch_size: int  # per worker, in the job's original world
    world_size: int  # trainers TF_CONFIG lists: fixes the union batch of a clock
    epochs: int
    seed: int
    max_steps: int = 0  # 0: no limit; else the plan ends at this clock
    _perms: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("n", "batch_size", "world_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 1")
        if self.seed < 0 or self.max_steps < 0:
            raise ValueError(f"seed, max_steps: got {self.seed}, {self.max_steps}; expected >= 0")

    @property
    def union(self) -> int:
        """Samples per clock across all trainers."""
        return self.world_size * self.batch_size

    @property
    def clocks_per_epoch(self) -> int:
        return -(-self.n // self.union)

    @property
    def total_clocks(self) -> int:
        total = self.epochs * self.clocks_per_epoch
        return min(total, self.max_steps) if self.max_steps else total

    def epoch_clocks(self, epoch: int) -> range:
        """The clocks of `epoch` that the plan trains (empty past its end)."""
        first = epoch * self.clocks_per_epoch
        return range(min(first, self.total_clocks), min(first + self.clocks_per_epoch, self.total_clocks))

    def union_batch(self, clock: int) -> np.ndarray:
        if not 0 <= clock < self.total_clocks:
            raise ValueError(f"clock: got {clock}, the plan has clocks 0..{self.total_clocks - 1}")
        epoch, step = divmod(clock, self.clocks_per_epoch)
        perm = self._perms.get(epoch)
        if perm is None:
            # (seed, epoch) as a sequence, as worker.data.shard draws it.
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perms.clear()  # one epoch at a time: a permutation of n indices each
            self._perms[epoch] = perm
        return perm[step * self.union:(step + 1) * self.union]

    def piece(self, clock: int, position: int, members: int) -> np.ndarray:
        """The samples the trainer at `position` of `members` trains at `clock`."""
        if not 0 <= position < members:
            raise ValueError(f"position: got {position}, expected 0 <= position < members={members}")
        union = self.union_batch(clock)
        mine = union[position::members]
        return mine if len(mine) else union[position % len(union):][:1]


def roster_position(view: ClusterView | None, node_id: str, rank: int, static_world: int) -> tuple[int, int]:
    """(position, members) of `node_id` among the live trainers of `view`, in rank order.

    Without a view yet, the static (rank, world). This worker counts itself even when the view
    does not show it live yet (it registered a moment ago): it is about to push this clock.
    """
    if view is None:
        return rank, static_world
    live = [(n.rank, n.node_id) for n in view.live(*TRAINER_ROLES)]
    if node_id not in {nid for _, nid in live}:
        live.append((rank, node_id))
    live.sort()
    return [nid for _, nid in live].index(node_id), len(live)


class Roster:
    """The scheduler's views, merged so that a node a restarted scheduler does not know yet keeps its
    last known state until `grace_s` after it went missing (see the module doc). Offered views come
    from the SchedulerClient's threads, reads from the training loop: the state is locked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self._missing_since: dict[str, float] = {}
        self._latest: ClusterView | None = None

    def offer(self, view: ClusterView, now: float) -> None:
        with self._lock:
            if self._latest is not None and view.generation <= self._latest.generation:
                return
            self._latest = view
            present = {n.node_id for n in view.nodes}
            for node in view.nodes:
                self._nodes[node.node_id] = node
                self._missing_since.pop(node.node_id, None)
            for node_id in self._nodes.keys() - present:
                self._missing_since.setdefault(node_id, now)

    def view(self, now: float, grace_s: float) -> ClusterView | None:
        """The latest view, plus the nodes missing from it for at most `grace_s`; None before any."""
        with self._lock:
            latest = self._latest
            if latest is None:
                return None
            kept = tuple(n for node_id, n in self._nodes.items()
                         if now - self._missing_since.get(node_id, now) <= grace_s)
            return ClusterView(latest.generation, kept, latest.layout_version)
