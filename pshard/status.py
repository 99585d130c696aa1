"""``pshard status``: the job at a glance, from the scheduler's view and every server's GetStats.

    pshard status [--scheduler HOST:PORT] [--json] [--watch [SECONDS]]

With no --scheduler: TF_CONFIG's, else the running `pshard launch`'s. With no credentials: those the
launcher made (pshard.launcher.record), so the command the launcher prints works as it is.

The scheduler names the members (role, state, generation); each live server says what it holds
(slices, bytes, versions), which clock each worker last pushed and over which transport. From
those, `summarise` works out each worker's lag behind the fastest one and, when a server's
clock is stuck, whom it waits for: in sync mode the workers that have not pushed the clock the
slowest slice is at, in SSP mode the workers more than `staleness` clocks behind the fastest.
`summarise` and `render` are pure; `main` does the RPCs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from pshard.admin import add_scheduler_argument, first_watch, parse_admin_args, rpc_failure, scheduler_stub
from pshard.common.argtypes import positive_float
from pshard.common.cluster.view import ClusterView, NodeState, ServerLoss
from pshard.common.security.credentials import SecurityConfig, add_security_arguments

PROG = "pshard status"


@dataclass(frozen=True)
class ServerReport:
    """One server's GetStats, or why it could not be read."""

    node_id: str
    address: str
    mode: str = "unset"
    staleness: int = 0
    slices: int = 0
    bytes_stored: int = 0
    min_version: int = 0
    max_version: int = 0
    pulls_waiting: int = 0
    pushes_applied: int = 0
    pushes_dropped: int = 0
    quorum: tuple[str, ...] = ()
    worker_clocks: Mapping[str, int] = field(default_factory=dict)
    transports: Mapping[str, str] = field(default_factory=dict)  # worker -> "shm"/"tcp"; absent: grpc
    error: str | None = None
    waits_for: tuple[str, ...] = ()  # workers this server's stuck clock waits on


@dataclass(frozen=True)
class MemberReport:
    node_id: str
    role: str
    rank: int
    address: str
    state: str
    generation: int
    clock: int | None = None  # last clock pushed (trainers only), highest over the servers
    lag: int | None = None  # clocks behind the fastest trainer
    transports: tuple[str, ...] = ()  # what its sessions with the servers use


@dataclass(frozen=True)
class DrainReport:
    """A drain the scheduler knows of (scheduler/drains.py): in progress while it waits for a copy."""
    node_id: str
    address: str  # from
    heir: str  # to; "" while in progress
    slices: int
    partitions: tuple[int, ...]
    layout_version: int
    seconds: float  # from its first ask to the hand-over, or to now
    done: bool


@dataclass(frozen=True)
class JoinReport:
    """A join the scheduler knows of (scheduler/joins.py): in progress while the server catches up, then,
    once it took slices and row partitions (`layout_version`), while its backups copy them."""
    node_id: str
    address: str  # to
    donor: str  # from; "" while in progress
    slices: int
    partitions: tuple[int, ...]
    nbytes: int
    layout_version: int  # of the switch; 0 before it
    seconds: float  # from its registration to its end (backed up, or the roll back), or to now
    done: bool
    rolled_back: str = ""  # why the joiner went before the switch; "" unless it did
    bytes_left: int = 0  # of the copy to it while it catches up, then of the copy to its backups

    @property
    def state(self) -> str:
        if self.rolled_back:
            return "rolled back"
        return "done" if self.done else "backing up" if self.layout_version else "catching up"


@dataclass(frozen=True)
class LoadReport:
    """A live server's load as the scheduler rates it from the server's heartbeats (issue 20)."""
    node_id: str
    address: str
    bytes_in_per_s: float
    bytes_out_per_s: float
    rows_per_s: Mapping[int, float]  # row partition -> rows pulled or pushed per second
    partition_bytes: Mapping[int, int]  # row partition -> bytes held


@dataclass(frozen=True)
class MoveReport:
    """A row partition moved to a backup of its server (`pshard rebalance`), from the scheduler."""
    partition: int
    source: str
    target: str
    layout_version: int
    nbytes: int
    bytes_copied: int  # of nbytes, what the new server's backups hold so far
    bytes_left: int
    seconds: float
    done: bool


