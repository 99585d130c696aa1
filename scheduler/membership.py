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

Limits. Anything a request can ask of the scheduler is bounded (`MembershipLimits`) and checked
before any state moves: a refused request leaves the table, the generation, the barriers, the
layout and the registration budget as they were.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pshard.common.cluster.layout import (
    ITEMSIZE,
    MAX_ROW_PARTITIONS,
    Layout,
    LayoutSlice,
    ParamSpec,
    plan_layout,
)
from pshard.common.cluster.loads import WINDOW_S, Counters, LoadMeter, partition_loads
from pshard.common.cluster.losses import serves
from pshard.common.cluster.moves import NowhereToMoveError, plan_drain, plan_join
from pshard.common.cluster.replicas import (
    NoInSyncCopyError,
    fail_over,
    heir_of,
    index_of,
    joining_backups,
    moved_partitions,
)
from pshard.common.cluster.view import (
    RANK_SPACE,
    ROLES,
    Clock,
    ClusterView,
    MonotonicClock,
    Node,
    NodeState,
    PartitionCopy,
    Registration,
    ServerLoss,
    SliceCopy,
)
from pshard.common.errors import (
    BarrierTimeoutError,
    EmptyRequestError,
    InvalidArgumentError,
    LayoutConflictError,
    NodeLeftError,
    QuotaExceededError,
    StaleGenerationError,
    UnknownNodeError,
    quote,
)
from pshard.scheduler.drain_copies import DrainCopies, DrainCopy
from pshard.scheduler.drains import DrainLog
from pshard.scheduler.in_sync import DRAINED, JOINED, LOST, PROMOTED, InSyncCopies
from pshard.scheduler.joins import JoinLog
from pshard.scheduler.partition_copies import PartitionCopies
from pshard.scheduler.partition_moves import MoveLog

log = logging.getLogger("pshard.scheduler")

_SPACE_ORDER = {"scheduler": 0, "ps": 1, "worker": 2, "evaluator": 3}


