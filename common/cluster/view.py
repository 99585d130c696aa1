"""What every node knows of the cluster: roles, node states, nodes and the versioned cluster view.

Shared by the scheduler (which decides them), the parameter servers (which follow them for the sync
quorum) and the workers. Pure types: no grpc, no environment. The wire form is in `pshard.common.wire.codec`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Protocol

from pshard.common.types import SliceKey

ROLES = ("scheduler", "ps", "chief", "worker", "evaluator")
# The data-parallel ranks: they push gradients and form the sync quorum.
TRAINER_ROLES = ("chief", "worker")
# Workers and the chief are the data-parallel ranks and share one rank space; a chief without a
# rank hint asks for rank 0, so the chief comes first as in ClusterSpec.worker_ids.
RANK_SPACE = {"scheduler": "scheduler", "ps": "ps", "chief": "worker", "worker": "worker",
              "evaluator": "evaluator"}


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: tests advance it instead of sleeping."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"advance: got {seconds} s, a clock cannot go backwards")
        self._now += seconds


class NodeState(enum.Enum):
    LIVE = "live"
    DEAD = "dead"  # silent for longer than the heartbeat timeout
    LEFT = "left"  # left on purpose (finished)


@dataclass(frozen=True)
class Node:
    node_id: str
    role: str
    rank: int
    address: str
    state: NodeState
    # Generation of the view in which this incarnation registered: the fencing stamp.
    generation: int
    # Progress the node last reported (a worker's clock).
    clock: int = 0


@dataclass(frozen=True)
class ServerLoss:
    """A parameter server whose slices and row partitions the scheduler could not fail over (no live
    backup held an in-sync copy of them): they are lost, with every update they received."""

    address: str
    layout_version: int  # the layout in which it still serves them
    reason: str  # why no failover was possible, as the scheduler logged it


@dataclass(frozen=True)
class PartitionCopy:
    """A row partition its server (`source`) copies to `target`, a server that is not a backup of its own,
    before a move switches it there (issue 20, `pshard rebalance`): the source forwards the partition's
    rows to the target as to a backup until the target reports it holds them."""

    partition: int
    source: str  # addresses
    target: str
    switched_at: int = 0  # the layout version that switched it to `target` (0: still copying)


@dataclass(frozen=True)
class SliceCopy:
    """Dense slices their server (`source`) copies to `target`, a server that is not a backup of its own,
    before a drain without replicas switches them there (issue 20): the source forwards their states, then
    their steps, as to a joiner until the target holds them."""

    source: str  # addresses
    target: str
    slices: frozenset[SliceKey]
    switched_at: int = 0  # the layout version that switched them to `target` (0: still copying)


@dataclass(frozen=True)
class ClusterView:
    generation: int
    nodes: tuple[Node, ...] = ()
    layout_version: int = 0
    # The servers the job lost: a worker whose step needs one fails at once instead of waiting for a
    # failover that will never come (pshard.common.cluster.losses).
    lost: tuple[ServerLoss, ...] = ()
    copies: tuple[PartitionCopy, ...] = ()
    slice_copies: tuple[SliceCopy, ...] = ()

    def copies_from(self, source: str) -> dict[str, frozenset[int]]:
        """The partitions `source` copies to each target (the switched ones too: their targets take them
        over from the copy once they learn the layout that switched them)."""
        out: dict[str, frozenset[int]] = {}
        for c in self.copies:
            if c.source == source:
                out[c.target] = out.get(c.target, frozenset()) | {c.partition}
        return out

    def slice_copies_from(self, source: str) -> tuple[dict[str, frozenset[SliceKey]], list[str]]:
        """({target: the slices `source` copies to it}, the targets whose copies are switched)."""
        copies = {c.target: c.slices for c in self.slice_copies if c.source == source}
        return copies, [c.target for c in self.slice_copies if c.source == source and c.switched_at]

    def node(self, node_id: str) -> Node | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def live(self, *roles: str) -> tuple[Node, ...]:
        """LIVE nodes of the given roles (all roles when none given), in rank order."""
        return tuple(n for n in self.nodes if n.state is NodeState.LIVE and (not roles or n.role in roles))

    def live_workers(self) -> dict[str, int]:
        """{node_id: generation} of the LIVE chief and workers: the sync quorum and its fencing stamps."""
        return {n.node_id: n.generation for n in self.live(*TRAINER_ROLES)}


class ServerIncarnations:
    """Each other parameter server's generation as the views show it, by address. A generation that
    changes is a new process at the same address: whatever its old incarnation held is gone."""

    def __init__(self, own_address: str) -> None:
        self._own = own_address
        self.generations: dict[str, int] = {}

    def restarted(self, view: ClusterView) -> list[str]:
        """Note `view`'s servers; the addresses whose incarnation changed since the last view."""
        changed = []
        for node in view.nodes:
            if node.role != "ps" or not node.address or node.address == self._own:
                continue
            before = self.generations.get(node.address)
            self.generations[node.address] = node.generation
            if before is not None and before != node.generation:
                changed.append(node.address)
        return changed


@dataclass(frozen=True)
class Registration:
    node_id: str
    rank: int
    generation: int
    view: ClusterView


