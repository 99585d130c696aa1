"""python -m pshard.worker (or pshard worker): train on the pshard cluster this process's TF_CONFIG describes.

Flags and the environment (TF_CONFIG, PSHARD_DATA_DIR) are read here, once, into a frozen
`TrainConfig`; worker.train does the rest (worker.evaluate for an evaluator task).

Exit status: 0 trained; 1 a training stage failed (the message names it); 2 a configuration
error, one line ``<prog>: error: <problem>`` and no traceback: a bad flag or TF_CONFIG, a task
type this command does not run (ps, scheduler), an --output or --metrics path it cannot write, or
(the chief hosting the scheduler) a port in use. SIGTERM or SIGINT at any moment, start-up
included, is a quiet stop with status 128 + the signal (143 for SIGTERM): the run did not finish,
so the launcher, like a shell, must not count it as trained. A worker stopped after joining
leaves the cluster first, so its peers do not wait for it.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch's import, which takes seconds: a stop during it is quiet too
    from pshard.common.entry import die_with_launcher
    from pshard.worker.config import exit_on_signals_at_once

    exit_on_signals_at_once()
    die_with_launcher()

import os

# Set before torch is imported. OpenMP's threads busy-wait after every torch op by default; on a
# host the worker shares with servers and peers, that spinning starves the gRPC threads carrying
# the push/pull (a loaded 2-core run measured 430 ms per step instead of 25 ms). Passive waiting
# keeps torch's parallelism.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import importlib.util
import sys
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
from pshard.common.cluster.spec import (
    ClusterSpec,
    add_cluster_arguments,
    cluster_spec_from_args,
    exit_on_config_error,
)
from pshard.common.compression import Compression
from pshard.common.errors import ClusterConfigError, InvalidArgumentError
from pshard.common.job import MODES, NONFINITE, OPTIMIZERS, WIRE_DTYPES, JobConfig, OptimizerConfig
from pshard.common.logs import add_log_level_argument, configure_logging
from pshard.common.metrics_flag import add_metrics_argument
from pshard.common.rpc.bind import own_hosts
from pshard.common.security.credentials import add_security_arguments, security_from_args
from pshard.worker.config import (
    CTR_MODEL,
    DEVICES,
    LOCAL_OPTIMIZERS,
    MODELS,
    Defaults,
    Stopped,
    TrainConfig,
    default_job_id,
    stop_on_signals,
)
from pshard.worker.ctr_flags import add_ctr_arguments, ctr_settings
from pshard.worker.data import default_data_dir

PROG = "python -m pshard.worker"
# Learning rates that train the default CNN well, per optimizer (aggregate: per local optimizer).
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3, "adagrad": 0.01}
D = Defaults


def build_parser(environ: Mapping[str, str], prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="pshard worker: trains on its shard of the data, pushing gradients to and "
        "pulling weights from the parameter servers. The chief (or worker 0 without one) evaluates and "
        "saves the model; every process prints one 'final:' line.")
    add_cluster_arguments(p)
    job = p.add_argument_group("job", "must be the same on every worker (the first declaration wins)")
    job.add_argument("--mode", choices=MODES, default="sync", help="consistency mode (default sync)")
    job.add_argument("--staleness", metavar="N", type=non_negative_int, default=0,
                     help="ssp: how many clocks the fastest worker may run ahead (default 0)")
    job.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                     help="server-side optimizer; 'aggregate' = servers average, workers apply "
                          "--local-optimizer (default sgd)")
    job.add_argument("--local-optimizer", choices=LOCAL_OPTIMIZERS, default=D.LOCAL_OPTIMIZER,
                     help="aggregate mode: the torch optimizer each worker runs "
                          f"(default {D.LOCAL_OPTIMIZER})")
    job.add_argument("--lr", type=positive_float, default=None,
                     help="learning rate (default: sgd 0.05, adam/adamw 0.001, adagrad 0.01)")
    job.add_argument("--momentum", type=float_range(0.0, 1.0), default=0.9, help="SGD momentum (default 0.9)")
    job.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="weight decay (default 0)")
    job.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="",
                     help="cast gradients and weights to this on the wire (default '': as stored)")
    job.add_argument("--compression", metavar="COMPRESSOR", default="none",
                     help="how gradients travel: none, topk:K or randomk:K (the fraction K in (0, 1] of each "
                          "slice), sign (1 bit per element and a scale), bf16 or fp16 (the same as "
                          "--wire-dtype); see docs/guide/compression.md (default none)")
    job.add_argument("--compression-rule", metavar="PATTERN=COMPRESSOR", action="append", default=[],
                     help="parameters whose name matches the fnmatch PATTERN use COMPRESSOR instead, e.g. "
                          "'*.bias=none'; repeatable, the first match wins; a pattern matching no parameter "
                          "is refused")
    job.add_argument("--compression-min-numel", metavar="N", type=non_negative_int, default=0,
                     help="tensors of fewer than N elements travel uncompressed (default 0)")
    job.add_argument("--pull-compression", metavar="COMPRESSOR", default="none",
                     help="how the compressed parameters' weights come back: none (whole), topk:K or "
                          "sign, as the change since this worker's last pull, the servers keeping what they "
                          "did not send; see docs/guide/compression.md, Compressed pulls (default none)")
    job.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                     help="drop what a lossy compressor does not send, instead of adding it to the next "
                          "gradient (error feedback is on by default)")
    job.add_argument("--job-id", default=environ.get("PSHARD_JOB_ID", ""),
                     help="this run's identity: servers restore only a checkpoint of the same job "
                          "(default $PSHARD_JOB_ID, which `pshard launch` sets to a new id per launch, else "
                          "one derived from TF_CONFIG's cluster; give each new run its own when re-using "
                          "a --checkpoint-dir with the same TF_CONFIG)")
    job.add_argument("--nonfinite", choices=NONFINITE, default="reject",
                     help="what servers do with a pushed gradient holding NaN or Inf: reject the push "
                          "(INVALID_ARGUMENT naming key and index), skip it (counted), or allow it "
                          "(default reject)")
    train = p.add_argument_group("training")
    train.add_argument("--model", choices=(*MODELS, CTR_MODEL), default=D.MODEL,
                       help=f"model (default {D.MODEL}); ctr: a CTR model with sparse embeddings (see below)")
    train.add_argument("--epochs", metavar="N", type=positive_int, default=D.EPOCHS,
                       help=f"epochs (default {D.EPOCHS})")
    train.add_argument("--batch-size", metavar="N", type=positive_int, default=D.BATCH_SIZE,
                       help=f"batch size per worker (default {D.BATCH_SIZE})")
    train.add_argument("--max-steps", metavar="N", type=non_negative_int, default=D.MAX_STEPS,
                       help="stop after N steps (default 0: no limit)")
    train.add_argument("--join", action="store_true",
                       help="join a running job as a new worker: --task-index may lie beyond TF_CONFIG's "
                            "worker list (which still lists the workers the job started with); it enters "
                            "the sync quorum at the next clock with the current weights")
    train.add_argument("--seed", metavar="N", type=int_range(0, 2**32 - 1), default=D.SEED,
                       help=f"seed of the initial weights and of the shuffling (default {D.SEED})")
    train.add_argument("--threads", metavar="N", type=int_range(0, 4096), default=D.THREADS,
                       help="torch CPU threads (default 0: torch's default, one per core)")
    train.add_argument("--device", choices=DEVICES, default=D.DEVICE,
                       help="auto = CUDA when available, else CPU (default auto)")
    train.add_argument("--data-dir", metavar="DIR", default=default_data_dir(environ),
                       help="Fashion-MNIST IDX files; scikit-learn's digits when absent (default "
                            "$PSHARD_DATA_DIR or /usr/share/datasets/fashion-mnist)")
    out = p.add_argument_group("output")
    out.add_argument("--output", metavar="PATH", help="the chief saves the final state_dict here")
    out.add_argument("--metrics", metavar="PATH", help="append JSON-lines metrics here ('-' = stdout)")
    out.add_argument("--tensorboard", metavar="DIR",
                     help="also write loss, accuracy and samples/s as TensorBoard scalars to DIR/<node id>")
    out.add_argument("--eval-interval-s", metavar="S", type=positive_float, default=D.EVAL_INTERVAL_S,
                     help="evaluator tasks: seconds between evaluations of the latest weights "
                          f"(default {D.EVAL_INTERVAL_S:g})")
    out.add_argument("--log-every", metavar="N", type=positive_int, default=D.LOG_EVERY,
                     help=f"a 'step' metrics line every N steps (default {D.LOG_EVERY})")
    out.add_argument("--progress-every-s", metavar="S", type=positive_float, default=D.PROGRESS_EVERY_S,
                     help="off a terminal (launcher, compose, Kubernetes): a progress line with step, loss "
                          f"and samples/s this often (default {D.PROGRESS_EVERY_S:g})")
    out.add_argument("--global-checkpoint-dir", metavar="DIR",
                     help="global checkpoints (a directory the servers and the chief share): restored at "
                          "start from the newest committed one, on any number of servers; the chief writes "
                          "them")
    out.add_argument("--checkpoint-every-steps", metavar="N", type=non_negative_int, default=0,
                     help="the chief takes a global checkpoint every N clocks (default 0: never)")
    out.add_argument("--keep-checkpoints", metavar="K", type=non_negative_int, default=0,
                     help="keep the newest K global checkpoints (default 0: all), and the links they need")
    out.add_argument("--checkpoint-background", action="store_true",
                     help="the chief trains on while the servers write each global checkpoint (they copy "
                          "their part in memory first: about the size of their shard and tables, once)")
    out.add_argument("--checkpoint-full-every", metavar="K", type=positive_int, default=1,
                     help="with K > 1, a full global checkpoint then K-1 incremental ones, each holding only "
                          "the table rows and slices changed since the previous one (default 1: all full)")
    add_metrics_argument(out, host="0.0.0.0", environ=environ)
    add_ctr_arguments(p)
    add_log_level_argument(p)
    add_security_arguments(p)
    p.add_argument("--bind", metavar="HOST:PORT", type=listen_address, default=None,
                   help="where a chief (or worker 0) that hosts the scheduler listens (default: its "
                        "TF_CONFIG address when that host is an address of this machine, else every "
                        "interface with its port)")
    p.add_argument("--transport", choices=("auto", "shm", "tcp", "grpc"), default=D.TRANSPORT,
                   help="how push/pull bytes travel: auto = shared memory with a server on this host, "
                        "else a raw TCP socket, else gRPC (default auto; gRPC is always the fallback)")
    p.add_argument("--replicas", type=replicas, default=int(os.environ.get("PSHARD_REPLICAS") or 0),
                   help="backups per slice (give every server the same --replicas): a step whose server "
                        "died is sent again to the backup the scheduler promotes (default 0: none)")
    p.add_argument("--overlap", action="store_true",
                   help="push each bucket of gradients as soon as backward produces it and land the weights "
                        "layer by layer at the next forward (PSTrainer's overlap), instead of one exchange "
                        "after backward; it pays where compute and network do not share the same few cores")
    p.add_argument("--priority", action="store_true",
                   help="with --overlap: push the queued bucket nearest the model's input first and pull "
                        "apart, first layers first, so the next forward starts before the whole model "
                        "arrived (ByteScheduler's layer priority); it pays where the link bounds a step")
    p.add_argument("--shm-dir", metavar="DIR", default=D.SHM_DIR,
                   help=f"directory of shared-memory segments, shared with the servers (default {D.SHM_DIR})")
    p.add_argument("--serve", action="store_true", default=_serve_default(environ),
                   help="run the functions a coordinator (the chief task, pshard.coordinator."
                        "ClusterCoordinator) schedules, one at a time, until it leaves, instead of "
                        "training on its own; the training flags are the coordinator's then "
                        "(docs/guide/coordinator.md). Default: $PSHARD_SERVE (1 or 0), so that "
                        "'pshard run' serves in a coordinator's job")
    limits = p.add_argument_group("timeouts")
    limits.add_argument("--startup-timeout-s", metavar="S", type=positive_float, default=D.STARTUP_TIMEOUT_S,
                        help="longest wait for the scheduler, the servers and the other workers "
                             f"(default {D.STARTUP_TIMEOUT_S:g})")
    limits.add_argument("--step-timeout-s", metavar="S", type=positive_float, default=D.STEP_TIMEOUT_S,
                        help="longest one push/pull may take, waiting for peers included "
                             f"(default {D.STEP_TIMEOUT_S:g})")
    return p


def _serve_default(environ: Mapping[str, str]) -> bool:
    raw = environ.get("PSHARD_SERVE", "").strip().lower()
    if raw not in ("", "0", "1", "true", "false"):
        raise ClusterConfigError(f"PSHARD_SERVE: got {raw!r}, expected 1 or 0 (a worker of a coordinator's "
                                 "job serves its functions: pshard worker --serve)")
    return raw in ("1", "true")


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # Each number's range is its flag's type (common.argtypes); what is left spans flags.
    if args.join and args.model == CTR_MODEL:  # its click-log shards are static (worker.ctr)
        parser.error("--join: the CTR model's shards are fixed by TF_CONFIG's workers; join an image model")
    if args.priority and not args.overlap:
        parser.error("--priority: given without --overlap; layer priority orders the overlapped buckets, "
                     "so add --overlap")


def _check_writable(flag: str, path: str, *, create: bool) -> None:
    """Fail now, not after an hour of training, when `path` cannot be written.

    `create`: the file is appended to from the start (metrics), so opening it is the test. Else
    (the model, written at the end) a probe file in its directory, which is created as the save
    would create it.
    """
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "is a directory")
        if create:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a"):
                pass
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = target.with_name(f".{target.name}.{os.getpid()}.write-test")
        with probe.open("w"):
            pass
        probe.unlink()
    except OSError as err:
        raise ClusterConfigError(f"{flag}: cannot write {path!r} ({err.strerror or err})") from None


def _cluster(args: argparse.Namespace, environ: Mapping[str, str], prog: str) -> ClusterSpec:
    spec = cluster_spec_from_args(args, environ, default_task_type="worker")
    if spec.task_type not in ("chief", "worker", "evaluator"):
        program = "pshard ps" if spec.task_type == "ps" else "pshard scheduler"
        raise ClusterConfigError(f"task.type: got {spec.task_type!r}, which {prog} does not run; "
                                 f"start it with {program}")
    if not spec.ps:
        raise ClusterConfigError("cluster.ps: got no parameter servers, a worker needs at least one")
    return spec


def _job(args: argparse.Namespace, spec: ClusterSpec) -> JobConfig:
    local = args.local_optimizer if args.optimizer == "aggregate" else args.optimizer
    sgd = local == "sgd"
    try:
        return JobConfig(mode=args.mode, staleness=args.staleness, wire_dtype=args.wire_dtype,
                         nonfinite=args.nonfinite, job_id=args.job_id or default_job_id(spec),
                         compression=Compression.from_flags(args.compression, args.compression_rule,
                                                            args.compression_min_numel, args.error_feedback,
                                                            args.pull_compression),
                         optimizer=OptimizerConfig(name=args.optimizer,
                                                   lr=DEFAULT_LR[local] if args.lr is None else args.lr,
                                                   momentum=args.momentum if sgd else 0.0,
                                                   weight_decay=args.weight_decay))
    except InvalidArgumentError as e:
        raise ClusterConfigError(str(e)) from None


def config_from_args(argv: Sequence[str] | None, environ: Mapping[str, str], prog: str = PROG) -> TrainConfig:
    parser = build_parser(environ, prog)
    args = parser.parse_args(argv)
    _check_numbers(parser, args)
    configure_logging(args.log_level)
    spec = _cluster(args, environ, prog)
    security = security_from_args(args, environ, role=spec.task_type, node_id=spec.node_id,
                                  hosts=own_hosts(spec.own_address))
    if args.device == "cuda":  # asking for CUDA where there is none is a configuration error
        from pshard.worker.device import select_device  # torch, which auto and cpu need only to train

        select_device(args.device)
    if args.output:
        _check_writable("--output", args.output, create=False)
    if args.metrics and args.metrics != "-":
        _check_writable("--metrics", args.metrics, create=True)
    if args.tensorboard:
        from pshard.worker.tensorboard_log import run_dir  # its MetricsLog's tqdm: only with the flag

        probe = run_dir(args.tensorboard, spec.node_id) / "events"  # the run's directory is created and tried
        _check_writable("--tensorboard", str(probe), create=False)
    return TrainConfig(
        spec=spec, job=_job(args, spec), data_dir=args.data_dir, model=args.model,
        epochs=args.epochs, batch_size=args.batch_size, max_steps=args.max_steps, seed=args.seed,
        device=args.device, threads=args.threads, output=args.output, metrics=args.metrics,
        local_optimizer=args.local_optimizer, log_every=args.log_every,
        progress_every_s=args.progress_every_s,
        startup_timeout_s=args.startup_timeout_s, step_timeout_s=args.step_timeout_s,
        eval_interval_s=args.eval_interval_s, transport=args.transport, overlap=args.overlap,
        priority=args.priority,
        shm_dir=args.shm_dir, replicas=max(0, args.replicas),
        metrics_port=args.metrics_port, tensorboard=args.tensorboard,
        global_checkpoint_dir=args.global_checkpoint_dir,
        checkpoint_every_steps=max(0, args.checkpoint_every_steps),
        keep_checkpoints=max(0, args.keep_checkpoints), checkpoint_background=args.checkpoint_background,
        checkpoint_full_every=args.checkpoint_full_every, security=security, bind=args.bind, serve=args.serve,
        **ctr_settings(args, spec))


@exit_on_config_error(prog=PROG)
def _main(argv: Sequence[str] | None, environ: Mapping[str, str], prog: str) -> int:
    cfg = config_from_args(argv, environ, prog)
    cfg.security.warn_if_open(prog)  # after every check: a refused start stays one line
    # The runners import torch (seconds on a loaded host): only now, so that --help and every
    # configuration error above come first, within a fraction of a second.
    if cfg.spec.task_type == "evaluator":
        from pshard.worker.evaluate import run_evaluator

        return run_evaluator(cfg)
    if cfg.serve:
        from pshard.worker.serve import run_serving  # grpc's server side, for this mode only

        return run_serving(cfg)
    if cfg.model == CTR_MODEL:
        from pshard.worker.ctr import run_ctr

        return run_ctr(cfg)
    from pshard.worker.train import run

    return run(cfg)


def _require_torch() -> None:
    """ModuleNotFoundError naming torch when it is not installed (a server image), found without importing
    it: `pshard` then says which extra to install (pshard.cli.missing_extra), --help included, rather than
    take flags for a run that cannot start."""
    if importlib.util.find_spec("torch") is None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
         prog: str = PROG) -> int:
    _require_torch()
    with stop_on_signals():
        try:
            return _main(argv, os.environ if environ is None else environ, prog=prog)
        except Stopped as stop:  # before the run began; a running one reports it itself
            return stop.exit_status


if __name__ == "__main__":
    sys.exit(main())
