"""The scheduler's automatic rebalance (issue 20, item 3; `pshard scheduler --rebalance-auto X`): the decision
whether to move one row partition now, and which. Pure: the loads, the layout, what is in progress and the
scheduler's clock come in; a `Decision` (the move, or why none) comes out. The scheduler's timed loop
(scheduler/auto_rebalancer.py) gathers the inputs and starts the move through `Membership.move_partition`,
the path `pshard rebalance` takes.

The load is the one `pshard rebalance` weighs: each live server's table rows/s, summed over the row
partitions the layout gives it (`partition_loads`). A move is started only when

- nothing else moves: no partition move, copy, join, drain or unsettled failover (`busy`), since a plan made
  on a layout that is changing would be made on loads that are about to change;
- the cool-down since the last move has passed (`cooldown_s`): its loads settle on the new layout first;
- every live server's load samples span a full window (`window_s`): a server that just started, restarted
  or took a partition has rates over too short a time to act on;
- the hottest live server is above `threshold` times the mean, and has been for a full window of
  decisions (`above_since`: hysteresis; a server's first reports after traffic starts, or after a move,
  may rate it alone while the others' reports are on their way, which moved a partition and moved it back
  two decisions later);
- `plan_rebalance` (the same pure planner) has a move, and its first move lowers the hottest load by at
  least `min_gain` of the mean (hysteresis: no move for noise), and its partition has not moved within the
  cool-down (no ping-pong of one partition between two servers).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.loads import WINDOW_S, ServerLoad, partition_loads
from pshard.common.cluster.moves import Move, plan_rebalance
from pshard.common.errors import InvalidArgumentError
from pshard.scheduler.settings import DEFAULT_LOAD_WINDOW_S, DEFAULT_REBALANCE_COOLDOWN_S

# A move must lower the hottest server's load by this much of the mean load: less is noise, and a move
# is a catch-up copy over the network.
DEFAULT_MIN_GAIN = 0.05


@dataclass(frozen=True)
class RebalancePolicy:
    """The automatic rebalance's settings, parsed once (scheduler/settings.py, the scheduler's flags)."""

    threshold: float  # move when the hottest live server is above threshold x the mean load
    cooldown_s: float = DEFAULT_REBALANCE_COOLDOWN_S  # after a move, before the next one may start
    window_s: float = WINDOW_S  # load samples every live server must span first
    min_gain: float = DEFAULT_MIN_GAIN  # of the mean: what a move must take off the hottest load

    def __post_init__(self) -> None:
        checks = (("threshold", self.threshold, self.threshold >= 1.0, ">= 1.0 (times the mean load)"),
                  ("cooldown_s", self.cooldown_s, self.cooldown_s >= 0, ">= 0"),
                  ("window_s", self.window_s, self.window_s > 0, "> 0"),
                  ("min_gain", self.min_gain, self.min_gain >= 0, ">= 0 (of the mean load)"))
        for name, value, ok, expected in checks:
            if not ok:
                raise InvalidArgumentError(f"rebalance policy {name}: got {value}, expected {expected}")


@dataclass(frozen=True)
class Decision:
    """A move to start, or None and why not (`reason`, for the log and `pshard status`). `loads`: each
    live server's rows/s by layout index, as weighed; `ratio`: the hottest one's over the mean."""

    move: Move | None
    reason: str
    loads: Mapping[int, float] | None = None
    ratio: float = 0.0


def rebalance_policy(threshold: float | None, cooldown_s: float | None,
                     window_s: float = DEFAULT_LOAD_WINDOW_S) -> RebalancePolicy | None:
    """`--rebalance-auto THRESHOLD`, `--rebalance-cooldown SECONDS` and `--load-window-s` as the policy,
    parsed once; None (off) without a threshold."""
    if threshold is None:
        return None
    cooldown = DEFAULT_REBALANCE_COOLDOWN_S if cooldown_s is None else cooldown_s
    return RebalancePolicy(threshold, cooldown_s=cooldown, window_s=window_s)


def decide(policy: RebalancePolicy, layout: Layout, loads: Sequence[ServerLoad], live: Collection[str],
           sampled_s: Mapping[str, float], busy: str, last_move_at: float | None,
           moved_at: Mapping[int, float], now: float, above_since: float | None = None) -> Decision:
    """Whether to move one row partition now. `live`: the live servers' addresses; `sampled_s`: how many
    seconds each server's load samples span; `busy`: what is in progress ("" when nothing); `last_move_at`:
    when the last move ended (None: none yet); `moved_at`: partition -> when it last moved; `above_since`:
    since when every decision found the hottest server above the threshold (None: the last one did not;
    `still_above` keeps it)."""
    if busy:
        return Decision(None, f"waiting: {busy}")
    if last_move_at is not None and now < last_move_at + policy.cooldown_s:
        return Decision(None, f"cooling down: {last_move_at + policy.cooldown_s - now:.1f} s left of the "
                              f"{policy.cooldown_s:g} s after the last move")
    servers = [i for i, a in enumerate(layout.servers) if a in live]
    if len(servers) < 2:
        return Decision(None, f"{len(servers)} live server(s) in the layout: nowhere to move to")
    short = next((i for i in servers if sampled_s.get(layout.servers[i], 0.0) < policy.window_s), None)
    if short is not None:
        address = layout.servers[short]
        return Decision(None, f"sampling: server {short} ({address}) has {sampled_s.get(address, 0.0):.1f} s "
                              f"of load samples, a full window is {policy.window_s:g} s")
    rates, sizes = partition_loads(loads, [layout.servers[o] for o in layout.owners()])
    per_server = _server_loads(layout, rates, servers)
    mean = sum(per_server.values()) / len(per_server)
    if mean <= 0:
        return Decision(None, "idle: no table rows pulled or pushed", per_server)
    hottest = max(servers, key=lambda i: (per_server[i], -i))
    ratio = per_server[hottest] / mean
    if ratio <= policy.threshold:
        return Decision(None, f"balanced: the hottest server {hottest} is at {ratio:.2f}x the mean load, "
                              f"threshold {policy.threshold:g}x", per_server, ratio)
    if above_since is None or now - above_since < policy.window_s:
        held = 0.0 if above_since is None else now - above_since
        return Decision(None, f"rising: the hottest server {hottest} is at {ratio:.2f}x the mean load, above "
                              f"the threshold for {held:.1f} s; a move needs {policy.window_s:g} s of it",
                        per_server, ratio)
    plan = plan_rebalance(layout, rates, sizes, servers, tolerance=policy.threshold, max_moves=1)
    if not plan.moves:
        return Decision(None, f"no single partition move lowers the hottest server {hottest} "
                              f"({ratio:.2f}x the mean load)", per_server, ratio)
    move = plan.moves[0]
    partition = int(move.item)  # type: ignore[arg-type]  # a rebalance moves row partitions only
    since = moved_at.get(partition)
    if since is not None and now < since + policy.cooldown_s:
        return Decision(None, f"row partition {partition} moved {now - since:.1f} s ago: it stays put for "
                              f"the {policy.cooldown_s:g} s cool-down", per_server, ratio)
    gain = _gain(per_server, move, rates[partition]) / mean
    if gain < policy.min_gain:
        return Decision(None, f"the best move (row partition {partition}, server {move.source} to "
                              f"{move.target}) lowers the hottest load by {gain:.3f} of the mean, below the "
                              f"minimum {policy.min_gain:g}", per_server, ratio)
    return Decision(move, f"server {hottest} at {ratio:.2f}x the mean load, threshold {policy.threshold:g}x",
                    per_server, ratio)


def still_above(policy: RebalancePolicy, decision: Decision, above_since: float | None,
                now: float) -> float | None:
    """`above_since` for the next decision: kept (or started now) while decisions weigh the hottest server
    above the threshold, forgotten at one that does not (balanced, or nothing weighed: busy, cooling down,
    sampling), so that a move needs a full window of them after every interruption."""
    if decision.move is not None or decision.ratio <= policy.threshold:
        return None
    return now if above_since is None else above_since


def _server_loads(layout: Layout, rates: Sequence[float], servers: Sequence[int]) -> dict[int, float]:
    loads = dict.fromkeys(servers, 0.0)
    for p, owner in enumerate(layout.owners()):
        if owner in loads:
            loads[owner] += rates[p]
    return loads


def _gain(loads: Mapping[int, float], move: Move, rate: float) -> float:
    """How much the move lowers the hottest load (0 when its source is not the hottest, or it would make
    its target the hottest at as much)."""
    after = dict(loads)
    after[move.source] -= rate
    after[move.target] += rate
    return max(0.0, max(loads.values()) - max(after.values()))
