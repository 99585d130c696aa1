"""The automatic rebalance's adapter in the scheduler (issue 20, item 3): every heartbeat interval the
scheduler's timed loop calls `tick`, which gathers the inputs of the pure decision
(scheduler/auto_rebalance.py) from the membership table, and starts the move it names through
`Membership.move_partition`, the path an operator's `pshard rebalance` takes: a switch at once to an
in-sync backup of the partition's server, a catch-up copy first to any other server. No I/O beyond the
log: the servicer publishes the change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pshard.common.cluster.layout import Layout
from pshard.common.errors import PSError
from pshard.scheduler.auto_rebalance import Decision, RebalancePolicy, decide, still_above
from pshard.scheduler.membership import Membership

log = logging.getLogger("pshard.scheduler")


@dataclass(frozen=True)
class AutoRebalanceStatus:
    """What `pshard status` shows of the policy (sent with each WatchResponse)."""

    enabled: bool
    threshold: float = 0.0
    cooldown_s: float = 0.0
    moves: int = 0  # automatic moves started
    last_move: str = ""  # "row partition P from A to B"; "" before the first
    since_last_move_s: float | None = None  # seconds since it started; None before the first
    eligible_in_s: float = 0.0  # until the cool-down lets the next move start (0: now)
    reason: str = ""  # the last decision's


class AutoRebalancer:
    def __init__(self, membership: Membership, policy: RebalancePolicy) -> None:
        self._members = membership
        self.policy = policy
        self.moves = 0
        self._last_move = ""
        self._last_started: float | None = None
        self._last: Decision | None = None
        self._above_since: float | None = None

    def tick(self) -> bool:
        """Decide once, and start the move decided on; True when one started (the view changed)."""
        layout = self._members.layout()
        if layout is None:
            self._last = Decision(None, "waiting: the job has no layout yet")
            return False
        decision = self._decide(layout)
        self._above_since = still_above(self.policy, decision, self._above_since, self._members.clock_now())
        if decision.move is None:
            if self._last is None or _kind(self._last.reason) != _kind(decision.reason):
                log.debug("auto-rebalance: no move: %s", decision.reason)
            self._last = decision
            return False
        self._last = decision
        move = decision.move
        partition, target = int(move.item), layout.servers[move.target]  # type: ignore[arg-type]
        try:
            after = self._members.move_partition(partition, target, layout.version)
        except PSError as e:  # a backup still copying, a copy of it running: the next tick decides again
            self._last = Decision(None, f"refused: {e}", decision.loads, decision.ratio)
            log.info("auto-rebalance: the move of row partition %d to %s was refused: %s", partition, target,
                     e)
            return False
        now = self._members.clock_now()
        self.moves += 1
        self._members.moves.automatic += 1
        self._last_started = now
        self._last_move = (f"row partition {partition} from {layout.servers[move.source]} to {target}")
        loads = ", ".join(f"{i}: {x:.1f}" for i, x in sorted((decision.loads or {}).items()))
        how = "switched" if after.servers[after.row_owner(partition)] == target else "copying first"
        log.warning("AUTO-REBALANCE: row partition %d from server %d (%s) to server %d (%s), %s at layout "
                    "version %d: loads before (rows/s by server) %s; the hottest at %.2fx the mean, "
                    "threshold %gx; next move not before %g s", partition, move.source,
                    layout.servers[move.source], move.target, target, how, after.version, loads,
                    decision.ratio, self.policy.threshold, self.policy.cooldown_s)
        return True

    def _decide(self, layout: Layout) -> Decision:
        members, now = self._members, self._members.clock_now()
        live = {n.address for n in members.view().live("ps")}
        meter = members.loads
        sampled = {a: meter.sampled_s(a) for a in live}
        return decide(self.policy, layout, meter.loads(), live, sampled, self.busy(layout, live),
                      self._last_move_at(), self._moved_at(), now, self._above_since)

    def busy(self, layout: Layout, live: set[str]) -> str:
        """What is in progress that a move must wait for ("" when nothing)."""
        members = self._members
        for copy in members.copies.in_progress():
            return f"row partition {copy.partition} is copying from {copy.source} to {copy.target}"
        for move in members.moves.all():
            if not move.done:
                return f"row partition {move.partition} moved to {move.target}, whose backups copy it"
        for join in members.joins.all():
            if not join.done:
                return f"server {join.address} is joining"
        for drain in members.drains.all():
            if not drain.done:
                return f"server {drain.address} is draining"
        view = members.view()
        if view.copies:
            return f"row partition {view.copies[0].partition} is switching to {view.copies[0].target}"
        if view.lost:
            return f"server {view.lost[0].address} is lost (its failover was refused)"
        for i, address in enumerate(layout.servers):
            if address not in live and (layout.slices_on(i) or layout.partitions_on(i)):
                return f"server {i} ({address}) serves slices or row partitions and is not live (a failover)"
        return ""

    def _last_move_at(self) -> float | None:
        """When the last move of any kind ended (or this policy's last one started, if later)."""
        members = self._members
        ends = [r.ended for r in (*members.moves.all(), *members.joins.all(), *members.drains.all())
                if r.ended is not None]
        if self._last_started is not None:
            ends.append(self._last_started)
        return max(ends, default=None)

    def _moved_at(self) -> dict[int, float]:
        moved: dict[int, float] = {}
        for m in self._members.moves.all():
            at = m.ended if m.ended is not None else m.started
            moved[m.partition] = max(at, moved.get(m.partition, at))
        return moved

    def status(self) -> AutoRebalanceStatus:
        now = self._members.clock_now()
        last = self._last_move_at()
        eligible = max(0.0, last + self.policy.cooldown_s - now) if last is not None else 0.0
        return AutoRebalanceStatus(
            True, self.policy.threshold, self.policy.cooldown_s, self.moves, self._last_move,
            now - self._last_started if self._last_started is not None else None, eligible,
            self._last.reason if self._last is not None else "no decision yet")


def _kind(reason: str) -> str:
    """A decision's kind (its first word), so the debug log says each change of it once, not every tick."""
    return reason.split(":", 1)[0].split(" ", 1)[0]
