"""What a worker, chief or evaluator task runs with (`TrainConfig`), its defaults, and how a run fails.

Every default is written once, in `Defaults`; the flags of ``python -m pshard.worker`` and the
dataclass both read it. A run is a sequence of named stages (register, barrier, training, ...);
a failure in one becomes a `StageError` whose stage ends up in the task's `final:` line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

from pshard.common.cluster.spec import ClusterSpec
from pshard.common.errors import ClusterConfigError, PSError
from pshard.common.job import JobConfig
from pshard.common.security.credentials import SecurityConfig
from pshard.worker.ctr_data import CtrSpec

LOCAL_OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad")
# What --model and --device accept, here rather than beside the torch code that builds them, so that the
# worker's flags parse without importing torch (worker.model, worker.ctr, worker.device use these).
MODELS = ("mlp", "cnn")
CTR_MODEL = "ctr"
DEVICES = ("auto", "cpu", "cuda")


class Defaults:
    """One place for every worker default (flags and `TrainConfig` alike)."""

    MODEL = "cnn"
    EPOCHS = 2
    BATCH_SIZE = 64  # per worker
    MAX_STEPS = 0  # 0 = no limit
    SEED = 0
    DEVICE = "auto"
    THREADS = 0  # 0 = torch's default
    LOCAL_OPTIMIZER = "sgd"
    LOG_EVERY = 100
    # Off a terminal (the launcher, compose, Kubernetes): a progress line this often, in seconds.
    PROGRESS_EVERY_S = 10.0
    # Longest wait for the scheduler, the servers and the other workers. Generous: in a TFJob the
    # pods start in any order, and pulling an image can take minutes.
    STARTUP_TIMEOUT_S = 300.0
    # Longest one push/pull may take, waiting for peers included.
    STEP_TIMEOUT_S = 120.0
    EVAL_INTERVAL_S = 30.0
    # How push/pull bytes travel: auto = shared memory with a same-host server, else raw TCP, else gRPC.
    TRANSPORT = "auto"
    SHM_DIR = "/dev/shm"
    TABLE_LR = 0.05  # --model ctr: per-row Adagrad of the embedding table


@dataclass(frozen=True)
class TrainConfig:
    spec: ClusterSpec
    job: JobConfig
    data_dir: str
    model: str = Defaults.MODEL
    epochs: int = Defaults.EPOCHS
    batch_size: int = Defaults.BATCH_SIZE
    max_steps: int = Defaults.MAX_STEPS
    seed: int = Defaults.SEED
    device: str = Defaults.DEVICE
    threads: int = Defaults.THREADS  # torch CPU threads
    output: str | None = None  # the chief saves the final state_dict here
    metrics: str | None = None  # JSON lines; "-" = stdout
    local_optimizer: str = Defaults.LOCAL_OPTIMIZER  # aggregate mode: the torch optimizer each worker runs
    log_every: int = Defaults.LOG_EVERY  # a "step" metrics line every N steps
    progress_every_s: float = Defaults.PROGRESS_EVERY_S  # off a terminal, a progress line this often
    startup_timeout_s: float = Defaults.STARTUP_TIMEOUT_S
    step_timeout_s: float = Defaults.STEP_TIMEOUT_S
    eval_interval_s: float = Defaults.EVAL_INTERVAL_S  # evaluator tasks: seconds between evaluations
    transport: str = Defaults.TRANSPORT  # auto, shm, tcp or grpc (PSClient)
    # PSTrainer pushes during backward and lands weights at the next forward. Off by default: on 2 cores,
    # where the communication thread and the servers compete with backward, it measured 0.79x of local
    # torch.optim against 0.97x without it (make bench's training figure).
    overlap: bool = False
    priority: bool = False  # with overlap: layer priority (pshard.worker.priority)
    replicas: int = 0  # backups per slice, proposed with the layout (docs/architecture.md, 9 Failures)
    shm_dir: str = Defaults.SHM_DIR  # where shared-memory segments are created
    metrics_port: int | None = None  # serve Prometheus metrics on 0.0.0.0:PORT (0: a free port)
    tensorboard: str | None = None  # also write the metrics as TensorBoard scalars under DIR/<node id>
    # Global checkpoints (worker.checkpoint_coordinator): restored at start when one is committed there; the
    # chief
    # takes one every N clocks (0: never) and keeps the newest K (0: all).
    global_checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 0
    checkpoint_background: bool = False  # the chief trains on while the servers write (issue 22)
    checkpoint_full_every: int = 1  # K > 1: a full checkpoint, then K - 1 incremental ones
    # TLS files or tokens of every channel (pshard.common.security.credentials); default plain.
    security: SecurityConfig = field(default_factory=SecurityConfig)
    bind: str | None = None  # where a chief hosting the scheduler listens (None: pshard.common.rpc.bind)
    serve: bool = False  # --serve: run a coordinator's scheduled functions (pshard.worker.serve)
    # --model ctr: the synthetic click log (pshard.worker.ctr_data) and its table's learning rate.
    ctr: CtrSpec = field(default_factory=CtrSpec)
    table_lr: float = Defaults.TABLE_LR
    table_row_dtype: str = "float32"  # how the table stores and sends rows (pshard.common.sparse.ROW_DTYPES)

    @property
    def is_chief(self) -> bool:
        """The chief, or worker 0 when the cluster has none (TensorFlow's rule)."""
        spec = self.spec
        return spec.task_type == "chief" or (spec.task_type == "worker" and spec.task_index == 0
                                             and not spec.chief)


def default_job_id(spec: ClusterSpec) -> str:
    """The same on every task of one cluster: a digest of TF_CONFIG's cluster part."""
    cluster = {job: list(spec.job(job)) for job in ("scheduler", "chief", "ps", "worker", "evaluator")}
    return "tf-" + hashlib.sha256(json.dumps(cluster, sort_keys=True).encode()).hexdigest()[:12]


class StageError(PSError):
    """A run failed; `stage` is a short name for the final line, the message says what and why."""

    def __init__(self, stage: str, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {type(cause).__name__}: {cause}")
        self.stage = stage


@contextlib.contextmanager
def stage(name: str, what: str) -> Iterator[None]:
    """Run a stage of the run; any failure in it becomes a StageError naming it.

    A ClusterConfigError passes through: the entry point reports it as a configuration error.
    """
    try:
        yield
    except (StageError, ClusterConfigError):
        raise
    except Exception as e:
        raise StageError(name, what, e) from e


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived: unwinds the run like KeyboardInterrupt, leaving the cluster on the way.

    A BaseException, so that `stage()` and `except Exception` let it through.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """128 + the signal, as a shell reports a process the signal ended: not a finished run."""
        return 128 + self.signum


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_signals_at_once() -> None:
    """Until `stop_on_signals` takes over: SIGTERM and SIGINT end the process at once, quietly.

    For the start-up, while torch is imported: nothing to leave or close yet.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_at_once)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside, SIGTERM and SIGINT raise `Stopped` in the main thread. Further ones are ignored: the
    stop is under way, and whoever insists sends SIGKILL (as the launcher does after its grace)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; an embedding caller owns signals
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
