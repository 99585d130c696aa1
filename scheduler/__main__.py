"""``python -m pshard.scheduler``: run the pshard scheduler until SIGTERM or SIGINT.

Where to listen: ``--bind``; else the port of this task's address in TF_CONFIG (the scheduler
task, or the chief / worker 0 that hosts the scheduler when the cluster has none), on every
interface; else 0.0.0.0:7000.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from pshard.common.cluster import (
    add_cluster_arguments,
    cluster_config_given,
    cluster_spec_from_args,
    exit_on_config_error,
    split_address,
)
from pshard.common.errors import ClusterConfigError
from pshard.scheduler.service import serve

PROG = "python -m pshard.scheduler"
DEFAULT_PORT = 7000


def _bind_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isdigit() and 0 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"got {value!r}, expected HOST:PORT with a port in 0..65535 "
                                         "(0 picks a free port)")
    return value


def _positive_ms(value: str) -> int:
    if not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"got {value!r}, expected a whole number of milliseconds > 0")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="The pshard scheduler: registers nodes, hands out ranks, generations and "
        "cluster views, runs barriers and holds the parameter layout. Soft state only: after a "
        "restart, nodes re-register and training goes on.")
    parser.add_argument("--bind", metavar="HOST:PORT", type=_bind_address, default=None,
                        help="address to listen on (default: 0.0.0.0 with the port of this task's "
                             f"TF_CONFIG address, else 0.0.0.0:{DEFAULT_PORT}; port 0 picks a free port)")
    parser.add_argument("--heartbeat-interval-ms", metavar="MS", type=_positive_ms, default=1000,
                        help="how often nodes send heartbeats (told to them when they register; "
                             "default 1000)")
    parser.add_argument("--heartbeat-timeout-ms", metavar="MS", type=_positive_ms, default=5000,
                        help="a node silent for longer than this is declared dead (default 5000)")
    add_cluster_arguments(parser)
    return parser


def bind_address(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if not cluster_config_given(args, environ):
        return args.bind or f"0.0.0.0:{DEFAULT_PORT}"
    spec = cluster_spec_from_args(args, environ, default_task_type="scheduler")
    if not spec.hosts_scheduler:
        raise ClusterConfigError(
            f"task.type: got {spec.task_type!r} (index {spec.task_index}), which does not host the "
            f"scheduler; the scheduler of this cluster is at {spec.scheduler_address}")
    if args.bind:
        return str(args.bind)
    # Every interface, not the cluster host name: a Kubernetes Service name resolves to a virtual
    # IP that is not an address of this pod, so listening on it would fail.
    return f"0.0.0.0:{split_address(spec.scheduler_address)[1]}"


async def _run(bind: str, interval_s: float, timeout_s: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(bind, stop, heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s)


@exit_on_config_error(prog=PROG)
def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.heartbeat_timeout_ms <= args.heartbeat_interval_ms:
        parser.error(f"--heartbeat-timeout-ms: got {args.heartbeat_timeout_ms}, expected more than "
                     f"--heartbeat-interval-ms ({args.heartbeat_interval_ms})")
    bind = bind_address(args, os.environ if environ is None else environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(_run(bind, args.heartbeat_interval_ms / 1000, args.heartbeat_timeout_ms / 1000))
    except OSError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