@dataclass(frozen=True)
class AutoRebalanceReport:
    """The scheduler's automatic rebalance (`pshard scheduler --rebalance-auto`): on or off, and where it
    stands (scheduler/auto_rebalancer.py's AutoRebalanceStatus, field for field)."""
    enabled: bool
    threshold: float = 0.0
    cooldown_s: float = 0.0
    moves: int = 0  # automatic moves started
    last_move: str = ""  # "" before the first
    since_last_move_s: float | None = None  # None before the first
    eligible_in_s: float = 0.0  # until the cool-down lets the next move start
    reason: str = ""  # the last decision's


HOT_PARTITIONS = 5  # the hottest row partitions `pshard status` lists


@dataclass(frozen=True)
class JobStatus:
    scheduler: str
    generation: int
    layout_version: int
    members: tuple[MemberReport, ...]
    servers: tuple[ServerReport, ...]
    taken_at: float = 0.0
    # worker -> server -> transport of that pair's pushes and pulls ("shm", "tcp" or "grpc"): chosen per
    # peer, so one worker may use shared memory with a server on its host and raw TCP with the others.
    pairs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    drains: tuple[DrainReport, ...] = ()
    loads: tuple[LoadReport, ...] = ()
    moves: tuple[MoveReport, ...] = ()
    joins: tuple[JoinReport, ...] = ()
    # Servers whose failover the scheduler refused: their slices and row partitions are lost.
    lost: tuple[ServerLoss, ...] = ()
    auto_rebalance: AutoRebalanceReport | None = None  # None: the scheduler did not say

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


TRAINERS = ("chief", "worker")


def waits_for(server: ServerReport, live_workers: Sequence[str]) -> tuple[str, ...]:
    """Who this server's slowest clock is waiting on (empty when nothing waits)."""
    quorum = server.quorum or tuple(live_workers)
    clocks = server.worker_clocks
    if server.mode == "sync":
        # Clock `min_version` completes when every quorum member pushed it.
        return tuple(sorted(w for w in quorum if clocks.get(w, -1) < server.min_version))
    if server.mode == "ssp" and clocks:
        fastest = max(clocks.values())
        if server.pulls_waiting:
            return tuple(sorted(w for w in quorum if fastest - clocks.get(w, 0) > server.staleness))
    return ()


def summarise(scheduler: str, view: ClusterView, servers: Sequence[ServerReport], now: float = 0.0,
              drains: Sequence[DrainReport] = (), loads: Sequence[LoadReport] = (),
              moves: Sequence[MoveReport] = (), joins: Sequence[JoinReport] = (),
              auto_rebalance: AutoRebalanceReport | None = None) -> JobStatus:
    """The job's status from the scheduler's view and the servers' reports."""
    nodes = view.nodes
    live_trainers = [n.node_id for n in nodes if n.role in TRAINERS and n.state is NodeState.LIVE]
    clocks: dict[str, int] = {}
    used: dict[str, set[str]] = {}
    for report in servers:
        for worker, pushed in report.worker_clocks.items():
            clocks[worker] = max(pushed, clocks.get(worker, pushed))
        for worker in report.worker_clocks:
            used.setdefault(worker, set()).add(report.transports.get(worker, "grpc"))
    fastest = max((clocks[w] for w in live_trainers if w in clocks), default=None)
    members = []
    for n in nodes:
        clock: int | None = clocks.get(n.node_id) if n.role in TRAINERS else None
        live = n.node_id in live_trainers
        lag = fastest - clock if clock is not None and fastest is not None and live else None
        members.append(MemberReport(n.node_id, n.role, n.rank, n.address, n.state.name.lower(), n.generation,
                                    clock, lag, tuple(sorted(used.get(n.node_id, ())))))
    reports = tuple(ServerReport(**{**asdict(s), "waits_for": waits_for(s, live_trainers)}) for s in servers)
    return JobStatus(scheduler, view.generation, view.layout_version, tuple(members), reports, now,
                     pairs=pair_transports(servers), drains=tuple(drains), loads=tuple(loads),
                     moves=tuple(moves), joins=tuple(joins), lost=view.lost, auto_rebalance=auto_rebalance)


