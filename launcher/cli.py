"""``pshard launch`` (or ``python -m pshard.launcher``): a whole pshard cluster as local processes.

    pshard launch --ps 2 --workers 2 -- --mode sync --epochs 2 --output runs/model.pt
    pshard launch --ps 2 --workers 2 train.py --epochs 2      # your own script, as torchrun runs it

starts ``python -m pshard.scheduler`` and N ``python -m pshard.ps_server``, waits until each answers its gRPC
health check, then starts M ``python -m pshard.worker`` (plus a chief with ``--chief``), or M copies of
a script given as the first argument ending in ``.py`` (everything after it is the script's). Each child
gets its own TF_CONFIG naming the whole cluster on free ports of ``--host``. Every line a child
writes is printed prefixed with its name (``[ps-0] ...``). The exit status is the workers': 0
only when every worker exited 0. A failing child, Ctrl-C or SIGTERM stops every child: SIGTERM
to its process group, SIGKILL after ``--grace-s``; the launcher then exits 128 + the signal.

A problem found before anything starts (a bad flag, a --host nothing can listen on, a
--worker-cmd that is not a program) is one line ``<prog>: error: <problem>`` and exit status 2.

`pshard.launcher.plan` plans (pure), `pshard.launcher.supervisor` runs the processes; this module
is the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from pshard.common.argtypes import (
    int_range,
    load_ratio,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    replicas,
)
from pshard.common.dirlock import DirectoryInUseError, DirectoryLock
from pshard.common.logs import add_log_level_argument, configure_logging
from pshard.launcher.plan import RESTART_POLICIES, TASK_PLACEHOLDER, ClusterPlan, Options, cert_names
from pshard.launcher.record import default_certs_dir
from pshard.scheduler.settings import DEFAULT_REBALANCE_COOLDOWN_S

PROG = "python -m pshard.launcher"
log = logging.getLogger("pshard.launcher")


class LaunchError(Exception):
    """Found before any process started: reported as ``<prog>: error: ...``, exit status 2."""


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        usage=f"{prog} [options] [--] [WORKER_ARG ...]\n       {prog} [options] SCRIPT.py [SCRIPT_ARG ...]",
        description="Run a local pshard cluster as real processes: a scheduler, N parameter servers "
        "and M workers on free ports of one host, each with its own TF_CONFIG. Workers start once "
        "the scheduler and every server are healthy. Output lines are prefixed with the process "
        "name. Exit status: 0 only if every worker exited 0.",
        epilog="A script (the first argument ending in .py) runs as every worker, with this Python, as "
        "torchrun runs one: every argument after it is the script's; PSTrainer(model, job=...) in it "
        "joins the cluster from its TF_CONFIG. Otherwise workers run 'pshard worker': "
        "arguments after '--' (and any the launcher does not know) go to every worker; "
        f"'{TASK_PLACEHOLDER}' in them becomes the worker's name, e.g. "
        f"--metrics runs/metrics-{TASK_PLACEHOLDER}.jsonl. "
        f"Example: {prog} --ps 2 --workers 2 -- --mode sync --epochs 2 --output runs/model.pt")
    parser.add_argument("--ps", metavar="N", type=positive_int, default=2,
                        help="number of parameter servers (default 2)")
    parser.add_argument("--workers", metavar="M", type=non_negative_int, default=2,
                        help="number of worker tasks (default 2)")
    parser.add_argument("--chief", action="store_true",
                        help="also run a chief task (TF_CONFIG type 'chief': the worker that evaluates "
                             "and saves), in addition to the M workers")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every process binds and is reached at (default 127.0.0.1)")
    parser.add_argument("--scheduler-interval-ms", metavar="MS", type=positive_int, default=1000,
                        help="heartbeat interval the scheduler asks of nodes (default 1000)")
    parser.add_argument("--scheduler-timeout-ms", metavar="MS", type=positive_int, default=5000,
                        help="a node silent for this long is declared dead and leaves the sync quorum "
                             "(default 5000)")
    parser.add_argument("--row-partitions-per-server", metavar="N", type=positive_int, default=1,
                        help="the scheduler hashes each sparse table's ids into N row partitions per "
                             "server: the unit that re-sharding moves (default 1)")
    parser.add_argument("--rebalance-auto", metavar="THRESHOLD", type=load_ratio, default=None,
                        help="the scheduler moves row partitions on its own when the hottest server's "
                             "load is above THRESHOLD times the mean (`pshard scheduler --help`; default "
                             "off)")
    parser.add_argument("--rebalance-cooldown", metavar="SECONDS", type=non_negative_float, default=None,
                        help="with --rebalance-auto: seconds between automatic moves (default "
                             f"{DEFAULT_REBALANCE_COOLDOWN_S:g})")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="parameter servers checkpoint their shards to DIR/ps-<i>")
    parser.add_argument("--checkpoint-interval-s", metavar="S", type=non_negative_float, default=0.0,
                        help="with --checkpoint-dir: servers also checkpoint every S seconds, so a "
                             "restarted one loses at most S seconds of training (default 0: only at "
                             "shutdown)")
    parser.add_argument("--job-id", default=None,
                        help="this run's identity, for every worker (PSHARD_JOB_ID); servers restore only a "
                             "checkpoint of the same job (default: a new id per launch, so a re-run with the "
                             "same --checkpoint-dir starts fresh)")
    parser.add_argument("--resume", action="store_true",
                        help="servers continue the checkpoints in --checkpoint-dir even though they are of "
                             "another job (another launch); logged loudly")
    parser.add_argument("--replicas", metavar="R", type=replicas, default=0,
                        help="backups per slice: every server's slices are copied to the next R servers, "
                             "and one takes over when it dies (default 0; needs R < --ps)")
    parser.add_argument("--fast-port", metavar="N", type=int_range(0, 65535), default=0,
                        help="ps-i's raw TCP fast path listens on port N+i, to open in a firewall "
                             "(docs/operations/ports.md; default 0: any free port)")
    parser.add_argument("--restart", choices=RESTART_POLICIES, default="never",
                        help="on-failure: start a scheduler or parameter server that died again on its "
                             "address (like Kubernetes' restartPolicy), after a backoff; with "
                             "--checkpoint-dir a server restores its shard. never (default): stop the job")
    parser.add_argument("--max-restarts", metavar="N", type=non_negative_int, default=Options.max_restarts,
                        help=f"most restarts of any one server (default {Options.max_restarts})")
    parser.add_argument("--restart-backoff-s", metavar="S", type=positive_float,
                        default=Options.restart_backoff_s,
                        help="wait before a server's first restart, doubled for each further one, at most "
                             f"30 s (default {Options.restart_backoff_s:g})")
    parser.add_argument("--coordinator", metavar="SCRIPT", default=None,
                        help="coordinator-driven training (docs/guide/coordinator.md): SCRIPT runs as the "
                             "chief task and schedules functions with pshard.coordinator's "
                             "ClusterCoordinator; the M workers run 'pshard worker --serve'. Arguments after "
                             "'--' go to SCRIPT. The exit status is the coordinator's; a serving worker that "
                             "dies is not fatal")
    parser.add_argument("--worker-cmd", metavar="CMD", default=None,
                        help="command that runs one worker, split like a shell does "
                             f"(default: '{Path(sys.executable).name} -m pshard.worker' with this Python)")
    parser.add_argument("--startup-timeout-s", metavar="S", type=positive_float, default=60.0,
                        help="longest wait for the scheduler and servers to become healthy (default 60)")
    parser.add_argument("--grace-s", metavar="S", type=positive_float, default=10.0,
                        help="time between SIGTERM and SIGKILL when stopping a process (default 10)")
    parser.add_argument("--certs-dir", metavar="DIR", default=None,
                        help="mutual TLS on every channel with a development CA and one certificate per "
                             "process, made here on first use and kept ('pshard certs'; default: "
                             f"$PSHARD_CERTS_DIR, else {default_certs_dir()})")
    parser.add_argument("--insecure", action="store_true",
                        help="no TLS and no authentication, for a quick local try (every process warns)")
    add_log_level_argument(parser)
    return parser


def split_script(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]] | None:
    """(launcher args, [script, *script args]) when `argv` names a script (torchrun's form), else None.

    The script is the first argument ending in '.py' before any '--' that is not the value of a
    launcher flag (``--worker-cmd 'python x.py'`` stays a command)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return None
        if not arg.endswith(".py") or arg.startswith("-"):
            continue
        previous = parser._option_string_actions.get(argv[i - 1]) if i else None
        if previous is not None and previous.nargs != 0:
            continue
        return list(argv[:i]), list(argv[i:])
    return None


def parse_options(argv: Sequence[str], prog: str = PROG) -> Options:
    """Launcher flags up to '--' (or up to a script); what follows, and unknown flags before it, go to
    workers."""
    argv = list(argv)
    parser = build_parser(prog)
    script = split_script(argv, parser)
    if script is not None:
        argv = [*script[0], "--", *script[1][1:]]
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser.parse_known_args(argv[:split])
    if script is not None and (args.worker_cmd is not None or unknown):
        what = "--worker-cmd" if args.worker_cmd is not None else f"{unknown[0]!r}"
        parser.error(f"{what}: got it with the script {script[1][0]!r}; arguments for the script go after "
                     "it, and a script replaces --worker-cmd")
    if args.coordinator is not None and (script is not None or args.worker_cmd is not None):
        parser.error(f"--coordinator: got it with {'a worker script' if script else '--worker-cmd'}; with a "
                     "coordinator the workers serve its functions ('pshard worker --serve')")
    if args.workers == 0 and not args.chief:
        parser.error("--workers: got 0 without --chief, expected at least one training process")
    if args.scheduler_timeout_ms <= args.scheduler_interval_ms:
        parser.error(f"--scheduler-timeout-ms: got {args.scheduler_timeout_ms}, expected more than "
                     f"--scheduler-interval-ms ({args.scheduler_interval_ms})")
    if not 0 <= args.replicas < args.ps:
        parser.error(f"--replicas: got {args.replicas}, expected 0 to {args.ps - 1} (--ps is {args.ps})")
    if args.fast_port and args.fast_port + args.ps - 1 > 65535:
        parser.error(f"--fast-port: got {args.fast_port}, but ps-{args.ps - 1} would listen on "
                     f"{args.fast_port + args.ps - 1}; expected at most {65536 - args.ps} for --ps {args.ps}")
    if args.checkpoint_interval_s > 0 and not args.checkpoint_dir:
        parser.error("--checkpoint-interval-s: needs --checkpoint-dir")
    if args.rebalance_cooldown is not None and args.rebalance_auto is None:
        parser.error(f"--rebalance-cooldown: got {args.rebalance_cooldown:g}, but the automatic rebalance is "
                     "off; add --rebalance-auto THRESHOLD")
    if args.checkpoint_dir:  # each server's would fail alone, after the scheduler started
        try:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            probe = Path(args.checkpoint_dir, f".pshard-launch-{os.getpid()}")
            probe.touch()
            probe.unlink()
        except OSError as e:
            parser.error(f"--checkpoint-dir: {args.checkpoint_dir!r} is not a writable directory "
                         f"({e.strerror or e})")
    worker_cmd = Options.worker_cmd if args.worker_cmd is None else tuple(shlex.split(args.worker_cmd))
    if script is not None:  # this Python: the one pshard is installed in, as for `pshard worker`
        worker_cmd = (sys.executable, script[1][0])
    if not worker_cmd:
        parser.error("--worker-cmd: got an empty command")
    return Options(ps=args.ps, workers=args.workers, chief=args.chief or args.coordinator is not None,
                   host=args.host, coordinator=args.coordinator,
                   heartbeat_interval_ms=args.scheduler_interval_ms,
                   heartbeat_timeout_ms=args.scheduler_timeout_ms, checkpoint_dir=args.checkpoint_dir,
                   row_partitions_per_server=args.row_partitions_per_server,
                   rebalance_auto=args.rebalance_auto, rebalance_cooldown_s=args.rebalance_cooldown,
                   worker_cmd=worker_cmd, worker_args=(*unknown, *argv[split + 1:]),
                   script=script[1][0] if script is not None else None,
                   startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_s,
                   log_level=args.log_level, restart=args.restart, max_restarts=args.max_restarts,
                   restart_backoff_s=args.restart_backoff_s, checkpoint_interval_s=args.checkpoint_interval_s,
                   job_id=args.job_id or f"launch-{uuid.uuid4().hex[:12]}", resume=args.resume,
                   replicas=args.replicas, fast_port=args.fast_port,
                   certs_dir=None if args.insecure else (args.certs_dir or default_certs_dir()))


def _ensure_certs(options: Options) -> None:
    """Every process's certificate (and an admin's), made on first use, kept after
    (pshard.common.security.ca)."""
    from pshard.common.security.ca import ensure
    from pshard.common.security.identity import Identity

    assert options.certs_dir is not None
    plan = ClusterPlan.allocate(options.ps, options.workers, chief=options.chief, host=options.host,
                                ports=lambda n, host: list(range(1, n + 1)))
    nodes = [Identity(role, node_id) for role, node_id in cert_names(plan)] + [Identity("admin")]
    try:
        ensure(options.certs_dir, nodes, [options.host])
    except OSError as err:
        raise LaunchError(f"--certs-dir: cannot make certificates in {options.certs_dir!r} "
                          f"({err.strerror or err})") from None


def check_startable(options: Options) -> None:
    """What would only fail once servers run, checked before any starts; LaunchError names it."""
    program = options.worker_cmd[0]
    if options.script is not None and not Path(options.script).is_file():
        raise LaunchError(f"script: {options.script!r} is not a file")
    if options.coordinator is not None and not Path(options.coordinator).is_file():
        raise LaunchError(f"--coordinator: {options.coordinator!r} is not a file")
    if shutil.which(program) is None:
        raise LaunchError(f"--worker-cmd: {program!r} is not an executable program")
    # An unusable --checkpoint-dir is left to the parameter server, which names it (exit 2) and
    # which the launcher then reports as a server that did not start.


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    options = parse_options(sys.argv[1:] if argv is None else argv, prog)
    configure_logging(options.log_level)
    try:
        check_startable(options)
        try:
            ClusterPlan.allocate(options.ps, options.workers, chief=options.chief, host=options.host)
        except OSError as err:
            raise LaunchError(f"--host: cannot listen on {options.host!r} ({err.strerror or err})") from None
        if options.certs_dir is None:
            log.warning("--insecure: NO TLS AND NO AUTHENTICATION for this cluster: anyone who reaches "
                        "%s can read and overwrite the model", options.host)
        else:
            _ensure_certs(options)
        lock = _lock_checkpoint_dir(options)
        # The supervisor's health probes import grpc: only once the flags are checked, so that --help and
        # usage errors come first, within a fraction of a second.
        from pshard.launcher.supervisor import run

        try:
            return run(options)
        finally:
            if lock is not None:
                lock.release()
    except LaunchError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def _lock_checkpoint_dir(options: Options) -> DirectoryLock | None:
    """--checkpoint-dir for this launch alone while it runs (its servers lock their own sub-directories):
    a second job there is refused before anything starts, naming this one (pshard.common.dirlock)."""
    if not options.checkpoint_dir:
        return None
    try:
        Path(options.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        return DirectoryLock.acquire(options.checkpoint_dir, {"job_id": options.job_id, "role": "launcher"})
    except DirectoryInUseError as err:
        raise LaunchError(str(err)) from None
    except OSError:
        return None  # an unusable directory: the parameter server names it (see check_startable)


