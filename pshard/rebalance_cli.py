"""`pshard rebalance`: move hot table row partitions off the busiest parameter servers (issue 20).

    pshard rebalance [--scheduler HOST:PORT] [--dry-run] [--threshold 1.2]

Reads each server's load from the scheduler (rows/s per row partition, from the servers' heartbeats), plans
with `plan_rebalance` (pshard.common.cluster.moves: hottest server to coolest, until the hottest is within
--threshold times the mean), prints the plan, and, unless --dry-run, makes the moves one by one (the
MovePartition RPC, a planned failover of one partition; the workers re-route). A backup of the partition's
server holds a copy, so the scheduler switches the partition to it at once; any other server first gets a
catch-up copy of the partition from its server, and the command waits for the switch (GetLayout) before the
next move. Works with and without --replicas; needs more row partitions than servers (`pshard scheduler
--row-partitions-per-server N`); with security on, an admin credential.

`plan_lines` is pure; `main` does the RPCs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pshard.admin import add_scheduler_argument, first_watch, parse_admin_args, rpc_failure, scheduler_stub
from pshard.common.argtypes import positive_float
from pshard.common.cluster.layout import Layout
from pshard.common.cluster.loads import ServerLoad, partition_loads
from pshard.common.cluster.moves import Move, MovePlan, plan_rebalance
from pshard.common.cluster.replicas import NoInSyncCopyError, backups_of
from pshard.common.errors import PSError, PullTimeoutError
from pshard.common.security.credentials import SecurityConfig, add_security_arguments

PROG = "pshard rebalance"
# Between tries of a move its backup cannot take yet, and between reads of the layout while a copy
# catches up: the in-sync reports ride on the servers' heartbeats (every 0.25 s).
_RETRY_S = 0.25
_POLL_S = 0.1


class MoveRolledBackError(PSError):
    """A move's catch-up copy ended before its switch (its source or target went): the layout in force
    stands."""


def threshold_type(text: str) -> float:
    value = float(text)
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"got {text}, expected a number >= 1.0 (times the mean load)")
    return value


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Move hot table row partitions from the busiest "
                                "parameter servers to the coolest, by the rows/s the servers report: a "
                                "move to a backup of the partition's server is made at once, one elsewhere "
                                "after a catch-up copy of the partition to its new server.")
    add_scheduler_argument(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    p.add_argument("--threshold", metavar="X", type=threshold_type, default=1.2,
                   help="move until the hottest server is within X times the mean load (default 1.2)")
    p.add_argument("--max-moves", metavar="N", type=int, default=None,
                   help="plan at most N moves (default: as many as it takes)")
    p.add_argument("--timeout-s", metavar="S", type=positive_float, default=60.0,
                   help="per RPC, and how long a move waits for its new server to hold a copy (default 60)")
    add_security_arguments(p)
    return p


@dataclass(frozen=True)
class Planned:
    plan: MovePlan
    rates: list[float]  # rows/s of each row partition
    live: frozenset[int]
    to_backup: tuple[Move, ...]  # the moves to a backup of the partition's server: made at once
    need_copy: tuple[Move, ...]  # the moves that make a catch-up copy first


def plan(layout: Layout, loads: Sequence[ServerLoad], live_addresses: Collection[str], threshold: float,
         max_moves: int | None = None) -> Planned:
    """The rebalance of `layout` by the servers' `loads`, its moves split by whether the target is a backup
    (in ring order among the live servers) of the partition's server."""
    owners = [layout.servers[o] for o in layout.owners()]
    rates, sizes = partition_loads(loads, owners)
    live = frozenset(i for i, a in enumerate(layout.servers) if a in live_addresses)
    made = plan_rebalance(layout, rates, sizes, live, tolerance=threshold, max_moves=max_moves)
    n = len(layout.servers)
    backup = [m for m in made.moves if m.target in backups_of(m.source, n, layout.replicas, live)]
    return Planned(made, rates, live, tuple(backup), tuple(m for m in made.moves if m not in backup))


def server_loads(layout: Layout, rates: Sequence[float], owners: Sequence[int]) -> list[float]:
    loads = [0.0] * len(layout.servers)
    for p, o in enumerate(owners):
        loads[o] += rates[p]
    return loads


def plan_lines(planned: Planned) -> list[str]:
    """The plan as `pshard rebalance` prints it: each server's load now, each move (which partition, from,
    to, its rows/s and bytes, and whether it can be made), and the load expected after the moves made."""
    layout, rates = planned.plan.before, planned.rates
    now = server_loads(layout, rates, layout.owners())
    owners = list(layout.owners())
    for m in planned.plan.moves:
        owners[m.item] = m.target  # type: ignore[index]  # rebalance moves row partitions only
    after = server_loads(layout, rates, owners)
    counted = [now[i] for i in sorted(planned.live)]
    mean = sum(counted) / len(counted) if counted else 0.0
    lines = [f"layout version {layout.version}: {layout.partition_count} row partitions on "
             f"{len(layout.servers)} servers, mean load {mean:.1f} rows/s", "",
             f"{'SERVER':<24} {'NOW rows/s':>11} {'AFTER rows/s':>13} {'AFTER/MEAN':>10}"]
    for i, address in enumerate(layout.servers):
        if i not in planned.live:
            continue
        ratio = f"{after[i] / mean:.2f}" if mean else "-"
        lines.append(f"{f'{i} {address}':<24} {now[i]:>11.1f} {after[i]:>13.1f} {ratio:>10}")
    if not planned.plan.moves:
        return [*lines, "", "nothing to move: the hottest server is within the threshold, or no single "
                            "partition move lowers it"]
    lines += ["", f"{'PARTITION':>9} {'FROM':<24} {'TO':<24} {'rows/s':>9} {'BYTES':>10}  MOVE"]
    for m in planned.plan.moves:
        how = "to its backup" if m in planned.to_backup else "after a catch-up copy"
        lines.append(f"{m.item:>9} {f'{m.source} {layout.servers[m.source]}':<24} "
                     f"{f'{m.target} {layout.servers[m.target]}':<24} {rates[m.item]:>9.1f} "  # type: ignore[index]
                     f"{m.nbytes:>10}  {how}")
    return lines