@dataclass(frozen=True)
class MembershipLimits:
    """What one job may ask of the scheduler. Every limit is checked before any state moves."""

    max_node_id_chars: int = 256
    max_role_chars: int = 32
    max_address_chars: int = 512
    max_barrier_name_chars: int = 256
    # Parameter names in a proposed layout (torch state_dict names are far shorter).
    max_key_chars: int = 1024
    # Nodes in the table, live, dead or left: ranks of dead and departed nodes stay reserved.
    max_members: int = 4096
    # A token bucket on the injected clock. The burst lets every member of a full job re-register at
    # once after a scheduler restart; the rate only stops a client that registers in a loop.
    registrations_per_minute: float = 6000.0
    registration_burst: int = 4096
    # Generations and clocks from the wire. 2**62 is beyond any real count (a change every
    # microsecond for 146,000 years) and leaves 2**62 increments before the uint64 fields (or an
    # int64 in another language) could overflow, so a restarted scheduler that jumps to a node's
    # last_generation still grows monotonically and always fits on the wire.
    max_generation: int = 2**62
    max_clock: int = 2**62
    # Generations kept free above a restarted scheduler's jump (`last_generation`), so no jump can
    # drive later changes past the servers' stamp limit (the same 2**62, common/limits.py): 2**40
    # changes are more than 300 years of registrations at the bucket's full rate.
    generation_headroom: int = 2**40
    # Distinct barrier names (each costs a table entry for the life of the scheduler).
    max_barriers: int = 1024
    # Proposed layouts. Planning runs on the event loop every caller shares and costs about
    # slices x servers steps: 2**22 of them take about half a second on one core.
    max_layout_params: int = 65536
    max_layout_servers: int = 256
    max_layout_slices: int = 65536
    max_layout_work: int = 2**22
    max_dims: int = 32
    max_param_elements: int = 2**48

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise InvalidArgumentError(f"scheduler limit {f.name}: got {value}, expected > 0")

    @staticmethod
    def check_chars(field: str, value: str, limit: int) -> None:
        if len(value) > limit:
            raise InvalidArgumentError(
                f"{field}: got {len(value)} characters ({value[:40]!r}...), expected at most {limit}")

    @staticmethod
    def check_int(field: str, value: int, limit: int) -> None:
        if value > limit:
            raise InvalidArgumentError(f"{field}: got {value}, expected at most {limit}")


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` saved up; time from the injected clock."""

    def __init__(self, rate_per_s: float, burst: int, clock: Clock) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock.now()

    def wait_s(self) -> float:
        """0 when a token is there now; else the seconds until one will be."""
        now = self._clock.now()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self._rate

    def take(self) -> None:
        self._tokens -= 1

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
    layout_version: int = 0  # a server's: the layout it routes by, from its heartbeats' in_sync_layout
    # Registered here after a restart of the scheduler forgot it (it had seen an earlier generation):
    # a server of a job that may have a layout this scheduler has not been given back yet.
    carried_over: bool = False

    def snapshot(self) -> Node:
        return Node(self.node_id, self.role, self.rank, self.address, self.state, self.generation, self.clock)


@dataclass
class _Barrier:
    round: int = 1
    count: int = 0
    arrived: dict[str, None] = dataclasses.field(default_factory=dict)  # ordered set
    released_rounds: int = 0


class Membership:
    def __init__(self, heartbeat_timeout_s: float, clock: Clock | None = None,
                 limits: MembershipLimits | None = None, row_partitions_per_server: int = 1,
                 load_window_s: float = WINDOW_S) -> None:
        """`row_partitions_per_server`: table ids are hashed into that many row partitions per server
        of the first layout, so that a join, a drain or a rebalance can move them one by one
        (pshard.common.cluster.moves); 1 keeps one partition per server, as every older layout.
        `load_window_s`: the servers' loads are rates over about that many seconds of their reports."""
        if heartbeat_timeout_s <= 0:
            raise InvalidArgumentError(f"heartbeat_timeout_s: got {heartbeat_timeout_s}, expected > 0")
        if not 1 <= row_partitions_per_server <= MAX_ROW_PARTITIONS:
            raise InvalidArgumentError(f"row_partitions_per_server: got {row_partitions_per_server}, "
                                       f"expected 1 to {MAX_ROW_PARTITIONS}")
        self.row_partitions_per_server = row_partitions_per_server
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.limits = limits or MembershipLimits()
        self._clock: Clock = clock or MonotonicClock()
        self._registrations = TokenBucket(self.limits.registrations_per_minute / 60,
                                          self.limits.registration_burst, self._clock)
        self._generation = 0
        self._members: dict[str, _Member] = {}
        self._barriers: dict[str, _Barrier] = {}
        self._layout: Layout | None = None
        self.failovers = 0  # primaries promoted (pshard_failovers_total)
        # Servers whose failover was refused, by address, while the layout still routes to them: the
        # views name them so that workers needing them fail at once (pshard.common.cluster.losses).
        self._losses: dict[str, ServerLoss] = {}
        # Which backups hold a full copy of which primary (docs/architecture.md, 9 Failures).
        self.in_sync = InSyncCopies()
        # Server address -> when a live worker last said that server answered it (its heartbeats'
        # reached_servers), and the servers kept live on that word alone though silent to us.
        self._reached: dict[str, float] = {}
        self._vouched: set[str] = set()
        self.vouches = 0  # times a silent server was kept live on the workers' word
        self._isolated = False
        self.isolations = 0  # times this scheduler heard from no live node and so declared none dead
        self.drains = DrainLog()  # for `pshard status`
        self.joins = JoinLog()
        # Each join in progress: the incarnation (address, generation) of the donor it copies from. A new
        # donor (the old one went, or is a new process) means the copy so far is of a state that is gone.
        self._donors: dict[str, tuple[str, int]] = {}
        self.loads = LoadMeter(load_window_s)  # each server's load, from its heartbeats (`pshard rebalance`)
        self.moves = MoveLog()  # partition moves, and every move's duration for the metrics
        self.copies = PartitionCopies()  # moves to servers without a copy, while they catch up
        self.drain_copies = DrainCopies()  # drains without replicas, while their targets catch up

    @property
    def generation(self) -> int:
        return self._generation

    def clock_now(self) -> float:
        return self._clock.now()

    def _bump(self) -> int:
        self._generation += 1
        return self._generation

    # ---- membership ----

    def register(self, role: str, address: str, node_id: str | None = None, rank_hint: int | None = None,
                 last_generation: int = 0, layout: Layout | None = None) -> Registration:
        """Admit a node, or a new incarnation of a known one (which keeps its rank). `layout` (a server
        only): the layout it routes by, adopted when this scheduler has none as new (`_adopt_offered`)."""
        limits = self.limits
        if layout is not None and role != "ps":
            raise InvalidArgumentError(f"layout: offered by role {role!r} (version {layout.version}); only a "
                                       "parameter server offers the layout it routes by")
        limits.check_chars("role", role, limits.max_role_chars)
        limits.check_chars("address", address, limits.max_address_chars)
        limits.check_chars("node_id", node_id or "", limits.max_node_id_chars)
        if not role:
            raise EmptyRequestError("role: got '', expected one of " + ", ".join(ROLES))
        if role not in RANK_SPACE:
            raise InvalidArgumentError(f"role: got {role!r}, expected one of {', '.join(ROLES)}")
        known = self._members.get(node_id) if node_id else None
        if known is not None and RANK_SPACE[known.role] != RANK_SPACE[role]:
            raise InvalidArgumentError(
                f"node {quote(node_id)}: registered as {known.role!r}, now as {role!r}; a node id keeps "
                "its role")
        self._check_jump(node_id, known, last_generation)
        if known is None and len(self._members) >= limits.max_members:
            raise QuotaExceededError(
                f"members: the job has {len(self._members)} (live, dead or left), the limit is "
                f"{limits.max_members}; node {quote(node_id or role)} not admitted")
        wait_s = self._registrations.wait_s()
        if wait_s > 0:
            raise QuotaExceededError(
                f"registrations: more than {limits.registrations_per_minute:g} a minute (burst "
                f"{limits.registration_burst}); retry in {wait_s:.3g} s")
        # Every check passed: from here on the registration happens.
        self._registrations.take()
        # Soft state: after a scheduler restart, continue above what the node has already seen.
        self._generation = max(self._generation, last_generation)
        if known is not None:
            rank = known.rank
        else:
            if role == "chief" and rank_hint is None:
                rank_hint = 0
            rank = self._free_rank(RANK_SPACE[role], rank_hint)
            node_id = node_id or self._new_id(role, rank)
        assert node_id is not None
        if known is not None and role == "ps":
            # A server registering while it is still known is a new process (a new incarnation), even
            # if its death was never noticed: whatever its old one held is gone, so its slices fail
            # over to an in-sync copy before it is live again, and it counts as no one's copy.
            self.fail_over_server(known.address)
            self.in_sync.forget(known.address, "registered again (a new process holds nothing)")
        if role == "ps":
            self.in_sync.forget(address, "registered again (a new process holds nothing)")
            self._copies_gone(address, "registered again (a new process holds nothing of the copy)")
        generation = self._bump()
        self._members[node_id] = _Member(node_id, role, rank, address, NodeState.LIVE, generation,
                                         last_seen=self._clock.now(),
                                         carried_over=known is None and last_generation > 0)
        if role == "ps":
            member = self._members[node_id]
            if layout is not None:
                member.layout_version = layout.version
            self._ring_moved()
            self._join_started(member)
            if layout is not None:
                self._adopt_offered(member, layout)
        return Registration(node_id, rank, generation, self.view())

    def _adopt_offered(self, member: _Member, layout: Layout) -> None:
        """A server's layout, offered as it registers again: after a restart this scheduler knows no
        failover, and planning afresh over servers that route by a later layout split them (issue hlay).
        Adopted through `restore_layout`'s checks when newer than the stored one; a refused offer is
        logged and leaves the registration standing: `propose_layout` still plans nothing fresh."""
        stored = self._layout
        if stored is not None and stored.version >= layout.version:
            return
        try:
            kept, adopted = self.restore_layout(layout)
        except (LayoutConflictError, InvalidArgumentError) as e:
            log.warning("LAYOUT: not adopting layout version %d offered by %s (%s): %s", layout.version,
                        member.node_id, member.address, e)
            return
        if adopted:
            log.warning("LAYOUT: adopted layout version %d from %s (%s), the layout the servers route by "
                        "(this scheduler restarted); generation %d", kept.version, member.node_id,
                        member.address, self._generation)

    def _check_jump(self, node_id: str | None, known: _Member | None, last_generation: int) -> None:
        """A node may carry the scheduler above its generation only when a restart forgot the node, and
        never so high that later changes would pass the servers' stamp limit (issue 23, item 3)."""
        limits = self.limits
        ceiling = limits.max_generation - limits.generation_headroom
        if last_generation > ceiling:
            raise InvalidArgumentError(
                f"last_generation of node {(node_id or '')[:40]!r}: got {last_generation}, expected at most "
                f"{ceiling} (the servers' stamp limit {limits.max_generation} less "
                f"{limits.generation_headroom} generations of headroom)")
        if known is not None and last_generation > self._generation:
            # This scheduler handed the node every generation it saw: a newer one is made up.
            raise InvalidArgumentError(
                f"last_generation of node {known.node_id[:40]!r}: got {last_generation}, expected at most "
                f"{self._generation} (this scheduler's generation; the node registered here already)")
        if self._generation >= limits.max_generation:
            raise StaleGenerationError(
                f"generation: this scheduler is at {self._generation}, the servers' stamp limit "
                f"{limits.max_generation}; no registration can be stamped any more")

    def heartbeat(self, node_id: str, generation: int, clock: int = 0,
                  in_sync: Mapping[str, int] | None = None, in_sync_layout: int = 0,
                  reached: Sequence[str] = ()) -> ClusterView:
        """`in_sync` (a server with replicas): its backups holding all the slices layout version
        `in_sync_layout` makes it primary of, by address, with the generation of each one's
        incarnation. A report on an older layout than the current one is ignored. `reached` (a
        worker): the servers that answered it within the last heartbeat timeout (see `expire`)."""
        limits = self.limits
        limits.check_int(f"node {quote(node_id)} heartbeat clock", clock, limits.max_clock)
        in_sync = in_sync or {}
        limits.check_int(f"node {quote(node_id)} in-sync backups", len(in_sync), limits.max_layout_servers)
        for address in in_sync:
            limits.check_chars("in-sync backup address", address, limits.max_address_chars)
        limits.check_int(f"node {quote(node_id)} reached servers", len(reached), limits.max_layout_servers)
        for address in reached:
            limits.check_chars("reached server address", address, limits.max_address_chars)
        member = self._current(node_id, generation, "heartbeat")
        member.last_seen = self._clock.now()
        member.clock = clock
        if member.role != "ps" and reached:
            servers = {m.address for m in self._members.values() if m.role == "ps"}
            for address in reached:
                if address in servers:  # a registered server's address: the table stays bounded
                    self._reached[address] = member.last_seen
        if member.role == "ps" and member.node_id in self._vouched:
            self._vouched.discard(member.node_id)
            log.info("HEARD: server %s (%s) reaches the scheduler again", member.node_id, member.address)
        if member.role == "ps":
            member.layout_version = in_sync_layout
        layout = self._layout
        if (member.role == "ps" and layout is not None and layout.replicas
                and in_sync_layout >= layout.version):
            self.in_sync.report(member.address, in_sync, self._is_current, self._ring_backups(member))
            self._join_caught_up(member)
        if member.role == "ps" and layout is not None:
            self._copies_reported(member, in_sync, in_sync_layout)
            self._drain_reported(member, in_sync, in_sync_layout)
        return self.view()

    # ---- joins (docs/architecture.md, 4 Layout: Moving slices and partitions) ----

    def _join_started(self, member: _Member) -> None:
        """A server registering beyond the running job's layout, at the next place in it, joins: it becomes
        the backup of the server before it in ring order (the rule every server applies to views) and
        catches up with its slices through replication before any of them is its own."""
        self._join_rolled_back(member, "registered again (a new process holds nothing of the copy)")
        layout = self._layout
        if layout is None or member.address in layout.servers:
            return
        if member.rank != len(layout.servers):
            log.warning("JOIN: server %s (%s) registered at rank %d, but the running job's next server is "
                        "rank %d (layout version %d): it serves nothing; start it with --task-index %d",
                        member.node_id, member.address, member.rank, len(layout.servers), layout.version,
                        len(layout.servers))
            return
        if not layout.replicas:
            log.warning("JOIN: server %d (%s) registered for the running job, which has no replicas: it "
                        "serves nothing (a join copies through replication; run the job with --replicas 1)",
                        member.rank, member.address)
            return
        self.joins.registered(member.node_id, member.address, self._clock.now())
        donor = self._donor_of(member)
        if donor is not None:
            self._donors[member.node_id] = self._incarnation(layout.servers[donor])
        log.warning("JOIN: server %d (%s) registered for the running job (layout version %d); it catches up "
                    "with server %s's slices as its backup, then takes some of them", member.rank,
                    member.address, layout.version, donor)

    def _donor_of(self, joiner: _Member) -> int | None:
        """The layout's server whose backup `joiner` is in the ring now (its live predecessor)."""
        layout = self._layout
        assert layout is not None
        by_address = {m.address: m for m in self._members.values() if m.role == "ps"}
        for index, address in enumerate(layout.servers):
            member = by_address.get(address)
            if member is not None and member.state is NodeState.LIVE \
                    and joiner.address in self._ring_backups(member):
                return index
        return None

    def _incarnation(self, address: str) -> tuple[str, int]:
        member = next((m for m in self._members.values() if m.role == "ps" and m.address == address), None)
        return address, member.generation if member is not None and member.state is NodeState.LIVE else -1

    def _joins_lost_donors(self) -> None:
        """The ring moved: a join whose donor went (declared dead, left, or a new process of it registered)
        holds a copy of a state that is gone, and its donor's slices went to the donor's old backup (kept
        in sync through the join, `joining_backups`). Rolled back, and started again from the joiner's new
        donor, whose copy it gets from scratch."""
        layout = self._layout
        for member in list(self._members.values()):
            donor = self._donors.get(member.node_id)
            if (donor is None or self.joins.in_progress(member.node_id) is None
                    or self._incarnation(donor[0]) == donor):
                continue
            gone = next((m.state for m in self._members.values() if m.role == "ps" and m.address == donor[0]),
                        None)
            why = {NodeState.DEAD: "was declared dead", NodeState.LEFT: "left"}.get(
                gone, "registered again (a new process holds nothing)") if gone is not None else "went"
            self._join_rolled_back(member, f"lost its donor: {donor[0]} {why}")
            if layout is not None and member.state is NodeState.LIVE:
                self._join_started(member)

    def _join_rolled_back(self, member: _Member, why: str) -> None:
        """A joiner gone before the switch: nothing moved, so the layout in force stays (a roll back)."""
        self._donors.pop(member.node_id, None)
        join = self.joins.rolled_back(member.node_id, self._clock.now(), why)
        if join is not None:
            log.warning("JOIN ROLLED BACK: server %d (%s) %s before it took any slice, %.2f s after it "
                        "registered; the job goes on on layout version %d", member.rank, member.address, why,
                        join.seconds(self._clock.now()), self._layout.version if self._layout else 0)
        for ended in self.joins.gone(member.address, self._clock.now()):
            log.warning("JOIN: server %d (%s) ended unfinished: it %s before its backups held the %d bytes "
                        "it took at layout version %d", member.rank, member.address, why, ended.nbytes,
                        ended.layout_version)

    def _joins_copying(self, donor: _Member, copy_bytes_left: int) -> None:
        """`donor`'s heartbeat counted the bytes its backups lack: a join copying from it has those left."""
        layout = self._layout
        if layout is None:
            return
        for member in list(self._members.values()):
            if self.joins.in_progress(member.node_id) is None:
                continue
            index = self._donor_of(member)
            if index is not None and layout.servers[index] == donor.address:
                self.joins.copying(member.node_id, donor.address, copy_bytes_left)

    def _joins_resumed(self) -> None:
        """A restarted scheduler was given the layout back: a server that registered beyond it meanwhile
        (a join the old scheduler had in progress, or one started since) joins from here, as at its
        registration; its copy goes on, as the donor's backup, whatever the scheduler's restart."""
        layout = self._layout
        for member in list(self._members.values()):
            if (member.role == "ps" and member.state is NodeState.LIVE and layout is not None
                    and member.address not in layout.servers
                    and self.joins.in_progress(member.node_id) is None):
                self._join_started(member)

    def _join_caught_up(self, primary: _Member) -> None:
        """`primary` reported its in-sync backups: a joining server among them holds everything `primary`
        acknowledged, so the slices plan_join takes from `primary` for it switch owner under one new layout
        version, as a drain hands over to a backup. Only from that donor: no other server's state was
        copied to it (plan_join balances the two)."""
        layout = self._layout
        assert layout is not None
        donor = index_of(layout, primary.address)
        if donor is None:
            return
        copies = self.in_sync.of(primary.address)
        for member in list(self._members.values()):
            join = self.joins.in_progress(member.node_id)
            if (join is None or member.state is not NodeState.LIVE or member.address not in copies
                    or member.address in layout.servers or member.rank != len(layout.servers)):
                continue
            plan = plan_join(layout, member.address, self._partition_bytes(layout), live={donor})
            if not plan.moves:
                continue
            new = self.replace_layout(plan.after)
            self._donors.pop(member.node_id, None)
            self._ring_moved()  # the donor's old backup is released: the joiner is its backup now
            # Its backups hold none of what it took yet: they count once it reports them again.
            self.in_sync.reset(member.address, "took slices and row partitions of its donor")
            self.in_sync.changes[JOINED] += 1
            partitions = tuple(sorted(m.item for m in plan.moves if isinstance(m.item, int)))
            join = self.joins.switched(member.node_id, primary.address, len(plan.moves) - len(partitions),
                                       partitions, plan.nbytes, new.version)
            log.warning("JOIN: server %d (%s) took %d slices and row partitions %s (%d bytes) from server "
                        "%d (%s), of which it was an in-sync copy: layout version %d, %.2f s after it "
                        "registered",
                        member.rank, member.address, join.slices, list(partitions), plan.nbytes, donor,
                        primary.address, new.version, join.seconds(self._clock.now()))
            return

    def _joins_backing_up(self, joiner: _Member, copy_bytes_left: int) -> None:
        """`joiner`'s heartbeat: once a backup of it holds what it took, the join is done (a moved slice
        or partition has a backup again), and counted."""
        now = self._clock.now()
        backed_up = bool(self.in_sync.of(joiner.address))
        for join in self.joins.backing_up(joiner.address, joiner.layout_version, copy_bytes_left, backed_up,
                                          now):
            self.moves.joined(join.seconds(now))
            log.warning("JOIN: server %d (%s) is backed up: %s holds the %d slices and row partitions %s it "
                        "took at layout version %d (%d bytes), %.2f s after it registered", joiner.rank,
                        joiner.address, ", ".join(sorted(self.in_sync.of(joiner.address))), join.slices,
                        list(join.partitions), join.layout_version, join.nbytes, join.seconds(now))

    def _partition_bytes(self, layout: Layout) -> list[int]:
        """Each row partition's bytes, as its server last reported them with its heartbeats (0 before it
        did). Reported, not planned: a table's rows are made as ids are first pushed, so only the server
        knows how many a partition holds, and only servers with backups count them, which a join needs."""
        _, sizes = partition_loads(self.loads.loads(), [layout.servers[o] for o in layout.owners()])
        return sizes

    def leave(self, node_id: str, generation: int) -> ClusterView:
        """A node leaves on purpose. A parameter server that serves slices or row partitions is a drain
        (`pshard ps --drain-on-term`): they go to its in-sync backup under a new layout version first,
        as a failover would move them, and the leave is refused with nothing changed while that cannot
        be done (no replicas, or no backup holding a copy yet: NoInSyncCopyError, to retry)."""
        member = self._member(node_id)
        self._check_known_generation(generation, "leave")
        self._check_generation(member, generation, "leave")
        if member.state is not NodeState.LEFT:  # a retried leave changes nothing
            try:
                handed = self._hand_over(member) if member.role == "ps" else None
            except NoInSyncCopyError:
                self.drains.refused(member.node_id, member.address, self._clock.now())
                raise
            member.state = NodeState.LEFT
            self._bump()
            if handed is not None:
                self._install_hand_over(member, handed)
            if member.role == "ps":
                self.in_sync.forget(member.address, "left the cluster")
                self._ring_moved()
                self._join_rolled_back(member, "left")
                self._moves_gone(member.address, "left")
        return self.view()

    def _hand_over(self, member: _Member) -> Layout | None:
        """The layout with everything `member` serves on its first in-sync backup (None: it serves
        nothing). Changes nothing: raises when the leave would lose what it serves."""
        layout = self._layout
        if layout is None and member.carried_over:
            # Letting it go would leave what it serves with no owner once the layout comes back.
            raise NoInSyncCopyError(
                f"leave of server {member.address}: this scheduler restarted and has not been given the "
                "job's layout back yet (the chief or worker-0 does so as it registers again), so what the "
                "server serves cannot be handed over yet")
        me = index_of(layout, member.address) if layout is not None else None
        if layout is None or me is None:
            return None
        slices, partitions = layout.slices_on(me), layout.partitions_on(me)
        if not (slices or partitions):
            return None
        live_addresses = {m.address for m in self._members.values()
                          if m.role == "ps" and m.state is NodeState.LIVE and m is not member}
        live = {i for i, a in enumerate(layout.servers) if a in live_addresses}
        known = {m.address for m in self._members.values()}
        returning = [a for i, a in enumerate(layout.servers) if i != me and a not in known]
        if not live and member.carried_over and returning:
            # A restarted scheduler: the others have not registered again yet, but they will.
            raise NoInSyncCopyError(
                f"leave of server {me} ({member.address}): this scheduler restarted and servers "
                f"{', '.join(returning)} of the layout have not registered again yet")
        if not live:  # no copy can ever come: said at once, not after the drainer's retries
            raise NowhereToMoveError(
                f"leave of server {me} ({member.address}): it is the last live server; its {len(slices)} "
                f"slices and row partitions {list(partitions)} would have no owner")
        if not layout.replicas:
            self._drain_by_copies(member, layout, me, live)
        copies = self.in_sync.of(member.address)
        moved, _ = fail_over(layout, me, live, {i for i, a in enumerate(layout.servers) if a in copies})
        return moved

    def _install_hand_over(self, member: _Member, moved: Layout) -> None:
        before = self._layout
        assert before is not None
        me = before.servers.index(member.address)
        heir = heir_of(before, moved, me)
        new = self.replace_layout(moved)
        self.in_sync.changes[DRAINED] += 1
        if heir is not None:
            self.in_sync.reset(before.servers[heir], "took over a drained server's slices")
        drain = self.drains.handed_over(member.node_id, member.address,
                                        before.servers[heir] if heir is not None else "",
                                        len(before.slices_on(me)), before.partitions_on(me), new.version,
                                        self._clock.now())
        self.moves.drained(drain.seconds(self._clock.now()))
        log.warning("DRAIN: server %d (%s) left; its %d slices and row partitions %s now have server %s (%s) "
                    "as primary (layout version %d), %.2f s after its first ask", me, member.address,
                    len(before.slices_on(me)), list(before.partitions_on(me)), heir,
                    before.servers[heir] if heir is not None else "-", new.version,
                    drain.seconds(self._clock.now()))

    def expire(self) -> list[Node]:
        """Declare DEAD every LIVE node silent for longer than the timeout; returns them.

        Except a server of a job without replicas that a live worker reached within the timeout: cut
        off from the scheduler alone, it is still serving, and there is no copy to fail over to, so
        declaring it dead would only kill the job (docs/architecture.md, 9 Failures). With replicas
        the silent server is failed over: its lease has run out by then and it takes no write."""
        if self._cut_off():
            return []
        deadline = self._clock.now() - self.heartbeat_timeout_s
        silent = [m for m in self._members.values() if m.state is NodeState.LIVE and m.last_seen < deadline]
        dead = [m for m in silent if not self._served(m, deadline)]
        for member in dead:
            member.state = NodeState.DEAD
        if dead:
            self._bump()
        for member in dead:
            if member.role == "ps":
                self.fail_over_server(member.address)
        for member in dead:
            if member.role == "ps":
                self.in_sync.forget(member.address, "was declared dead")
                self._join_rolled_back(member, "was declared dead")
                self._moves_gone(member.address, "was declared dead")
        if any(m.role == "ps" for m in dead):
            self._ring_moved()
        return [m.snapshot() for m in dead]

    def _cut_off(self) -> bool:
        """Heard from none of two or more live nodes for half the timeout: this scheduler's own host is
        the one cut off (they cannot all have died at once), so it declares none dead; they stay live and
        each gets a whole timeout to be heard again once one is (docs/architecture.md, 9 Failures)."""
        now = self._clock.now()
        live = [m for m in self._members.values() if m.state is NodeState.LIVE]
        if len(live) >= 2 and all(m.last_seen < now - self.heartbeat_timeout_s / 2 for m in live):
            if not self._isolated:
                self._isolated = True
                self.isolations += 1
                log.warning("ISOLATED: heard from none of the %d live nodes for %.1f s; this scheduler's own "
                            "link is suspect, so it declares none dead until one is heard again", len(live),
                            now - max(m.last_seen for m in live))
            return True
        if self._isolated:
            self._isolated = False
            for m in live:  # the silence was ours: each gets a whole timeout from now
                m.last_seen = max(m.last_seen, now)
            log.warning("ISOLATED no more: a node was heard again; the others have %g s to be",
                        self.heartbeat_timeout_s)
        return False

    def _served(self, member: _Member, deadline: float) -> bool:
        """A silent server kept live: no replicas, and a live worker reached it since `deadline`."""
        layout = self._layout
        if member.role != "ps" or (layout is not None and layout.replicas):
            return False
        if self._reached.get(member.address, -float("inf")) < deadline:
            self._vouched.discard(member.node_id)
            return False
        if member.node_id not in self._vouched:
            self._vouched.add(member.node_id)
            self.vouches += 1
            log.warning("UNHEARD: server %s (%s) silent to the scheduler for %.1f s, but workers reached it "
                        "within the last %g s: kept live (it is serving, and the job has no replica to fail "
                        "over to)", member.node_id, member.address, self._clock.now() - member.last_seen,
                        self.heartbeat_timeout_s)
        return True

    def _ps_by_rank(self) -> dict[int, _Member]:
        return {m.rank: m for m in self._members.values() if m.role == "ps"}

    def _ring_backups(self, primary: _Member) -> frozenset[str]:
        """`primary`'s backups now: the rule each server applies to the views it gets (ranks in ring
        order, the next `replicas` live ones; ps_server/replication/link.py), and the joiners copying from
        it beside its backups among the layout's servers (`joining_backups`)."""
        layout = self._layout
        if layout is None or not layout.replicas:
            return frozenset()
        servers = self._ps_by_rank()
        live = {r for r, m in servers.items() if m.state is NodeState.LIVE} | {primary.rank}
        kept, joining = joining_backups(primary.rank, max(servers) + 1, layout.replicas, live,
                                        len(layout.servers))
        return frozenset(servers[r].address for r in (*kept, *joining))

    def _is_current(self, address: str, generation: int) -> bool:
        """A live server's present incarnation is at `address` with `generation`."""
        return any(m.role == "ps" and m.address == address and m.generation == generation
                   and m.state is NodeState.LIVE for m in self._members.values())

    def _ring_moved(self) -> None:
        """Servers joined or went: each primary drops its copies on servers no longer its backups, and a
        join whose donor went starts again."""
        by_address = {m.address: m for m in self._members.values() if m.role == "ps"}
        for primary in self.in_sync.primaries():
            member = by_address.get(primary)
            self.in_sync.keep_only(primary, self._ring_backups(member) if member is not None else ())
        self._joins_lost_donors()

    def silent_for(self, node_id: str) -> float:
        """Seconds since the node was last heard from (for logs)."""
        return self._clock.now() - self._member(node_id).last_seen

    def view(self) -> ClusterView:
        nodes = sorted(self._members.values(), key=lambda m: (_SPACE_ORDER[RANK_SPACE[m.role]], m.rank))
        return ClusterView(self._generation, tuple(m.snapshot() for m in nodes),
                           self._layout.version if self._layout else 0, tuple(self._losses.values()),
                           (*self.copies.view(), *self._drain_partition_copies()), self._drain_slice_copies())

    def live_workers(self) -> dict[str, int]:
        return self.view().live_workers()

    def node(self, node_id: str) -> Node:
        return self._member(node_id).snapshot()

    def _member(self, node_id: str) -> _Member:
        self.limits.check_chars("node_id", node_id, self.limits.max_node_id_chars)
        member = self._members.get(node_id)
        if member is None:
            raise UnknownNodeError(
                f"node {quote(node_id)}: not registered (the scheduler may have restarted); register again")
        return member

    def _current(self, node_id: str, generation: int, what: str) -> _Member:
        """The node's LIVE incarnation stamped `generation`, or the error that tells it to re-register."""
        member = self._member(node_id)
        self._check_known_generation(generation, what)
        self._check_generation(member, generation, what)
        if member.state is NodeState.DEAD:
            raise UnknownNodeError(
                f"node {quote(node_id)}: declared dead (silent for more than "
                f"{self.heartbeat_timeout_s:g} s); register again")
        if member.state is NodeState.LEFT:
            raise NodeLeftError(f"node {quote(node_id)}: has left the cluster; register again to rejoin")
        return member

    def _check_known_generation(self, generation: int, what: str) -> None:
        # No incarnation can carry a generation this scheduler has not reached: a malformed request,
        # not a stale node (an unknown node, as after a scheduler restart, is told to re-register first).
        if generation > self._generation:
            raise InvalidArgumentError(
                f"{what} generation: got {generation}, expected at most {self._generation} "
                "(the scheduler's current generation)")

    @staticmethod
    def _check_generation(member: _Member, generation: int, what: str) -> None:
        if generation < member.generation:
            raise StaleGenerationError(
                f"node {quote(member.node_id)}: {what} from generation {generation}, but its current "
                f"incarnation is generation {member.generation}")
        if generation > member.generation:
            raise StaleGenerationError(
                f"node {quote(member.node_id)}: {what} from generation {generation}, which is not an "
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
        limits = self.limits
        limits.check_chars("barrier name", name, limits.max_barrier_name_chars)
        if not name:
            raise EmptyRequestError("barrier name: got '', expected a name")
        if count < 1:
            raise InvalidArgumentError(f"barrier {quote(name)} count: got {count}, expected >= 1")
        # More than the job can ever have would never release: refuse now rather than time out.
        limits.check_int(f"barrier {quote(name)} count", count, limits.max_members)
        self._member(node_id)
        if name not in self._barriers and len(self._barriers) >= limits.max_barriers:
            raise QuotaExceededError(
                f"barriers: {len(self._barriers)} names in use, the limit is {limits.max_barriers}; "
                f"barrier {quote(name)} not opened")
        barrier = self._barriers.setdefault(name, _Barrier())
        if barrier.arrived and count != barrier.count:
            raise InvalidArgumentError(
                f"barrier {quote(name)} round {barrier.round}: {quote(node_id)} expects count {count}, but "
                f"{quote(next(iter(barrier.arrived)))} opened it with count {barrier.count}")
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
            f"barrier {quote(name)} round {round_}: {len(arrived)} of {count} arrived within "
            f"{waited_s:.3g} s "
            f"({', '.join(arrived)}); not arrived: {', '.join(missing) or 'no other registered node'}")

    # ---- layout ----

    def check_layout_request(self, params: int, servers: Sequence[str]) -> None:
        """Counts and server addresses of a ProposeLayout, checked before its params are decoded."""
        limits = self.limits
        limits.check_int("layout params", params, limits.max_layout_params)
        limits.check_int("layout servers", len(servers), limits.max_layout_servers)
        for i, server in enumerate(servers):
            limits.check_chars(f"layout server {i}", server, limits.max_address_chars)

    def plan(self, params: Sequence[ParamSpec], servers: Sequence[str], slice_bytes: int,
             replicas: int = 0) -> Layout:
        """`plan_layout` once the request is known to stay within the limits (planning is CPU-bound)."""
        self.check_layout_request(len(params), servers)
        limits = self.limits
        slices = 0
        for p in params:
            limits.check_chars("param key", p.key, limits.max_key_chars)
            limits.check_int(f"param {quote(p.key)} dims", len(p.shape), limits.max_dims)
            limits.check_int(f"param {quote(p.key)} elements", p.numel, limits.max_param_elements)
            # As plan_layout cuts it: at least one piece per server once a tensor is split.
            per_slice = max(1, slice_bytes // ITEMSIZE[p.dtype])
            parts = max(1, -(-p.numel // per_slice))
            slices += max(parts, min(len(servers), p.numel)) if parts > 1 else 1
        limits.check_int(f"layout slices (slice_bytes {slice_bytes})", slices, limits.max_layout_slices)
        limits.check_int(f"layout slices x servers ({slices} x {len(servers)})", slices * len(servers),
                         limits.max_layout_work)
        per_server = self.row_partitions_per_server
        return plan_layout(params, servers, slice_bytes, replicas,
                           row_partitions=len(servers) * per_server if per_server > 1 else None)

    def propose_layout(self, layout: Layout) -> tuple[Layout, bool]:
        """Store the first proposal (with the next version); later ones must describe the same params.

        Returns the stored layout and whether this proposal created it.
        """
        if self._layout is not None:
            difference = self._layout.same_params(layout)
            if difference is not None:
                raise LayoutConflictError(f"layout version {self._layout.version}: {difference}")
            return self._layout, False
        held = self.held_layout()
        if held is not None:
            raise LayoutConflictError(
                f"layout: server {held.node_id[:40]!r} at {held.address[:80]!r} routes by layout version "
                f"{held.layout_version}, and this scheduler (restarted) has none; a fresh plan (version 1) "
                "would split the servers: the layout comes back from the servers or the chief")
        self._layout = dataclasses.replace(layout, version=self._next_layout_version())
        self._bump()
        return self._layout, True

    def held_layout(self) -> _Member | None:
        """With no layout stored: the live server reporting the newest layout it routes by (None when
        none holds one). A restarted scheduler waits for that layout to come back instead of planning."""
        if self._layout is not None:
            return None
        holders = [m for m in self._members.values()
                   if m.role == "ps" and m.state is NodeState.LIVE and m.layout_version > 0]
        return max(holders, key=lambda m: m.layout_version, default=None)

    def restore_layout(self, layout: Layout) -> tuple[Layout, bool]:
        """A member's copy of the job's layout, after a scheduler restart forgot it: kept, with its
        version and failed-over slices, when newer than the stored one. Returns the stored layout and
        whether it was this one."""
        stored = self._layout
        if stored is not None:
            difference = stored.same_params(layout)
            if difference is not None:
                raise LayoutConflictError(f"layout version {stored.version}: {difference}")
            if layout.version <= stored.version:
                return stored, False
        self.limits.check_int("restored layout version", layout.version, self.limits.max_generation)
        bad = next((sl for sl in layout.slices if sl.server >= len(layout.servers)), None)
        owners_ok = not layout.row_owners or (len(layout.servers) <= len(layout.row_owners)
                                              <= MAX_ROW_PARTITIONS
                                              and max(layout.row_owners) < len(layout.servers))
        if (bad is not None or not owners_ok or layout.version < 1
                or not layout.replicas < max(1, len(layout.servers))):
            raise InvalidArgumentError(
                f"restored layout version {layout.version}: {len(layout.servers)} servers, replicas "
                f"{layout.replicas}" + (f", slice {quote(bad.key)} on server {bad.server}" if bad else ""))
        self._check_servers_hold(layout)
        self._layout = layout
        self._keep_losses_served()
        self._bump()
        self._joins_resumed()
        return layout, True

    def _check_servers_hold(self, layout: Layout) -> None:
        """A restore must agree with the servers (issue 23, item 5): each registered server at its
        rank's place in the list, and a version no newer than the newest one a live server reports
        routing by (with its heartbeats). Until a server has reported, nothing can be checked: refused,
        and the member tries again at its next look. A server ranked beyond the list is a joiner whose
        switch the layout has not made: it serves nothing by it, and joins once it is restored."""
        servers = [m for m in self._members.values() if m.role == "ps"]
        for member in servers:
            if member.rank >= len(layout.servers):
                continue
            listed = layout.servers[member.rank]
            if listed != member.address:
                raise LayoutConflictError(
                    f"restored layout version {layout.version}: servers[{member.rank}] is {listed!r}, but "
                    f"{member.node_id[:40]!r} registered at {member.address[:80]!r} with rank {member.rank}")
        held = max((m.layout_version for m in servers if m.state is NodeState.LIVE), default=0)
        if layout.version > held:
            raise LayoutConflictError(
                f"restored layout version {layout.version}: newer than any live server holds (newest "
                f"reported: version {held}); a restore must come from a layout the servers route by")

    def replace_layout(self, layout: Layout) -> Layout:
        """Install a re-planned layout (e.g. after the server set changed) under a new version."""
        self._layout = new = dataclasses.replace(layout, version=self._next_layout_version())
        self._keep_losses_served()
        for copy in self.copies.not_owned(lambda p: new.servers[new.row_owner(p)]):
            log.warning("MOVE ROLLED BACK: row partition %d from %s to %s: layout version %d gives it to %s",
                        copy.partition, copy.source, copy.target, new.version, new.servers[new.row_owner(
                            copy.partition)])
        for drain in self.drain_copies.stale(new.version):
            self._drain_rolled_back(drain, f"layout version {new.version} came in force under its plan")
        self._bump()
        return self._layout

    def layout(self) -> Layout | None:
        return self._layout

    def fail_over_server(self, address: str) -> tuple[LayoutSlice, ...]:
        """Promote the backups of the server at `address` (docs/architecture.md, 9 Failures): with
        replicas, its slices move to the next live server in ring order under a new layout version.
        Returns the slices that moved (none without replicas, or when it held none)."""
        layout = self._layout
        dead = index_of(layout, address) if layout is not None else None
        if layout is None or dead is None or layout.replicas == 0:
            return ()
        live_addresses = {m.address for m in self._members.values()
                          if m.role == "ps" and m.state is NodeState.LIVE and m.address != address}
        live = {i for i, a in enumerate(layout.servers) if a in live_addresses}
        copies = self.in_sync.of(address)
        in_sync = {i for i, a in enumerate(layout.servers) if a in copies}
        try:
            moved_layout, moved = fail_over(layout, dead, live, in_sync)
        except NoInSyncCopyError as e:
            # Never promote a copy that may lack acknowledged updates: the job must fail, naming them.
            self.in_sync.changes[LOST] += 1
            log.error("FAILOVER IMPOSSIBLE: server %d (%s) is gone and %s; those slices and their updates "
                      "are lost, and workers needing them fail", dead, address, e)
            self._lose(address, layout, str(e))
            return ()
        except InvalidArgumentError as e:
            log.error("cannot fail over %s: %s; its slices are lost", address, e)
            self._lose(address, layout, str(e))
            return ()
        heir = heir_of(layout, moved_layout, dead)
        if heir is not None:
            new = self.replace_layout(moved_layout)
            self.failovers += 1
            self.in_sync.changes[PROMOTED] += 1
            # The heir's backups hold none of its new slices yet: they count once it reports them again.
            self.in_sync.reset(layout.servers[heir], "was promoted to primary of more slices")
            log.warning("FAILOVER: server %d (%s) is gone; its %d slices and table-row partitions %s now "
                        "have server %d (%s) as primary (layout version %d, generation %d)", dead, address,
                        len(moved), sorted(moved_partitions(layout, moved_layout)), heir,
                        layout.servers[heir], new.version, self._generation)
        return moved

    def _lose(self, address: str, layout: Layout, reason: str) -> None:
        """Name the server in the views from now on (a change of the view: a new generation)."""
        self._losses[address] = ServerLoss(address, layout.version, reason)
        self._bump()

    def _keep_losses_served(self) -> None:
        """Forget the losses of servers the layout no longer routes anything to (a re-planned layout)."""
        layout = self._layout
        self._losses = {address: loss for address, loss in self._losses.items()
                        if layout is not None and serves(layout, address)}

    def _next_layout_version(self) -> int:
        return (self._layout.version if self._layout else 0) + 1

    # ---- load and partition moves (issue 20: `pshard rebalance`) ----

    def report_load(self, node_id: str, counters: Counters, copy_bytes_left: int = 0) -> None:
        """A live server's heartbeat counters (after `heartbeat` took its in-sync report): its load, and
        the progress of the moves to it (done once a backup of it is in sync again)."""
        member = self._members.get(node_id)
        if member is None or member.role != "ps" or member.state is not NodeState.LIVE:
            return
        now = self._clock.now()
        self.loads.report(member.address, counters, now)
        # Without replicas a move is done once its target serves it; with them, once it is backed up again.
        backed_up = bool(self.in_sync.of(member.address)) or not (self._layout and self._layout.replicas)
        done = self.moves.progress(member.address, member.layout_version, copy_bytes_left, backed_up, now)
        self._joins_copying(member, copy_bytes_left)
        self._joins_backing_up(member, copy_bytes_left)
        self.copies.copying(member.address, copy_bytes_left)
        for move in done:
            log.warning("MOVE: row partition %d from %s to %s in %.2f s: switched at layout version %d, and "
                        "%s serves its %d bytes%s", move.partition, move.source, move.target,
                        move.seconds(now), move.layout_version, move.target, move.nbytes,
                        ", backed up again" if self._layout and self._layout.replicas else "")

    def move_partition(self, partition: int, target: str, layout_version: int = 0) -> Layout:
        """Row partition `partition` to `target` under a new layout version: a planned failover of that
        partition alone (the workers re-route on the source's PartitionMovedError). An in-sync backup of its
        server holds a copy, so it switches at once; any other live server first gets a catch-up copy of the
        partition from its server, and the switch waits for its in-sync report (`_start_copy`): the layout
        returned is then the one in force, which still has the partition on its server. Changes nothing
        when refused: NoInSyncCopyError while a backup is still copying everything (retry),
        InvalidArgumentError otherwise."""
        layout = self._layout
        what = f"move of row partition {partition} to {target!r}"
        if layout is None:
            raise InvalidArgumentError(f"{what}: the job has no layout yet")
        if layout_version and layout_version != layout.version:
            raise LayoutConflictError(f"{what}: planned with layout version {layout_version}, the layout is "
                                      f"version {layout.version} now; plan again")
        if not 0 <= partition < layout.partition_count:
            raise InvalidArgumentError(f"{what}: got partition {partition}, the layout (version "
                                       f"{layout.version}) has partitions 0 to {layout.partition_count - 1}")
        if target not in layout.servers:
            raise InvalidArgumentError(f"{what}: got target {target!r}, the layout's servers are "
                                       f"{list(layout.servers)}")
        source_index, target_index = layout.row_owner(partition), layout.servers.index(target)
        source = layout.servers[source_index]
        if source_index == target_index:
            raise InvalidArgumentError(f"{what}: server {target_index} serves it already")
        members = {m.address: m for m in self._members.values() if m.role == "ps"}
        if members.get(target) is None or members[target].state is not NodeState.LIVE:
            raise InvalidArgumentError(f"{what}: server {target_index} ({target}) is not live")
        owner = members.get(source)
        if owner is None or owner.state is not NodeState.LIVE:
            raise InvalidArgumentError(f"{what}: server {source_index} ({source}), which serves it, is not "
                                       "live")
        backups = sorted(self._ring_backups(owner)) if layout.replicas else []
        if target not in backups:
            earlier = self.copies.between(source, target)
            if earlier is not None and earlier.partition != partition:
                state = (f"switched at layout version {earlier.switched_at}, not yet taken over"
                         if earlier.switched_at else "still copying")
                raise NoInSyncCopyError(f"{what}: row partition {earlier.partition} is moving from server "
                                        f"{source_index} to server {target_index} already ({state}); one "
                                        "copy between two servers at a time: retry")
            self._start_copy(partition, owner, members[target])
            return layout
        if target not in self.in_sync.of(source):
            raise NoInSyncCopyError(f"{what}: server {target_index} is a backup of server {source_index} "
                                    f"({source}) but does not hold a copy of everything it serves yet; retry")
        new = self._switch(layout, partition, source, target, self._clock.now())
        log.info("MOVING: row partition %d from server %d (%s) to its in-sync backup server %d (%s) at "
                 "layout version %d; generation %d", partition, source_index, source, target_index,
                 target, new.version, self._generation)
        return new

    def _switch(self, layout: Layout, partition: int, source: str, target: str, started: float) -> Layout:
        """Row partition `partition` to `target` under one new layout version."""
        owners = list(layout.owners())
        owners[partition] = layout.servers.index(target)
        row_owners = () if owners == list(range(len(layout.servers))) else tuple(owners)
        new = self.replace_layout(dataclasses.replace(layout, row_owners=row_owners))
        # Its backups hold none of the partition yet: they count once it reports them again.
        self.in_sync.reset(target, f"took over row partition {partition}")
        nbytes = self.loads.load(source).partition_bytes.get(partition, 0)
        self.moves.switched(partition, source, target, new.version, nbytes, started)
        return new

    def _start_copy(self, partition: int, source: _Member, target: _Member) -> None:
        """A move to a server that holds no copy of the partition: the views name the copy, its source
        forwards the partition's rows to the target, and its in-sync report makes the switch
        (`_copies_reported`)."""
        nbytes = self.loads.load(source.address).partition_bytes.get(partition, 0)
        if self.copies.start(partition, (source.address, source.generation),
                             (target.address, target.generation), self._clock.now(), nbytes):
            self._bump()
            log.info("COPYING: row partition %d from %s to %s (not a backup of its server) before it moves; "
                     "generation %d", partition, source.address, target.address, self._generation)

    def _copies_reported(self, member: _Member, in_sync: Mapping[str, int], layout_version: int) -> None:
        """A server's heartbeat: the copies it sends that its report says are caught up switch; the switched
        copies to it that the layout it reports covers are done."""
        layout = self._layout
        for copy in self.copies.caught_up(member.address, in_sync, self._is_current):
            if layout is None or layout.servers[layout.row_owner(copy.partition)] != member.address:
                continue  # a layout that moved it elsewhere rolls the copy back (replace_layout)
            self.copies.switched(copy.partition, self._next_layout_version())  # before the layout's check
            layout = self._switch(layout, copy.partition, copy.source, copy.target, copy.started)
            log.info("MOVING: row partition %d from %s to %s, which caught up with it, at layout version %d "
                     "(%.2f s after the copy began); generation %d", copy.partition, copy.source, copy.target,
                     layout.version, self._clock.now() - copy.started, self._generation)
        if self.copies.taken(member.address, layout_version):
            self._bump()  # the views stop naming the copies: their sources drop what is left of them

    def _copies_gone(self, address: str, why: str) -> None:
        for drain in self.drain_copies.gone(address):
            self._drain_rolled_back(drain, f"{address} {why} before the switch")
        for copy in self.copies.gone(address):
            if copy.switched_at:
                continue  # complete: the layout that switched it stands
            log.warning("MOVE ROLLED BACK: row partition %d stays on %s: %s %s before it held a copy",
                        copy.partition, copy.source, address, why)

    def _moves_gone(self, address: str, why: str) -> None:
        self._copies_gone(address, why)
        for move in self.moves.gone(address, self._clock.now()):
            log.warning("MOVE: row partition %d from %s to %s ended unfinished: %s %s before its backups "
                        "held the partition again", move.partition, move.source, move.target, address, why)

    # ---- drains without replicas (issue 20; scheduler/drain_copies.py) ----

    def _drain_by_copies(self, member: _Member, layout: Layout, me: int, live: set[int]) -> None:
        """A drain of a job without replicas: nothing holds a copy of what `member` serves, so the views
        name targeted copies of it to the servers `plan_drain` spreads it over, and the leave is refused
        (NoInSyncCopyError, to retry) until every target caught up and ONE layout version switched it all
        (`_drain_reported`); the retried leave then finds the server serving nothing."""
        drain = self.drain_copies.get(member.address)
        if drain is None or drain.source_generation != member.generation:
            plan = plan_drain(layout, me, self._partition_bytes(layout), live)
            generations = {m.address: m.generation for m in self._members.values()
                           if m.role == "ps" and m.state is NodeState.LIVE}
            try:
                started = self.drain_copies.start((member.address, member.generation), plan, self._is_current,
                                                  generations, self._clock.now())
            except InvalidArgumentError as err:  # another drain takes or gives this server's items
                raise NoInSyncCopyError(f"leave of server {me} ({member.address}): {err}; retry") from None
            if started:
                self._bump()
                log.info("DRAINING: server %d (%s) without replicas: copying %d slices and row partitions %s "
                         "(%d bytes) to %s before one switch; generation %d", me, member.address,
                         len(layout.slices_on(me)), list(layout.partitions_on(me)), plan.nbytes,
                         ", ".join(sorted({layout.servers[m.target] for m in plan.moves})), self._generation)
            drain = self.drain_copies.get(member.address)
        assert drain is not None
        behind = ", ".join(sorted(set(drain.targets) - drain.caught_up)) or "their targets"
        raise NoInSyncCopyError(
            f"leave of server {me} ({member.address}): the job has no replicas, so its "
            f"{len(drain.plan.moves)} slices and row partitions are being copied to {behind} first "
            f"({drain.nbytes} bytes); it leaves once they all hold them, under one layout switch; retry")

    def _drain_reported(self, member: _Member, in_sync: Mapping[str, int], layout_version: int) -> None:
        """A server's heartbeat: its drain switches once every target holds its copy (its report names
        them, as the incarnations the copies went to); a switched drain whose every target reports the
        switched layout has been taken over, and leaves the views."""
        drain = self.drain_copies.reported(member.address, in_sync, self._is_current)
        layout = self._layout
        if drain is not None and layout is not None:
            try:
                moved = self.drain_copies.switch(member.address, layout, self._next_layout_version())
            except InvalidArgumentError as err:  # a layout that changed under the plan rolls back
                log.warning("DRAIN: server %s not switched: %s", member.address, err)
            else:
                new = self.replace_layout(moved)
                self.in_sync.changes[DRAINED] += 1
                me = layout.servers.index(member.address)
                targets = ", ".join(sorted(drain.targets))
                handed = self.drains.handed_over(member.node_id, member.address, targets,
                                                 len(layout.slices_on(me)), layout.partitions_on(me),
                                                 new.version, self._clock.now())
                self.moves.drained(handed.seconds(self._clock.now()))
                log.warning("DRAIN: server %d (%s)'s %d slices and row partitions %s are switched to %s, "
                            "which hold their copies, at layout version %d, %.2f s after its first ask; "
                            "generation %d", me, member.address, len(layout.slices_on(me)),
                            list(layout.partitions_on(me)), targets, new.version,
                            handed.seconds(self._clock.now()), self._generation)
        if self.drain_copies.took(member.address, layout_version):
            self._bump()  # the views stop naming the copies

    def _drain_rolled_back(self, drain: DrainCopy, why: str) -> None:
        log.warning("DRAIN ROLLED BACK: server %s keeps its %d slices and row partitions: %s", drain.source,
                    len(drain.plan.moves), why)
        self._bump()  # the views stop naming the copies: the sources drop them

    def _drain_slice_copies(self) -> tuple[SliceCopy, ...]:
        return tuple(SliceCopy(d.source, t, d.slices_to(t), d.switched_at)
                     for d in self.drain_copies.all() for t in sorted(d.targets) if d.slices_to(t))

    def _drain_partition_copies(self) -> tuple[PartitionCopy, ...]:
        """A drain's row partitions, copied as a rebalance's (`TableReplication.set_copies`), but switched
        with the drain's slices: never one by one (`_copies_reported` knows only `self.copies`)."""
        return tuple(PartitionCopy(p, d.source, t, d.switched_at) for d in self.drain_copies.all()
                     for t in sorted(d.targets) for p in sorted(d.partitions_to(t)))