def pair_transports(servers: Sequence[ServerReport]) -> dict[str, dict[str, str]]:
    """worker -> server -> transport, for each pair the server has seen a push from."""
    pairs: dict[str, dict[str, str]] = {}
    for report in servers:
        for worker in sorted(report.worker_clocks):
            pairs.setdefault(worker, {})[report.node_id] = report.transports.get(worker, "grpc")
    return dict(sorted(pairs.items()))


def _pair_lines(status: JobStatus) -> list[str]:
    """The transport of each worker x server pair, one row per worker (empty before the first push)."""
    if not status.pairs:
        return []
    servers = sorted({server for row in status.pairs.values() for server in row})
    width = max(6, *(len(s) for s in servers))
    lines = ["", f"{'TRANSPORT':<14} " + " ".join(f"{s:<{width}}" for s in servers).rstrip()]
    for worker, row in status.pairs.items():
        lines.append(f"{worker:<14} " + " ".join(f"{row.get(s, '-'):<{width}}" for s in servers).rstrip())
    return lines


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _drain_lines(status: JobStatus) -> list[str]:
    """What each drain moved, from where to where, and how long it took (or has taken so far)."""
    if not status.drains:
        return []
    lines = ["", f"{'DRAIN':<14} {'STATE':<11} {'FROM':<21} {'TO':<21} {'SLICES':>6} {'LAYOUT':>6} "
                 f"{'TIME':>8}  PARTITIONS"]
    for d in status.drains:
        state = "done" if d.done else "in progress"
        layout = str(d.layout_version) if d.done else "-"
        parts = ",".join(map(str, d.partitions)) if d.done else "-"
        lines.append(f"{d.node_id:<14} {state:<11} {d.address:<21} {d.heir or '-':<21} {d.slices:>6} "
                     f"{layout:>6} {f'{d.seconds:.2f} s':>8}  {parts or '-'}")
    return lines


def _lost_lines(status: JobStatus) -> list[str]:
    """The servers the job lost: what an operator must act on (restore from a checkpoint, or restart)."""
    if not status.lost:
        return []
    lines = ["", f"{'LOST':<21} {'LAYOUT':>6}  WHY (failover refused: restore the job from a checkpoint, or "
                 "restart it)"]
    lines += [f"{loss.address:<21} {loss.layout_version:>6}  {loss.reason}" for loss in status.lost]
    return lines


def _join_lines(status: JobStatus) -> list[str]:
    """What each join took (dense slices, and which row partitions), from where, and how long it took (or
    has taken so far, with the bytes of the copy left: to the joiner, then to its backups); a rolled-back
    one with why."""
    if not status.joins:
        return []
    lines = ["", f"{'JOIN':<14} {'STATE':<11} {'FROM':<21} {'TO':<21} {'SLICES':>6} {'BYTES':>9} {'LEFT':>9} "
                 f"{'LAYOUT':>6} {'TIME':>8}  PARTITIONS"]
    for j in status.joins:
        took = bool(j.layout_version) and not j.rolled_back
        layout = str(j.layout_version) if took else "-"
        parts = ",".join(map(str, j.partitions)) if took else f"({j.rolled_back})" if j.rolled_back else "-"
        nbytes = _size(j.nbytes) if took else "-"
        left = _size(j.bytes_left) if not j.done and not j.rolled_back else "-"
        state = j.state
        lines.append(f"{j.node_id:<14} {state:<11} {j.donor or '-':<21} {j.address:<21} {j.slices:>6} "
                     f"{nbytes:>9} {left:>9} {layout:>6} {f'{j.seconds:.2f} s':>8}  {parts or '-'}")
    return lines


def _rate(n: float) -> str:
    return f"{_size(round(n))}/s"


