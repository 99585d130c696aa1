"""``pshard scheduler`` (or ``python -m pshard.scheduler``): run the scheduler until SIGTERM or SIGINT.

Where to listen: ``--bind``; else the port of the scheduler's address in TF_CONFIG (else 7000) on
127.0.0.1, or in a container on TF_CONFIG's host (pshard.common.rpc.bind). With TF_CONFIG the task
must be the cluster's ``scheduler`` task:
a chief or worker 0 that hosts the scheduler (a cluster without a scheduler entry) does so
in-process, from ``pshard worker``.

Start-up problems (a bad TF_CONFIG or flag, a role that is not the scheduler, a port in use) are
one line, ``<prog>: error: <problem>``, and exit status 2. SIGTERM or SIGINT at any moment is a
quiet stop with status 0.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports below: a stop during them is quiet too
    from pshard.common.entry import die_with_launcher, stop_quietly_on_signals

    stop_quietly_on_signals()
    die_with_launcher()

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence

from pshard.common.argtypes import (
    listen_address,
    load_ratio,
    non_negative_float,
    positive_float,
    positive_int,
)
from pshard.common.cluster.layout import MAX_ROW_PARTITIONS
from pshard.common.cluster.spec import (
    add_cluster_arguments,
    cluster_config_given,
    cluster_spec_from_args,
    exit_on_config_error,
)
from pshard.common.entry import STOP_SIGNALS, check_can_listen, metrics_address
from pshard.common.errors import ClusterConfigError
from pshard.common.jobend import add_exit_argument, watch_job_end
from pshard.common.logs import add_log_level_argument, configure_logging
from pshard.common.metrics_flag import add_metrics_argument
from pshard.common.rpc.bind import default_bind, own_hosts
from pshard.common.security.credentials import SecurityConfig, add_security_arguments, security_from_args
from pshard.scheduler.auto_rebalance import RebalancePolicy, rebalance_policy
from pshard.scheduler.settings import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LOAD_WINDOW_S,
    DEFAULT_REBALANCE_COOLDOWN_S,
)

PROG = "python -m pshard.scheduler"
DEFAULT_PORT = 7000


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="The pshard scheduler: registers nodes, hands out ranks, generations and "
        "cluster views, runs barriers and holds the parameter layout. Soft state only: after a "
        "restart, nodes re-register and training goes on.")
    interval_ms = round(DEFAULT_HEARTBEAT_INTERVAL_S * 1000)
    timeout_ms = round(DEFAULT_HEARTBEAT_TIMEOUT_S * 1000)
    parser.add_argument("--bind", metavar="HOST:PORT", type=listen_address, default=None,
                        help="address to listen on (default: the scheduler's TF_CONFIG address when its "
                             "host is an address of this machine, else every interface with its port; "
                             f"without TF_CONFIG 127.0.0.1:{DEFAULT_PORT}, every interface in a container; "
                             "port 0 picks a free port)")
    parser.add_argument("--heartbeat-interval-ms", metavar="MS", type=positive_int, default=interval_ms,
                        help="how often nodes send heartbeats (told to them when they register; "
                             f"default {interval_ms})")
    parser.add_argument("--heartbeat-timeout-ms", metavar="MS", type=positive_int, default=timeout_ms,
                        help=f"a node silent for longer than this is declared dead (default {timeout_ms})")
    parser.add_argument("--row-partitions-per-server", metavar="N", type=positive_int, default=1,
                        help="hash each sparse table's ids into N row partitions per parameter server: "
                             "the unit that re-sharding moves (docs/operations/scaling.md; default 1: "
                             "one partition per server)")
    add_rebalance_arguments(parser)
    add_cluster_arguments(parser)
    add_security_arguments(parser)
    add_metrics_argument(parser)
    add_exit_argument(parser)
    add_log_level_argument(parser)
    return parser


def add_rebalance_arguments(parser: argparse.ArgumentParser) -> None:
    """The automatic rebalance (docs/operations/scaling.md), also `pshard launch`'s."""
    parser.add_argument("--rebalance-auto", metavar="THRESHOLD", type=load_ratio, default=None,
                        help="move table row partitions on its own: when the hottest live server's load "
                             "(rows/s, as `pshard rebalance` weighs it) is above THRESHOLD times the mean, "
                             "and nothing else moves, start the first move `pshard rebalance` would make, "
                             "then wait --rebalance-cooldown (default: off; 1.2 is a good start; needs "
                             "--row-partitions-per-server above 1)")
    parser.add_argument("--rebalance-cooldown", metavar="SECONDS", type=non_negative_float, default=None,
                        help="with --rebalance-auto: seconds after a move before the next one may start, "
                             "and before a moved partition may move again "
                             f"(default {DEFAULT_REBALANCE_COOLDOWN_S:g})")
    parser.add_argument("--load-window-s", metavar="SECONDS", type=positive_float,
                        default=DEFAULT_LOAD_WINDOW_S,
                        help="servers' loads are rates over about this many seconds of their heartbeats; "
                             "--rebalance-auto waits for that much from every server before a move "
                             f"(default {DEFAULT_LOAD_WINDOW_S:g})")


