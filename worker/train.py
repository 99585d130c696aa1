"""One worker's training run: join the cluster, train on this worker's shard, and (chief) finish the job.

    host the scheduler (chief / worker 0 of a cluster without one)
    load the data -> build the model (same seed everywhere)
    join through the ClusterSession: register, layout, declare, barrier "start", full server quorum
    per batch: forward, backward, PSTrainer.step(), report the clock
    out of data: leave (the sync quorum shrinks at a clock boundary, nobody waits for us)
    chief: wait until nobody else is live, pull the final weights, evaluate, save the state_dict

Everything here reads its settings from a `TrainConfig`; `python -m pshard.worker` builds one from flags
and the environment. Each failure names the stage it happened in. The cluster protocol lives in
`pshard.worker.session`; this module only trains.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import IO

import numpy as np
import torch
from pshard.client.ps_client import PSClient
from pshard.common.errors import SlicesLostError
from pshard.common.metrics import (
    MetricsServer,
    WorkerMetrics,
    hosted_scheduler_collector,
    new_registry,
    serve_metrics,
)
from pshard.worker.checkpoint_coordinator import Checkpointer, restore_checkpoint
from pshard.worker.config import StageError, Stopped, TrainConfig, stage
from pshard.worker.data import Dataset, load_dataset
from pshard.worker.device import select_device
from pshard.worker.elastic import ClockPlan, roster_position
from pshard.worker.model import build_model, evaluate
from pshard.worker.run_report import MetricsLog, Progress
from pshard.worker.saved_model import describe, save_model
from pshard.worker.session import ClusterSession
from pshard.worker.tensorboard_log import TensorBoardLog, run_dir
from pshard.worker.torch_api import PSTrainer, param_specs
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("pshard.worker")

# A loss this many times the first one (or NaN/inf) means the run diverged.
DIVERGENCE_FACTOR = 100.0


@dataclass
class Outcome:
    steps: int = 0
    epoch: int = 0  # the last epoch trained in (counting from 0)
    train_loss: float = float("nan")  # mean over this worker's last epoch
    test_accuracy: float | None = None
    model_path: str | None = None
    failed: str | None = None
    skipped: int = 0  # planned steps the others trained while this worker was away (sync)
    loss_so_far: float = float("nan")  # mean over the epoch in progress, for a run stopped in mid-epoch
    # Gradient bytes before over bytes sent, with --compression (docs/guide/compression.md); None: off.
    compression_ratio: float | None = None
    # Weight bytes before over bytes pulled, with --pull-compression; None: off.
    pull_compression_ratio: float | None = None
    started: float = field(default_factory=time.monotonic)

    def final_line(self, role: str) -> str:
        parts = [f"final: role={role}"]
        if self.failed is not None:
            parts.append(f"failed={self.failed}")
        if self.test_accuracy is not None:
            parts.append(f"test_accuracy={self.test_accuracy:.4f}")
        parts += [f"steps={self.steps}"] + ([f"skipped={self.skipped}"] if self.skipped else [])
        stopped_early = self.failed == "stopped" and not math.isfinite(self.train_loss)
        if stopped_early:
            # Stopped (Ctrl-C, SIGTERM) before an epoch ended: no epoch's loss to show, and "nan" would
            # read as divergence. The epoch's loss so far says how it was going.
            if math.isfinite(self.loss_so_far):
                parts.append(f"epoch_loss_so_far={self.loss_so_far:.4f}")
        elif self.steps or math.isfinite(self.train_loss):
            # A worker that rejoined a finished job trained nothing: no loss to show, where "nan"
            # would read as divergence. A trainer whose loss is NaN after steps shows it.
            parts.append(f"train_loss={self.train_loss:.4f}")
        parts.append(f"time_s={time.monotonic() - self.started:.1f}")
        if self.compression_ratio is not None:
            parts.append(f"compression_ratio={self.compression_ratio:.1f}")
        if self.pull_compression_ratio is not None:
            parts.append(f"pull_compression_ratio={self.pull_compression_ratio:.1f}")
        if self.model_path is not None:
            parts.append(f"model={self.model_path}")
        return " ".join(parts)


def run(cfg: TrainConfig, stdout: IO[str] | None = None, runner: type[TrainingRun] | None = None) -> int:
    """Train; print exactly one `final:` line on stdout.

    0 on success, 1 when a stage failed, 128 + the signal when stopped (`Stopped`). A scheduler this
    task must host but cannot is a ClusterConfigError, raised before anything else started.
    """
    stdout = stdout if stdout is not None else sys.stdout
    role = "chief" if cfg.is_chief else "worker"
    session = ClusterSession(cfg.spec, startup_timeout_s=cfg.startup_timeout_s,
                             step_timeout_s=cfg.step_timeout_s, transport=cfg.transport,
                             shm_dir=cfg.shm_dir, security=cfg.security, bind=cfg.bind, replicas=cfg.replicas)
    session.host_scheduler_if_needed()
    job = (runner or TrainingRun)(cfg, stdout, session)  # runner: another model's run (worker.ctr)
    try:
        job.run()
        code = 0
    except StageError as e:
        lost = session.lost_server
        if isinstance(e.__cause__, SlicesLostError):  # the scheduler refused the failover: the whole story
            print(f"python -m pshard.worker: error: {e}", file=sys.stderr, flush=True)
            job.outcome.failed = "slices_lost"
        elif lost is not None:  # what the step in flight died of is only a consequence
            print(f"python -m pshard.worker: error: {lost.message} (while {e})", file=sys.stderr, flush=True)
            job.outcome.failed = "server_lost"
        elif session.fenced is not None:
            print(f"python -m pshard.worker: error: fenced out: {session.fenced} (while {e})",
                  file=sys.stderr, flush=True)
            job.outcome.failed = "fenced"
        else:
            print(f"python -m pshard.worker: error: {e}", file=sys.stderr, flush=True)
            job.outcome.failed = e.stage
        job.leave_quietly()
        code = 1
    except Stopped as stop:
        log.info("got %s: leaving the cluster and stopping", stop)
        job.outcome.failed = "stopped"
        job.leave_quietly()
        code = stop.exit_status
    finally:
        job.close()
    print(job.outcome.final_line(role), file=stdout, flush=True)
    return code


class TrainingRun:
    def __init__(self, cfg: TrainConfig, stdout: IO[str], session: ClusterSession) -> None:
        self.cfg = cfg
        self.outcome = Outcome()
        self.session = session
        self.role = "chief" if cfg.is_chief else "worker"
        self.metrics: MetricsLog | TensorBoardLog = MetricsLog(
            None if cfg.metrics in (None, "-") else cfg.metrics,
            stream=stdout if cfg.metrics == "-" else None,
            fields={"worker": cfg.spec.node_id, "role": self.role})
        if cfg.tensorboard is not None:
            self.metrics = TensorBoardLog(self.metrics, run_dir(cfg.tensorboard, cfg.spec.node_id))
        self.prometheus: WorkerMetrics | None = None
        self._metrics_server: MetricsServer | None = None
        if cfg.metrics_port is not None:
            registry = new_registry()
            self.prometheus = WorkerMetrics(registry, cfg.spec.node_id, self.role)
            if session.hosted_scheduler is not None:  # a TFJob's chief: its scheduler has no pod of its own
                registry.register(hosted_scheduler_collector(session.hosted_scheduler))
            self._metrics_server = serve_metrics(registry, "0.0.0.0", cfg.metrics_port)
            print(f"pshard worker: metrics on port {self._metrics_server.port}", file=sys.stderr, flush=True)
        self._first_loss: float | None = None
        self.progress = Progress(cfg.epochs, stream=sys.stderr, live_every_s=cfg.progress_every_s)
        self.trainer: PSTrainer | None = None
        self.data: Dataset | None = None
        self.checkpointer: Checkpointer | None = None

    # ---- the run ----

    def run(self) -> None:
        warn_learning_rate(self.cfg)
        self._join(self._prepare())
        with stage("training", "training"):
            self._train()
        if self.checkpointer is not None:  # the last one written in the background is committed first
            self.checkpointer.settle()
        self.session.leave()
        if self.cfg.is_chief:
            self._finish_chief()

    def _prepare(self) -> nn.Module:
        """Load this worker's data and build the model, with identical initial weights on every worker."""
        cfg, session = self.cfg, self.session
        with stage("data", "loading data"):
            self.data = load_dataset(cfg.data_dir)
            log.info("%s: %d training images in union batches of %d x %d; this worker is rank %d and takes "
                     "its piece of each clock's batch among the live workers", self.data.name,
                     len(self.data.train_y), cfg.spec.world_size, cfg.batch_size, session.rank)
        with stage("model", "building the model"):
            device = select_device(cfg.device)
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            torch.manual_seed(cfg.seed)  # identical initial weights on every worker
            return build_model(cfg.model, self.data.image_shape, self.data.num_classes).to(device)

    def _join(self, model: nn.Module) -> None:
        cfg, session = self.cfg, self.session
        session.register()
        layout = session.propose_layout(param_specs(model, cfg.job.mode))
        with stage("declare", f"declaring the parameters on {', '.join(layout.servers)}"):
            client = session.connect(layout)
            restored = None
            if cfg.global_checkpoint_dir:
                restored = restore_checkpoint(client, cfg.global_checkpoint_dir, cfg.job)
            with session.waiting_for_servers(layout):
                self.trainer = PSTrainer(model, client, cfg.job, local_optimizer=_local_optimizer(cfg, model),
                                         overlap=cfg.overlap, priority=cfg.priority)
        # A job that starts from a global checkpoint starts at its clock, and still at the start barrier:
        # only a worker whose job moved past it (restarted mid-job) skips the barrier everyone passed.
        clock = self.trainer.clock
        at_start = 0 if restored is not None and clock == restored else clock
        # async waits for nobody, so who counts does not matter
        session.await_start(at_start, wait_for_quorum=cfg.job.mode != "async")

    # ---- training ----

    def _train(self) -> None:
        cfg, data, trainer, session = self.cfg, self.data, self.trainer, self.session
        assert data is not None and trainer is not None
        # The shard plan (worker.elastic): every epoch is the same clocks whoever trains it; at each clock
        # the live trainers split its union batch. In sync mode clock p is the same data on every worker.
        # A worker whose clock is ahead of the plan (joined, restarted mid-job, or declared dead while
        # stopped and back) skips the clocks the others trained without it: it enters at the current
        # clock with the current weights and trains only what the plan still has (docs/architecture.md,
        # 8 Workers and 9 Failures).
        plan = ClockPlan(len(data.train_y), cfg.batch_size, cfg.spec.world_size, cfg.epochs, cfg.seed,
                         cfg.max_steps)
        for epoch in range(cfg.epochs):
            clocks = plan.epoch_clocks(epoch)
            total = len(clocks)
            if total <= 0:
                break
            skip = self._steps_to_skip(clocks.start, total)
            if skip == total:
                continue
            self.progress.start_epoch(epoch, total - skip)
            self.outcome.epoch = epoch
            losses, correct, seen, started = [], 0, 0, time.monotonic()
            loss_sum = 0.0
            for clock in clocks[skip:]:
                if self._steps_to_skip(clock, 1):
                    continue  # the clock jumped during this epoch: those batches were trained without us
                batch = plan.piece(clock, *self._position())
                step_started = time.perf_counter()
                loss, hits = self._step(data.train_x[batch], data.train_y[batch])
                self._check_divergence(loss)
                losses.append(loss)
                loss_sum += loss
                self.outcome.loss_so_far = loss_sum / len(losses)
                correct, seen = correct + hits, seen + len(batch)
                self.outcome.steps += 1
                session.report_clock(trainer.clock)
                every = cfg.checkpoint_every_steps
                if cfg.is_chief and every and cfg.global_checkpoint_dir and trainer.clock % every == 0:
                    self._checkpointer(trainer.client, cfg.global_checkpoint_dir).take(trainer.clock)
                if self.prometheus is not None:
                    self.prometheus.step(time.perf_counter() - step_started, self._push_pull_s, trainer.clock,
                                         loss)
                self.progress.update(samples=len(batch), loss=loss)
                if self.outcome.steps % cfg.log_every == 0:
                    self.metrics.log("step", step=self.outcome.steps, clock=trainer.clock, epoch=epoch + 1,
                                     loss=loss, accuracy=correct / seen,  # the epoch's so far, as samples/s
                                     samples_per_s=seen / max(time.monotonic() - started, 1e-9))
            if not losses:
                continue
            self.outcome.train_loss = float(np.mean(losses))
            self.progress.end_epoch(loss=self.outcome.train_loss, acc=correct / seen)
            elapsed = time.monotonic() - started
            self.metrics.log("epoch", epoch=epoch + 1, steps=len(losses), loss=self.outcome.train_loss,
                             accuracy=correct / seen, time_s=elapsed, samples_per_s=seen / max(elapsed, 1e-9))
            last = clocks.stop == plan.total_clocks
            if cfg.is_chief and not last:
                accuracy, test_loss = evaluate(trainer.model, data, trainer.device)
                self.metrics.log("eval", epoch=epoch + 1, step=self.outcome.steps, test_accuracy=accuracy,
                                 test_loss=test_loss)

    def _position(self) -> tuple[int, int]:
        """(position, members) of this worker among the live trainers, for this clock's piece."""
        session = self.session
        return roster_position(session.split_view(), self.cfg.spec.node_id, session.rank,
                               self.cfg.spec.world_size)

    def _steps_to_skip(self, planned: int, count: int) -> int:
        """Of the `count` planned steps from plan position `planned`, how many the sync clock has passed."""
        trainer = self.trainer
        assert trainer is not None
        if self.cfg.job.mode != "sync" or trainer.clock <= planned:
            return 0
        skip = min(count, trainer.clock - planned)
        if self._skipped_to != trainer.clock:
            first, self._skipped_to = self._skipped_to < 0, trainer.clock
            if self.cfg.spec.joining and first:
                log.info("joined the running job at clock %d with the current weights: this worker trains "
                         "its piece of every clock from there on", trainer.clock)
            else:
                log.warning("the job is at clock %d and this worker's shard plan at step %d: it was away "
                            "(declared dead, or restarted) while the others trained; it rejoins at clock %d "
                            "with the current weights and skips the planned steps before it", trainer.clock,
                            planned, trainer.clock)
        self.outcome.skipped += skip
        return skip

    _skipped_to = -1

    def _step(self, images: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        trainer = self.trainer
        assert trainer is not None
        x = torch.from_numpy(images).to(trainer.device, non_blocking=True)
        y = torch.from_numpy(labels).to(trainer.device, non_blocking=True)
        trainer.zero_grad()
        logits = trainer.model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        # A step refused for a generation we just left is resent by the PSClient (see session.py).
        started = time.perf_counter()
        trainer.step()
        self._push_pull_s = time.perf_counter() - started
        return float(loss.item()), int((logits.argmax(dim=1) == y).sum().item())

    _push_pull_s = 0.0

    def _check_divergence(self, loss: float) -> None:
        """NaN, infinite or exploding loss ends the run (exit 1): training on would waste the job."""
        if self._first_loss is None and math.isfinite(loss):
            self._first_loss = loss
        limit = DIVERGENCE_FACTOR * max(self._first_loss or 1.0, 1.0)
        if not math.isfinite(loss) or loss > limit:
            hint = (" (async/SSP apply every worker's push: try the learning rate divided by the number "
                    "of workers)" if self.cfg.job.mode != "sync" else " (try a smaller learning rate)")
            first = self._first_loss if self._first_loss is not None else math.nan
            raise StageError("diverged", f"training diverged at step {self.outcome.steps + 1}",
                             FloatingPointError(f"loss {loss:.4g} (first loss {first:.4g}, limit {limit:.4g})"
                                                f"{hint}"))

    # ---- the end ----

    def _checkpointer(self, client: PSClient, root: str) -> Checkpointer:
        if self.checkpointer is None:
            cfg = self.cfg
            self.checkpointer = Checkpointer(client, root, cfg.keep_checkpoints or None,
                                             cfg.checkpoint_background, cfg.checkpoint_full_every)
        return self.checkpointer

    def leave_quietly(self) -> None:
        self.session.leave_quietly()

    def _finish_chief(self) -> None:
        cfg, trainer, data = self.cfg, self.trainer, self.data
        assert trainer is not None and data is not None
        if trainer.aggregate:
            log.info("aggregate mode: the servers hold gradients, evaluating this worker's own weights")
        else:
            self.session.await_peers()
            with stage("final_pull", "pulling the final weights"):
                trainer.pull()
        with stage("evaluate", "evaluating on the test set"):
            accuracy, test_loss = evaluate(trainer.model, data, trainer.device)
            self.outcome.test_accuracy = accuracy
            self.metrics.log("eval", epoch=self.outcome.epoch + 1, step=self.outcome.steps,
                             test_accuracy=accuracy, test_loss=test_loss)
        if cfg.output:
            with stage("save", f"saving the model to {cfg.output}"):
                train_loss = self.outcome.train_loss
                self.outcome.model_path = save_model(trainer.model, cfg.output, describe(cfg, data, {
                    "test_accuracy": accuracy, "test_loss": test_loss, "steps": self.outcome.steps,
                    "train_loss": train_loss if math.isfinite(train_loss) else None}))

    def close(self) -> None:
        encoder = self.trainer.client.compression if self.trainer is not None else None
        if encoder is not None and encoder.stats.steps:
            self.outcome.compression_ratio = encoder.stats.ratio
        decoder = self.trainer.client.pull_compression if self.trainer is not None else None
        if decoder is not None and decoder.bytes_after:
            self.outcome.pull_compression_ratio = decoder.bytes_before / decoder.bytes_after
        if self._metrics_server is not None:
            self._metrics_server.close()
        self.progress.close()
        self.session.close()  # closes the PSClient, which the trainer's close() would do too
        self.metrics.log("final", role="chief" if self.cfg.is_chief else "worker", steps=self.outcome.steps,
                         train_loss=self.outcome.train_loss, test_accuracy=self.outcome.test_accuracy,
                         failed=self.outcome.failed, model=self.outcome.model_path,
                         time_s=time.monotonic() - self.outcome.started)
        self.metrics.close()


def warn_learning_rate(cfg: TrainConfig) -> str | None:
    """Async and SSP servers apply every worker's push, so n workers take n steps per round of
    batches: the sync learning rate is about n times too big there (docs/guide/modes.md, "Learning rates")."""
    workers, opt = cfg.spec.world_size, cfg.job.optimizer
    if cfg.job.mode == "sync" or workers < 2 or opt.name == "aggregate":
        return None
    message = (f"{cfg.job.mode} mode applies every worker's push: with {workers} workers, lr={opt.lr:g} "
               f"moves the model about {workers}x as far per round of batches as in sync mode, so a "
               f"learning rate that suits sync should be divided by {workers} here "
               "(docs/guide/modes.md: 'Learning rates')")
    log.warning("%s", message)
    return message


def _local_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer | None:
    """Aggregate mode: the torch optimizer each worker applies to the mean gradient."""
    if cfg.job.optimizer.name != "aggregate":
        return None
    opt = cfg.job.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.local_optimizer == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if cfg.local_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=opt.lr, weight_decay=opt.weight_decay)
    kind = torch.optim.AdamW if cfg.local_optimizer == "adamw" else torch.optim.Adam
    return kind(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