def _load_lines(status: JobStatus) -> list[str]:
    """Each live server's bytes in and out per second and rows per second, then the hottest partitions."""
    if not status.loads:
        return []
    lines = ["", f"{'LOAD':<14} {'IN':>12} {'OUT':>12} {'ROWS/s':>10} {'PARTITIONS':>10}"]
    for load in status.loads:
        rates = f"{_rate(load.bytes_in_per_s):>12} {_rate(load.bytes_out_per_s):>12}"
        lines.append(f"{load.node_id:<14} {rates} {sum(load.rows_per_s.values()):>10.1f} "
                     f"{len(load.rows_per_s):>10}")
    hot = sorted(((rate, p, load) for load in status.loads for p, rate in load.rows_per_s.items()
                  if rate > 0), key=lambda t: (-t[0], t[1]))[:HOT_PARTITIONS]
    if hot:
        lines += ["", f"{'HOT PARTITION':<14} {'SERVER':<14} {'ROWS/s':>10} {'BYTES':>10}"]
        for rate, p, load in hot:
            held = _size(load.partition_bytes.get(p, 0))
            lines.append(f"{p:<14} {load.node_id:<14} {rate:>10.1f} {held:>10}")
    return lines


def _move_lines(status: JobStatus) -> list[str]:
    """Each partition move: from, to, the layout that switched it, bytes copied and left, how long."""
    if not status.moves:
        return []
    lines = ["", f"{'MOVE':<14} {'STATE':<11} {'FROM':<21} {'TO':<21} {'LAYOUT':>6} {'COPIED':>10} "
                 f"{'LEFT':>10} {'TIME':>8}"]
    for m in status.moves:
        # Layout 0: a catch-up copy to a server that is not a backup, before its switch.
        state = "done" if m.done else "copying" if not m.layout_version else "in progress"
        lines.append(f"{f'partition {m.partition}':<14} {state:<11} {m.source:<21} {m.target:<21} "
                     f"{m.layout_version:>6} {_size(m.bytes_copied):>10} {_size(m.bytes_left):>10} "
                     f"{f'{m.seconds:.2f} s':>8}")
    return lines


def _auto_rebalance_lines(status: JobStatus) -> list[str]:
    """The automatic rebalance: off, or its settings, its moves, and what it waits for."""
    auto = status.auto_rebalance
    if auto is None:
        return []
    if not auto.enabled:
        return ["", "AUTO-REBALANCE  off (pshard scheduler --rebalance-auto THRESHOLD turns it on)"]
    last = (f"last {auto.last_move}, {auto.since_last_move_s:.1f} s ago"
            if auto.last_move and auto.since_last_move_s is not None else "none yet")
    return ["", f"AUTO-REBALANCE  on: above {auto.threshold:g}x the mean load, cool-down "
                f"{auto.cooldown_s:g} s; {auto.moves} move(s), {last}; next move eligible "
                + (f"in {auto.eligible_in_s:.1f} s" if auto.eligible_in_s > 0 else "now"),
            f"{'':<16}{auto.reason}"]


def render(status: JobStatus) -> str:
    """The human form: members, then servers, then what waits on whom."""
    def dash(value: object) -> str:
        return "-" if value is None or value == () else str(value)

    lines = [f"scheduler {status.scheduler}: generation {status.generation}, layout {status.layout_version}",
             "", f"{'MEMBER':<14} {'ROLE':<9} {'STATE':<6} {'GEN':>4} {'CLOCK':>7} {'LAG':>5}  TRANSPORT"]
    for m in status.members:
        lines.append(f"{m.node_id:<14} {m.role:<9} {m.state:<6} {m.generation:>4} {dash(m.clock):>7} "
                     f"{dash(m.lag):>5}  {','.join(m.transports) or '-'}")
    lines += ["", f"{'SERVER':<14} {'MODE':<6} {'SLICES':>6} {'BYTES':>10} {'CLOCK MIN-MAX':>14} "
                  f"{'WAITING':>7} {'APPLIED':>8}"]
    for s in status.servers:
        if s.error is not None:
            lines.append(f"{s.node_id:<14} unreachable ({s.address}): {s.error}")
            continue
        mode = f"{s.mode}({s.staleness})" if s.mode == "ssp" else s.mode
        lines.append(f"{s.node_id:<14} {mode:<6} {s.slices:>6} {_size(s.bytes_stored):>10} "
                     f"{f'{s.min_version}-{s.max_version}':>14} {s.pulls_waiting:>7} {s.pushes_applied:>8}")
    lines += _pair_lines(status)
    lines += _load_lines(status)
    lines += _drain_lines(status)
    lines += _move_lines(status)
    lines += _join_lines(status)
    lines += _auto_rebalance_lines(status)
    lines += _lost_lines(status)
    stuck = [s for s in status.servers if s.waits_for]
    if stuck:
        lines.append("")
    for s in stuck:
        if s.mode == "sync":
            lines.append(f"{s.node_id}: clock {s.min_version} waits for {', '.join(s.waits_for)}")
        else:
            lines.append(f"{s.node_id}: {s.pulls_waiting} pull(s) wait for {', '.join(s.waits_for)} "
                         f"(more than {s.staleness} clocks behind the fastest)")
    return "\n".join(lines)