def policy_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RebalancePolicy | None:
    if args.rebalance_cooldown is not None and args.rebalance_auto is None:
        parser.error(f"--rebalance-cooldown: got {args.rebalance_cooldown:g}, but the automatic rebalance is "
                     "off; add --rebalance-auto THRESHOLD")
    return rebalance_policy(args.rebalance_auto, args.rebalance_cooldown, args.load_window_s)


def bind_address(args: argparse.Namespace, environ: Mapping[str, str], prog: str = PROG) -> str:
    if not cluster_config_given(args, environ):
        return args.bind or default_bind(f"0.0.0.0:{DEFAULT_PORT}", None, environ)
    spec = cluster_spec_from_args(args, environ, default_task_type="scheduler")
    if spec.task_type != "scheduler":
        host = ("it hosts the scheduler in-process with 'pshard worker'" if spec.hosts_scheduler
                else f"the scheduler of this cluster is at {spec.scheduler_address}")
        raise ClusterConfigError(
            f"task.type: got {spec.task_type!r} (index {spec.task_index}), but {prog} runs the "
            f"'scheduler' task; {host}")
    return str(args.bind) if args.bind else default_bind(spec.listen_address, spec.own_address, environ)


async def _run(bind: str, interval_s: float, timeout_s: float, metrics_port: int | None = None,
               exit_when_done: float | None = None, security: SecurityConfig | None = None,
               row_partitions_per_server: int = 1, rebalance: RebalancePolicy | None = None,
               load_window_s: float = DEFAULT_LOAD_WINDOW_S) -> None:
    # The service's modules (grpc, the generated code) load only once the flags are checked: --help and
    # every usage error come first, within a fraction of a second.
    from pshard.common.metrics import serve_scheduler_metrics
    from pshard.scheduler.service import start

    # Handlers first: from here on a signal stops the scheduler gracefully, start-up included.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    running = await start(bind, heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s,
                          security=security, row_partitions_per_server=row_partitions_per_server,
                          rebalance=rebalance, load_window_s=load_window_s)
    (security or SecurityConfig()).warn_if_open("pshard scheduler")
    metrics = None
    try:
        if metrics_port is not None:
            membership = running.servicer.membership
            metrics = serve_scheduler_metrics(membership.view, loop, bind, metrics_port,
                                              refusals=running.refusals,
                                              role_changes=lambda: dict(membership.in_sync.changes),
                                              moves=membership.moves.stats)
            print(f"pshard scheduler: metrics on port {metrics.port}", flush=True)
        waits = [asyncio.ensure_future(stop.wait())]
        if exit_when_done is not None:
            members = running.servicer.membership
            waits.append(asyncio.ensure_future(watch_job_end(members.view, lambda: members.generation,
                                                             exit_when_done)))
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
    finally:
        if metrics is not None:
            metrics.close()
        await running.stop(2.0)


@exit_on_config_error(prog=PROG)
def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, *,
         prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.heartbeat_timeout_ms <= args.heartbeat_interval_ms:
        parser.error(f"--heartbeat-timeout-ms: got {args.heartbeat_timeout_ms}, expected more than "
                     f"--heartbeat-interval-ms ({args.heartbeat_interval_ms})")
    if args.row_partitions_per_server > MAX_ROW_PARTITIONS:
        parser.error(f"--row-partitions-per-server: got {args.row_partitions_per_server}, expected at most "
                     f"{MAX_ROW_PARTITIONS}")
    policy = policy_from_args(parser, args)
    configure_logging(args.log_level)
    env = os.environ if environ is None else environ
    bind = bind_address(args, env, prog)
    given = cluster_config_given(args, env)
    spec = cluster_spec_from_args(args, env, default_task_type="scheduler") if given else None
    security = security_from_args(args, env, role="scheduler", node_id="scheduler-0",
                                  hosts=own_hosts(spec.own_address) if spec else [])
    check_can_listen(bind)
    if args.metrics_port:
        check_can_listen(metrics_address(bind, args.metrics_port))
    try:
        asyncio.run(_run(bind, args.heartbeat_interval_ms / 1000, args.heartbeat_timeout_ms / 1000,
                         args.metrics_port, args.exit_when_done, security, args.row_partitions_per_server,
                         policy, args.load_window_s))
    except OSError as e:  # lost the port between the check and gRPC's bind
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