def fetch(scheduler: str, timeout_s: float, security: SecurityConfig
          ) -> tuple[Layout, tuple[ServerLoad, ...], frozenset[str]]:
    """The layout, the servers' loads and the live servers' addresses, from the scheduler."""
    from pshard.api.v1 import scheduler_pb2
    from pshard.common.wire.codec import layout_from_proto, load_from_proto, view_from_proto

    with scheduler_stub(scheduler, security) as stub:
        first = first_watch(stub, timeout_s)
        layout = layout_from_proto(stub.GetLayout(scheduler_pb2.GetLayoutRequest(), timeout=timeout_s).layout)
    live = frozenset(n.address for n in view_from_proto(first.view).live("ps"))
    return layout, tuple(load_from_proto(p) for p in first.loads), live


def move(scheduler: str, layout: Layout, moves: Sequence[Move], timeout_s: float, security: SecurityConfig,
         say: Callable[[str], None], now: Callable[[], float] = time.monotonic) -> int:
    """Make `moves` one by one, each planned on the layout the one before made; the moves made. A move with
    a catch-up copy is waited for until its switch."""
    import grpc

    from pshard.api.v1 import scheduler_pb2
    from pshard.common.rpc.status import error_from_rpc_error

    version, made = layout.version, 0
    with scheduler_stub(scheduler, security) as stub:
        for m in moves:
            target = layout.servers[m.target]
            request = scheduler_pb2.MovePartitionRequest(partition=m.item, target=target,  # type: ignore[arg-type]
                                                         layout_version=version)
            started = now()
            while True:
                try:
                    reply = stub.MovePartition(request, timeout=timeout_s)
                except grpc.RpcError as e:
                    err = error_from_rpc_error(e)
                    if isinstance(err, NoInSyncCopyError) and now() - started < timeout_s:
                        time.sleep(_RETRY_S)  # its backup is still copying (a move just before made it so)
                        continue
                    raise err from None
                break
            version = reply.layout_version
            if reply.copying:
                version = _wait_switch(stub, m.item, target, version, started + timeout_s, now)  # type: ignore[arg-type]
            made += 1
            how = "after a catch-up copy" if reply.copying else "to its backup"
            say(f"row partition {m.item}: moved from server {m.source} ({layout.servers[m.source]}) to "
                f"server {m.target} ({target}) {how}, layout version {version}, in {now() - started:.2f} s")
    return made


def _wait_switch(stub: object, partition: int, target: str, version: int, deadline: float,
                 now: Callable[[], float]) -> int:
    """The layout version that switched `partition` to `target` once its catch-up copy is done;
    MoveRolledBackError when the copy ended without it, PullTimeoutError at `deadline`."""
    from pshard.api.v1 import scheduler_pb2
    from pshard.common.wire.codec import layout_from_proto, view_from_proto

    def owner() -> Layout:
        return layout_from_proto(stub.GetLayout(  # type: ignore[attr-defined]
            scheduler_pb2.GetLayoutRequest(), timeout=max(1.0, deadline - now())).layout)

    while True:
        layout = owner()
        if layout.servers[layout.row_owner(partition)] == target:
            return layout.version
        view = view_from_proto(first_watch(stub, max(1.0, deadline - now())).view)  # type: ignore[arg-type]
        if not any(c.partition == partition and c.target == target for c in view.copies):
            layout = owner()  # the copy may have switched and ended between the two reads
            if layout.servers[layout.row_owner(partition)] == target:
                return layout.version
            raise MoveRolledBackError(
                f"move of row partition {partition} to {target}: its catch-up copy ended before the switch "
                f"(its source or target went; the scheduler's log says why); layout version {layout.version} "
                f"has it on {layout.servers[layout.row_owner(partition)]}")
        if now() >= deadline:
            raise PullTimeoutError(
                f"move of row partition {partition} to {target}: its catch-up copy did not finish within "
                f"--timeout-s (layout version {version}); it goes on, see `pshard status`")
        time.sleep(_POLL_S)  # the switch comes with a server's heartbeat


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args, scheduler, security = parse_admin_args(build_parser(prog), argv)
    try:
        layout, loads, live = fetch(scheduler, args.timeout_s, security)
        planned = plan(layout, loads, live, args.threshold, args.max_moves)
        print("\n".join(plan_lines(planned)), flush=True)
        if args.dry_run or not planned.plan.moves:
            return 0
        started = time.monotonic()
        made = move(scheduler, layout, planned.plan.moves, args.timeout_s, security,
                    lambda line: print(f"{prog}: {line}", flush=True))
    except PSError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # grpc.RpcError: the scheduler is not there
        print(f"{prog}: error: cannot talk to the scheduler at {scheduler}: {rpc_failure(err)}",
              file=sys.stderr)
        return 1
    print(f"{prog}: {made} row partition(s) moved in {time.monotonic() - started:.2f} s", flush=True)
    return 0
