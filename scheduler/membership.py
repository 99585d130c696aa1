"""Cluster membership: who is in, with which rank and generation; barriers; the parameter layout.

Pure: no grpc, no environment, no threads. Time comes from an injected clock, so tests advance a
`ManualClock` instead of sleeping. Methods return decisions (a registration, a view, the nodes
just declared dead, an error to send); the servicer does the I/O and the waiting.

Generations. One counter grows with every change of the view: a registration, a death, a leave,
a layout. A node's incarnation is stamped with the generation of the view it registered in, and
every request from it carries that stamp: anything older is refused (fencing), so a node that was
declared dead cannot act again before it re-registers. The state is soft: a restarted scheduler
starts empty, nodes re-register with the newest generation they saw (`last_generation`), and the
counter jumps above it, so generations stay monotonic across scheduler restarts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pshard.common.errors import (
    BarrierTimeoutError,
    EmptyRequestError,
    InvalidArgumentError,
    LayoutConflictError,
    StaleGenerationError,
    UnknownNodeError,
)
from pshard.common.layout import Layout
from pshard.common.view import (
    RANK_SPACE,
    ROLES,
    Clock,
    ClusterView,
    MonotonicClock,
    Node,
    NodeState,
    Registration,
)

_SPACE_ORDER = {"scheduler": 0, "ps": 1, "worker": 2, "evaluator": 3}

@dataclass(frozen=True)
class BarrierArrival:
    """The round a node joined and whether its arrival released it."""

    name: str
    round: int
    released: bool


@dataclass
class _Member:
    node_id: str
    role: str
    rank: int
    address: str
    state: NodeState
    generation: int
    last_seen: float
    clock: int = 0

    def snapshot(self) -> Node:
        return Node(self.node_id, self.role, self.rank, self.address, self.state, self.generation, self.clock)


@dataclass
class _Barrier:
    round: int = 1
    count: int = 0
    arrived: dict[str, None] = dataclasses.field(default_factory=dict)  # ordered set
    released_rounds: int = 0


class Membership:
    def __init__(self, heartbeat_timeout_s: float, clock: Clock | None = None) -> None:
        if heartbeat_timeout_s <= 0:
            raise InvalidArgumentError(f"heartbeat_timeout_s: got {heartbeat_timeout_s}, expected > 0")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock: Clock = clock or MonotonicClock()
        self._generation = 0
        self._members: dict[str, _Member] = {}
        self._barriers: dict[str, _Barrier] = {}
        self._layout: Layout | None = None

    @property
    def generation(self) -> int:
        return self._generation

    def _bump(self) -> int:
        self._generation += 1
        return self._generation

    # ---- membership ----

    def register(self, role: str, address: str, node_id: str | None = None, rank_hint: int | None = None,
                 last_generation: int = 0) -> Registration:
        """Admit a node, or a new incarnation of a known one (which keeps its rank)."""
        if not role:
            raise EmptyRequestError("role: got '', expected one of " + ", ".join(ROLES))
        if role not in RANK_SPACE:
            raise InvalidArgumentError(f"role: got {role!r}, expected one of {', '.join(ROLES)}")
        # Soft state: after a scheduler restart, continue above what the node has already seen.
        self._generation = max(self._generation, last_generation)
        known = self._members.get(node_id) if node_id else None
        if known is not None:
            if RANK_SPACE[known.role] != RANK_SPACE[role]:
                raise InvalidArgumentError(
                    f"node {node_id!r}: registered as {known.role!r}, now as {role!r}; "
                    "a node id keeps its role")
            rank = known.rank
        else:
            if role == "chief" and rank_hint is None:
                rank_hint = 0
            rank = self._free_rank(RANK_SPACE[role], rank_hint)
            node_id = node_id or self._new_id(role, rank)
        assert node_id is not None
        generation = self._bump()
        self._members[node_id] = _Member(node_id, role, rank, address, NodeState.LIVE, generation,
                                         last_seen=self._clock.now())
        return Registration(node_id, rank, generation, self.view())

    def heartbeat(self, node_id: str, generation: int, clock: int = 0) -> ClusterView:
        member = self._current(node_id, generation, "heartbeat")
        member.last_seen = self._clock.now()
        member.clock = clock
        return self.view()

    def leave(self, node_id: str, generation: int) -> ClusterView:
        member = self._member(node_id)
        self._check_generation(member, generation, "leave")
        if member.state is not NodeState.LEFT:  # a retried leave changes nothing
            member.state = NodeState.LEFT
            self._bump()
        return self.view()

    def expire(self) -> list[Node]:
        """Declare DEAD every LIVE node silent for longer than the timeout; returns them."""
        deadline = self._clock.now() - self.heartbeat_timeout_s
        dead = [m for m in self._members.values() if m.state is NodeState.LIVE and m.last_seen < deadline]
        for member in dead:
            member.state = NodeState.DEAD
        if dead:
            self._bump()
        return [m.snapshot() for m in dead]

    def silent_for(self, node_id: str) -> float:
        """Seconds since the node was last heard from (for logs)."""
        return self._clock.now() - self._member(node_id).last_seen

    def view(self) -> ClusterView:
        nodes = sorted(self._members.values(), key=lambda m: (_SPACE_ORDER[RANK_SPACE[m.role]], m.rank))
        return ClusterView(self._generation, tuple(m.snapshot() for m in nodes),
                           self._layout.version if self._layout else 0)

    def live_workers(self) -> dict[str, int]:
        return self.view().live_workers()

    def node(self, node_id: str) -> Node:
        return self._member(node_id).snapshot()

    def _member(self, node_id: str) -> _Member:
        member = self._members.get(node_id)
        if member is None:
            raise UnknownNodeError(
                f"node {node_id!r}: not registered (the scheduler may have restarted); register again")
        return member

    def _current(self, node_id: str, generation: int, what: str) -> _Member:
        """The node's LIVE incarnation stamped `generation`, or the error that tells it to re-register."""
        member = self._member(node_id)
        self._check_generation(member, generation, what)
        if member.state is NodeState.DEAD:
            raise UnknownNodeError(
                f"node {node_id!r}: declared dead (silent for more than {self.heartbeat_timeout_s:g} s); "
                "register again")
        if member.state is NodeState.LEFT:
            raise UnknownNodeError(f"node {node_id!r}: has left the cluster; register again to rejoin")
        return member

    @staticmethod
    def _check_generation(member: _Member, generation: int, what: str) -> None:
        if generation < member.generation:
            raise StaleGenerationError(
                f"node {member.node_id!r}: {what} from generation {generation}, but its current "
                f"incarnation is generation {member.generation}")
        if generation > member.generation:
            raise StaleGenerationError(
                f"node {member.node_id!r}: {what} from generation {generation}, which is not an "
                f"incarnation of it (current: generation {member.generation})")

    def _free_rank(self, space: str, hint: int | None) -> int:
        # Ranks of dead and departed nodes stay reserved for their ids, so they get them back.
        taken = {m.rank for m in self._members.values() if RANK_SPACE[m.role] == space}
        if hint is not None and hint >= 0 and hint not in taken:
            return hint
        return next(r for r in range(len(taken) + 1) if r not in taken)

    def _new_id(self, role: str, rank: int) -> str:
        node_id, n = f"{role}-{rank}", 1
        while node_id in self._members:
            node_id, n = f"{role}-{rank}.{n}", n + 1
        return node_id

    # ---- barriers ----

    def arrive(self, name: str, count: int, node_id: str) -> BarrierArrival:
        """Count `node_id` in the open round of barrier `name`; the count-th arrival releases it.

        A released barrier starts a new round at its next arrival, so names are reusable
        (a checkpoint barrier every N steps). Arriving twice in one round counts once.
        """
        if not name:
            raise EmptyRequestError("barrier name: got '', expected a name")
        if count < 1:
            raise InvalidArgumentError(f"barrier {name!r} count: got {count}, expected >= 1")
        self._member(node_id)
        barrier = self._barriers.setdefault(name, _Barrier())
        if barrier.arrived and count != barrier.count:
            raise InvalidArgumentError(
                f"barrier {name!r} round {barrier.round}: {node_id!r} expects count {count}, but "
                f"{next(iter(barrier.arrived))!r} opened it with count {barrier.count}")
        barrier.count = count
        barrier.arrived[node_id] = None
        round_ = barrier.round
        if len(barrier.arrived) < count:
            return BarrierArrival(name, round_, released=False)
        barrier.released_rounds = round_
        barrier.round += 1
        barrier.arrived = {}
        return BarrierArrival(name, round_, released=True)

    def barrier_released(self, name: str, round_: int) -> bool:
        barrier = self._barriers.get(name)
        return barrier is not None and barrier.released_rounds >= round_

    def barrier_timeout(self, name: str, round_: int, node_id: str, waited_s: float) -> BarrierTimeoutError:
        """Withdraw `node_id` from the open round and return the error naming who is missing.

        Withdrawing keeps a node that gave up from being counted in a round it is no longer in.
        """
        barrier = self._barriers.get(name) or _Barrier()
        arrived = list(barrier.arrived) if barrier.round == round_ else [node_id]
        count = barrier.count
        if barrier.round == round_:
            barrier.arrived.pop(node_id, None)
        # Who could still come: the other members of the rank spaces of those already waiting.
        spaces = {RANK_SPACE[m.role] for m in (self._members.get(a) for a in arrived) if m}
        missing = [f"{m.node_id} ({m.state.value})" for m in self._members.values()
                   if RANK_SPACE[m.role] in spaces and m.node_id not in arrived]
        return BarrierTimeoutError(
            f"barrier {name!r} round {round_}: {len(arrived)} of {count} arrived within {waited_s:.3g} s "
            f"({', '.join(arrived)}); not arrived: {', '.join(missing) or 'no other registered node'}")

    # ---- layout ----

    def propose_layout(self, layout: Layout) -> tuple[Layout, bool]:
        """Store the first proposal (with the next version); later ones must describe the same params.

        Returns the stored layout and whether this proposal created it.
        """
        if self._layout is not None:
            difference = self._layout.same_params(layout)
            if difference is not None:
                raise LayoutConflictError(f"layout version {self._layout.version}: {difference}")
            return self._layout, False
        self._layout = dataclasses.replace(layout, version=self._next_layout_version())
        self._bump()
        return self._layout, True

    def replace_layout(self, layout: Layout) -> Layout:
        """Install a re-planned layout (e.g. after the server set changed) under a new version."""
        self._layout = dataclasses.replace(layout, version=self._next_layout_version())
        self._bump()
        return self._layout

    def layout(self) -> Layout | None:
        return self._layout

    def _next_layout_version(self) -> int:
        return (self._layout.version if self._layout else 0) + 1