# ---- the RPCs ----


def fetch(scheduler: str, timeout_s: float, security: SecurityConfig | None = None) -> JobStatus:
    """`security`: the operator's credential (an admin certificate or token); default plain."""
    import grpc

    from pshard.api.v1 import parameter_server_pb2 as pb
    from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
    from pshard.common.wire.codec import mode_from_proto, view_from_proto

    security = security or SecurityConfig()
    with scheduler_stub(scheduler, security) as stub:
        first = first_watch(stub, timeout_s)
    view = view_from_proto(first.view)
    drains = [DrainReport(d.node_id, d.address, d.heir, d.slices, tuple(d.partitions), d.layout_version,
                          d.seconds, d.done) for d in first.drains]
    names = {n.address: n.node_id for n in view.nodes if n.role == "ps"}
    loads = [LoadReport(names.get(p.address, p.address), p.address, p.bytes_in_per_s, p.bytes_out_per_s,
                        {q.partition: q.rows_per_s for q in p.partitions},
                        {q.partition: q.bytes for q in p.partitions}) for p in first.loads]
    moves = [MoveReport(m.partition, m.source, m.target, m.layout_version, m.bytes, m.bytes_copied,
                        m.bytes_left, m.seconds, m.done) for m in first.moves]
    joins = [JoinReport(j.node_id, j.address, j.donor, j.slices, tuple(j.partitions), j.bytes,
                        j.layout_version, j.seconds, j.done, j.rolled_back, j.bytes_left)
             for j in first.joins]
    a = first.auto_rebalance
    auto = AutoRebalanceReport(a.enabled, a.threshold, a.cooldown_s, a.moves, a.last_move,
                               a.since_last_move_s if a.last_move else None, a.eligible_in_s, a.reason)
    reports = []
    for node in view.nodes:
        if node.role != "ps" or node.state is not NodeState.LIVE:
            continue
        try:
            with security.channel(node.address) as channel:
                ps_stub = pb_grpc.ParameterServerServiceStub(channel)
                s = ps_stub.GetStats(pb.GetStatsRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            why = f"{err.code().name}: {err.details()}"
            reports.append(ServerReport(node.node_id, node.address, error=why))
            continue
        reports.append(ServerReport(
            node.node_id, node.address, mode=mode_from_proto(s.mode) if s.mode else "unset",
            staleness=s.staleness,
            slices=s.slices, bytes_stored=s.bytes_stored, min_version=s.min_version,
            max_version=s.max_version, pulls_waiting=s.pulls_waiting, pushes_applied=s.pushes_applied,
            pushes_dropped=s.pushes_dropped, quorum=tuple(s.quorum), worker_clocks=dict(s.worker_clocks),
            transports=dict(s.worker_transports)))
    return summarise(scheduler, view, reports, time.time(), drains, loads, moves, joins, auto)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Show a running pshard job: members, clocks, lag, "
                                "servers and what a stuck clock waits for.")
    add_scheduler_argument(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--watch", metavar="SECONDS", type=positive_float, nargs="?", const=2.0, default=None,
                   help="refresh every SECONDS (default 2) until interrupted")
    p.add_argument("--timeout-s", metavar="S", type=positive_float, default=10.0,
                   help="per-RPC timeout (default 10)")
    add_security_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args, scheduler, security = parse_admin_args(build_parser(prog), argv)
    while True:
        try:
            status = fetch(scheduler, args.timeout_s, security)
        except Exception as err:  # grpc.RpcError: the scheduler is not there
            print(f"{prog}: error: cannot read the scheduler at {scheduler}: {rpc_failure(err)}",
                  file=sys.stderr)
            return 1
        text = status.to_json() if args.json else render(status)
        if args.watch is None:
            print(text, flush=True)
            return 0
        if not args.json and sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J")
        print(text, flush=True)
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
