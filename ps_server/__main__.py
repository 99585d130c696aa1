"""``pshard ps`` (or ``python -m pshard.ps_server``): run one parameter server.

With TF_CONFIG (task type "ps"), the server binds its own address's port, registers
with the scheduler and follows its cluster view: the sync quorum is the set of live
workers. Without a scheduler, --workers names the quorum.

Start-up problems (a bad TF_CONFIG or flag, a port in use, a checkpoint that cannot be read or
written) are one line, ``<prog>: error: <problem>``, and exit status 2. SIGTERM or SIGINT at any
moment stops the server quietly with status 0, after a final checkpoint once it is serving.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports below: a stop during them is quiet too
    from pshard.common.entry import die_with_launcher, stop_quietly_on_signals

    stop_quietly_on_signals()
    die_with_launcher()

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pshard.common.argtypes import (
    float_range,
    int_range,
    listen_address,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    replicas,
)
from pshard.common.chunks import configure_shared_pool
from pshard.common.cluster.spec import (
    ClusterSpec,
    add_cluster_arguments,
    cluster_config_given,
    cluster_spec_from_args,
    exit_on_config_error,
)
from pshard.common.dirlock import DirectoryLock
from pshard.common.entry import STOP_SIGNALS, check_can_listen, metrics_address
from pshard.common.errors import CheckpointError, ClusterConfigError, PSError
from pshard.common.job import MODES, OPTIMIZERS, JobConfig, OptimizerConfig
from pshard.common.jobend import add_exit_argument, watch_job_end
from pshard.common.logs import add_log_level_argument, configure_logging
from pshard.common.metrics_flag import add_metrics_argument
from pshard.common.rpc.bind import default_bind, own_hosts
from pshard.common.rpc.options import DEFAULT_MAX_MESSAGE_BYTES
from pshard.common.security.credentials import SecurityConfig, add_security_arguments, security_from_args
from pshard.ps_server.heap import bound_heap
from pshard.ps_server.settings import DRAIN_TIMEOUT_S, ServerSettings

log = logging.getLogger("pshard.ps")

PROG = "python -m pshard.ps_server"
# gRPC's message limits are int32 byte counts.
MAX_MESSAGE_MB = (2**31 - 1) // 2**20


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="pshard parameter server: holds a shard of the model and answers push/pull over gRPC.",
        epilog="The job's consistency mode and optimizer normally come from the workers (their first "
               "Declare); the --mode/--optimizer flags set them for clients that send none.")
    add_cluster_arguments(p)
    p.add_argument("--bind", metavar="HOST:PORT", type=listen_address,
                   help="listen address (default: this task's TF_CONFIG address when its host is an "
                        "address of this machine, else every interface with its port; 127.0.0.1:0 without "
                        "TF_CONFIG)")
    p.add_argument("--workers", metavar="ID[,ID...]",
                   help="static sync quorum of worker ids (e.g. worker-0,worker-1) when no scheduler is used")
    p.add_argument("--no-scheduler", action="store_true",
                   help="do not register with a scheduler even if TF_CONFIG names one")
    job = p.add_argument_group("job defaults", "used only when the workers' Declare carries no job config")
    job.add_argument("--mode", choices=MODES, help="consistency mode")
    job.add_argument("--staleness", type=non_negative_int, default=0,
                     help="SSP staleness bound s (default 0)")
    job.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="server-side optimizer")
    job.add_argument("--lr", type=positive_float, default=0.01, help="learning rate (default 0.01)")
    job.add_argument("--momentum", type=float_range(0.0, 1.0), default=0.0, help="SGD momentum (default 0)")
    p.add_argument("--pull-timeout-s", type=positive_float, default=ServerSettings.pull_timeout_s,
                   help="longest a pull waits for its consistency condition "
                        f"(default {ServerSettings.pull_timeout_s:g})")
    p.add_argument("--replicas", type=replicas, default=ServerSettings.replicas,
                   help="backups per slice, the same on every server of the job: this server's slices are "
                        "copied to the next N live servers before a push is acknowledged, and one takes "
                        "over if it dies (default 0: none)")
    p.add_argument("--drain-on-term", action="store_true",
                   help="on SIGTERM, first hand every slice and table row partition this server serves to "
                        "its in-sync backup, or without replicas to the other servers once they hold copies "
                        "(the scheduler switches the layout; workers re-route), then leave the job and exit "
                        "0; needs a scheduler (docs/operations/scaling.md)")
    p.add_argument("--drain-timeout-s", type=positive_float, default=DRAIN_TIMEOUT_S,
                   help="with --drain-on-term: how long to wait for a backup to hold a copy of everything "
                        f"before giving up and stopping, exit 1 (default {DRAIN_TIMEOUT_S:g})")
    p.add_argument("--resume", action="store_true",
                   help="continue the checkpoint in --checkpoint-dir even if it is of another job (another "
                        "job id); without it such a checkpoint is set aside and the server starts fresh")
    p.add_argument("--hang-report-s", type=non_negative_float, default=ServerSettings.hang_report_s,
                   help="log (and show in stats) a sync clock that has waited this long for some workers' "
                        f"gradients, naming them; 0 = off (default {ServerSettings.hang_report_s:g})")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save the shard here (weights, optimizer state, clocks) and restore it on start")
    p.add_argument("--table-dir", metavar="DIR",
                   help="local directory where tables declared with memory_mb spill the rows beyond it (a "
                        "cache: wiped at start; use a local SSD); without it such tables are refused")
    p.add_argument("--global-checkpoint-dir", metavar="DIR",
                   default=os.environ.get("PSHARD_GLOBAL_CHECKPOINT_DIR") or None,
                   help="the only directory global checkpoints are written to and restored from: the "
                        "chief's --global-checkpoint-dir, on a file system both share (env "
                        "PSHARD_GLOBAL_CHECKPOINT_DIR); without it they are refused")
    p.add_argument("--checkpoint-write-mb-s", type=non_negative_float, default=0.0, metavar="MB_S",
                   help="write the tables of a global checkpoint taken in the background at most this many "
                        "MiB/s, so that training beside it keeps the host's CPU and disk (default 0: as "
                        "fast as the disk goes)")
    p.add_argument("--checkpoint-interval-s", type=non_negative_float, default=0.0,
                   help="also checkpoint every N seconds (default 0: only on request and at shutdown)")
    p.add_argument("--max-message-mb", type=int_range(1, MAX_MESSAGE_MB),
                   default=DEFAULT_MAX_MESSAGE_BYTES // 2**20,
                   help="largest unary message accepted, MiB, at most 2047 (gRPC's limit is an int32 of "
                        "bytes; default 64; bigger payloads use Exchange)")
    p.add_argument("--max-inflight-mb", type=positive_int, default=ServerSettings.max_inflight_bytes // 2**20,
                   help="budget of request bytes held at once; past it new requests get RESOURCE_EXHAUSTED "
                        "with a retry hint and clients back off (default "
                        f"{ServerSettings.max_inflight_bytes // 2**20}; a lone bigger request still passes)")
    p.add_argument("--waste-limit-mb", type=non_negative_int,
                   default=ServerSettings.waste_limit_bytes // 2**20,
                   help="a connection whose last requests, this many MiB of them, were all refused or "
                        "changed nothing (duplicate pushes) has its next ones held and refused unread until "
                        "it waits as asked, so a flood costs no reads (default "
                        f"{ServerSettings.waste_limit_bytes // 2**20}; 0 = off)")
    p.add_argument("--transport", choices=("auto", "shm", "tcp", "grpc"), default=ServerSettings.transport,
                   help="fast paths offered to workers besides gRPC: auto = shared memory and raw TCP "
                        f"(default {ServerSettings.transport})")
    p.add_argument("--update-threads", type=int_range(0, 256), default=ServerSettings.update_threads,
                   help="threads a large slice's optimizer update is split over (same results as one "
                        "thread); 0 = half the cores this process may use, 1 to 8. Opt-in (default 1): helps "
                        "Adam on a host with idle cores, measured slower for SGD beside GPU workers")
    p.add_argument("--fast-port", metavar="N", type=int_range(0, 65535),
                   default=os.environ.get("PSHARD_FAST_PORT", str(ServerSettings.fast_port)),
                   help="TCP port of the raw TCP fast path, on the --bind host: pin it to open it in a "
                        "firewall between hosts (docs/operations/ports.md); env PSHARD_FAST_PORT; "
                        "default 0: any free port")
    p.add_argument("--shm-dir", metavar="DIR", default=ServerSettings.shm_dir,
                   help="directory of the workers' shared-memory segments (default "
                        f"{ServerSettings.shm_dir})")
    add_security_arguments(p)
    add_metrics_argument(p)
    add_exit_argument(p)
    add_log_level_argument(p)
    return p


def _bind(args: argparse.Namespace, spec: ClusterSpec | None) -> str:
    if args.bind:
        return args.bind
    if spec is not None and spec.own_address:
        return default_bind(spec.listen_address, spec.own_address)
    return "127.0.0.1:0"


def _static_quorum(args: argparse.Namespace) -> Mapping[str, int] | None:
    if not args.workers:
        return None
    return {w.strip(): 0 for w in args.workers.split(",") if w.strip()}


def _check_checkpoint_dir(path: str, shard_name: str) -> None:
    """Fail at start, naming the flag, rather than at the first checkpoint minutes later.

    The directory must be writable, and a checkpoint already in it readable: its manifest is
    parsed here (cheap); the arrays are read when the store restores them.
    """
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".pshard-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ClusterConfigError(f"--checkpoint-dir: {path!r} is not a writable directory "
                                 f"({err.strerror or err})") from None
    manifest = os.path.join(path, f"{shard_name}.json")
    try:
        with open(manifest, "rb") as f:
            json.load(f)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ClusterConfigError(f"--checkpoint-dir: cannot read the checkpoint {manifest!r} "
                                 f"({reason})") from None


def _check_table_dir(path: str) -> None:
    """Fail at start, naming the flag, rather than at the first spill of a table with memory_mb."""
    if not os.path.isdir(path):
        raise ClusterConfigError(f"--table-dir: {path!r} is not a directory (create it, on a local disk)")
    try:
        # A probe of its own name: servers that share one --table-dir start at once, and a shared probe
        # name let one server remove the file another was about to remove (FileNotFoundError: "not writable").
        with tempfile.TemporaryFile(dir=path, prefix=".pshard-write-test-"):
            pass
    except OSError as err:
        raise ClusterConfigError(f"--table-dir: {path!r} is not writable ({err.strerror or err})") from None


def _settings(args: argparse.Namespace) -> ServerSettings:
    if args.checkpoint_dir:
        _check_checkpoint_dir(args.checkpoint_dir, ServerSettings.shard_name)
    if args.table_dir:
        _check_table_dir(args.table_dir)
    default_job = None
    if args.mode:
        default_job = JobConfig(mode=args.mode, staleness=args.staleness,
                                optimizer=OptimizerConfig(name=args.optimizer, lr=args.lr,
                                                          momentum=args.momentum))
    return ServerSettings(default_job=default_job, static_quorum=_static_quorum(args),
                          pull_timeout_s=args.pull_timeout_s, checkpoint_dir=args.checkpoint_dir,
                          table_dir=args.table_dir,
                          global_checkpoint_dir=args.global_checkpoint_dir,
                          checkpoint_write_mb_s=args.checkpoint_write_mb_s,
                          transport=args.transport, shm_dir=args.shm_dir, fast_port=args.fast_port,
                          max_inflight_bytes=args.max_inflight_mb * 2**20, hang_report_s=args.hang_report_s,
                          waste_limit_bytes=args.waste_limit_mb * 2**20,
                          resume=args.resume, replicas=args.replicas, update_threads=args.update_threads,
                          # Test hook only (ServerSettings.checkpoint_pause_dir); unset in production.
                          checkpoint_pause_dir=os.environ.get("PSHARD_TEST_CHECKPOINT_PAUSE_DIR") or None)


async def _run(args: argparse.Namespace, spec: ClusterSpec | None, settings: ServerSettings,
               bind: str, security: SecurityConfig) -> int:
    # The server's modules (grpc, the generated code, numba's kernels) load only once the flags and the
    # configuration are checked: --help and every usage error come first, within a fraction of a second.
    from pshard.common.metrics import serve_server_metrics
    from pshard.ps_server import service
    from pshard.ps_server.drain import drain
    from pshard.ps_server.follower import follow_scheduler
    from pshard.ps_server.handlers.dense import NO_QUORUM_GRACE_S
    from pshard.ps_server.tables.files import pointer_path

    # Handlers first: from here on a signal stops the server gracefully, start-up included.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    running = await service.start(settings, bind, args.max_message_mb * 2**20, security)
    security.warn_if_open("pshard ps")
    print(f"pshard ps: listening on port {running.port}", flush=True)
    metrics = None
    if args.metrics_port is not None:
        ckpt, shard = args.checkpoint_dir, settings.shard_name  # the dense manifest and the tables' pointer
        saved = (Path(ckpt, f"{shard}.json"), pointer_path(Path(ckpt), shard)) if ckpt else ()
        try:
            metrics = serve_server_metrics(running.handlers, loop, bind, args.metrics_port, saved,
                                           tables=running.tables, refusals=running.refusals)
        except OSError:  # the port was taken since main checked it: stop serving before saying so
            await running.stop(grace_s=0)
            raise
        print(f"pshard ps: metrics on port {metrics.port}", flush=True)
    follower = None
    drained = asyncio.Event()  # an operator drained this server (`pshard drain`): it stops, exit 0

    def left() -> None:
        drained.set()
        stop.set()

    def on_left() -> None:  # on the scheduler client's thread
        loop.call_soon_threadsafe(left)

    if spec is not None and not args.no_scheduler:
        follower = follow_scheduler(running, spec, loop, security, on_left=on_left)
    elif settings.static_quorum is None:
        log.warning("NO SYNC QUORUM: this server has neither --workers nor a scheduler (TF_CONFIG or "
                    "--scheduler), so it cannot know whom a sync clock waits for: sync pulls fail after %gs "
                    "saying so. Name the workers with --workers ID,ID,... or run it with the job's "
                    "scheduler; async jobs need neither", NO_QUORUM_GRACE_S)
    tasks: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
    if args.checkpoint_dir and args.checkpoint_interval_s > 0:
        tasks.append(asyncio.ensure_future(service.checkpoint_every(running, args.checkpoint_interval_s)))
    if args.exit_when_done is not None and follower is not None:
        requests = running.handlers.requests
        tasks.append(asyncio.ensure_future(watch_job_end(lambda: follower.view, lambda: requests.served,
                                                         args.exit_when_done)))
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if drained.is_set():
        log.warning("DRAINED: the scheduler handed what this server served to other servers (pshard drain); "
                    "leaving the job")
    elif args.drain_on_term and stop.is_set() and follower is not None:
        status = await drain(follower, args.drain_timeout_s)
    log.info("stopping")
    if follower is not None:
        follower.close()
    if args.checkpoint_dir and running.servicer.has_store:
        try:
            path, version = await running.servicer.checkpoint(0, 30.0)
            log.info("final checkpoint at version %d: %s", version, path)
        except PSError as err:  # a full or read-only disk: said in one line, and the server still stops
            log.error("final checkpoint failed: %s", err)
            status = 1
    await running.stop(grace_s=5.0)
    if metrics is not None:
        metrics.close()
    for task in tasks:
        task.cancel()
    return status


@exit_on_config_error(prog=PROG)
def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    bound_heap()  # before gRPC starts its threads: they take their arenas when they first allocate
    spec = None
    if cluster_config_given(args, os.environ):
        spec = cluster_spec_from_args(args, os.environ, default_task_type="ps")
        if spec.task_type != "ps":
            raise ClusterConfigError(
                f"task.type: got {spec.task_type!r} (index {spec.task_index}), but {prog} runs 'ps' "
                f"tasks; start a {spec.task_type!r} task with 'pshard run' or its own command")
    if args.drain_on_term and (spec is None or args.no_scheduler):
        parser.error("--drain-on-term: needs the job's scheduler (TF_CONFIG or --scheduler): it switches "
                     "the layout")
    settings = _settings(args)
    configure_shared_pool(settings.update_threads)  # before any slice exists: every slice takes this pool
    security = security_from_args(args, os.environ, role="ps", node_id=spec.node_id if spec else "",
                                  hosts=own_hosts(spec.own_address) if spec else [])
    bind = _bind(args, spec)
    check_can_listen(bind)
    if args.metrics_port:
        check_can_listen(metrics_address(bind, args.metrics_port))
    lock = _lock_checkpoint_dir(args.checkpoint_dir, spec)
    try:
        return asyncio.run(_run(args, spec, settings, bind, security))
    # An unreadable checkpoint, or the port lost since check_can_listen: start-up errors, as usage errors.
    except (OSError, CheckpointError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except PSError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.release()


def _lock_checkpoint_dir(path: str | None, spec: ClusterSpec | None) -> DirectoryLock | None:
    """This server's checkpoint directory, for as long as it runs: a second server (of another job, or
    a copy of this one) writing there would delete this one's files (pshard.common.dirlock)."""
    if not path:
        return None
    # PSHARD_JOB_ID: set by `pshard launch` for every child, so a refusal names the job too.
    owner = {"role": spec.node_id if spec is not None else "ps",
             "job_id": os.environ.get("PSHARD_JOB_ID", "")}
    try:
        return DirectoryLock.acquire(path, owner)
    except OSError as err:
        raise ClusterConfigError(f"--checkpoint-dir: cannot lock {path!r} ({err.strerror or err})") from None


if __name__ == "__main__":
    sys.exit(main())
