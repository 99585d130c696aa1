"""One worker's training run: join the cluster, train on this worker's shard, and (chief) finish the job.

    host the scheduler (chief / worker 0 of a cluster without one)
    load the data -> build the model (same seed everywhere) -> register with the scheduler
    agree on the layout -> declare the parameters -> barrier "start" -> servers see the full quorum
    per batch: forward, backward, PSTrainer.step(), report the clock
    out of data: leave (the sync quorum shrinks at a clock boundary, nobody waits for us)
    chief: wait until nobody else is live, pull the final weights, evaluate, save the state_dict

Everything here reads its settings from a `TrainConfig`; `python -m pshard.worker` builds one from flags
and the environment. Each failure names the stage it happened in.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch
from pshard.common.cluster import ClusterSpec, split_address
from pshard.common.errors import PSError, PullTimeoutError, StaleGenerationError
from pshard.common.job import JobConfig
from pshard.common.scheduler_client import SchedulerClient
from pshard.common.view import ClusterView
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread
from pshard.worker.client import PSClient
from pshard.worker.data import Dataset, batches, load_dataset, num_batches, shard
from pshard.worker.device import select_device
from pshard.worker.metrics import MetricsLog, Progress
from pshard.worker.model import build_model
from pshard.worker.torch_api import PSTrainer, param_specs
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("pshard.worker")

LOCAL_OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad")
_EVAL_BATCH = 1000


@dataclass(frozen=True)
class TrainConfig:
    spec: ClusterSpec
    job: JobConfig
    data_dir: str
    model: str = "cnn"
    epochs: int = 2
    batch_size: int = 64  # per worker
    max_steps: int = 0  # 0 = no limit
    seed: int = 0
    device: str = "auto"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    output: str | None = None  # the chief saves the final state_dict here
    metrics: str | None = None  # JSON lines; "-" = stdout
    local_optimizer: str = "sgd"  # aggregate mode: the torch optimizer each worker runs
    log_every: int = 100  # a "step" metrics line every N steps
    startup_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    eval_interval_s: float = 30.0  # evaluator tasks: seconds between evaluations

    @property
    def is_chief(self) -> bool:
        """The chief, or worker 0 when the cluster has none (TensorFlow's rule)."""
        spec = self.spec
        return spec.task_type == "chief" or (spec.task_type == "worker" and spec.task_index == 0
                                             and not spec.chief)


class StageError(PSError):
    """Training failed; `stage` is a short name for the final line, the message says what and why."""

    def __init__(self, stage: str, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {type(cause).__name__}: {cause}")
        self.stage = stage


@contextlib.contextmanager
def stage(name: str, what: str) -> Iterator[None]:
    """Run a stage of the run; any failure in it becomes a StageError naming it."""
    try:
        yield
    except StageError:
        raise
    except Exception as e:
        raise StageError(name, what, e) from e


@dataclass
class Outcome:
    steps: int = 0
    epoch: int = 0  # the last epoch trained in (counting from 0)
    train_loss: float = float("nan")  # mean over this worker's last epoch
    test_accuracy: float | None = None
    model_path: str | None = None
    failed: str | None = None
    started: float = field(default_factory=time.monotonic)

    def final_line(self, role: str) -> str:
        parts = [f"final: role={role}"]
        if self.failed is not None:
            parts.append(f"failed={self.failed}")
        if self.test_accuracy is not None:
            parts.append(f"test_accuracy={self.test_accuracy:.4f}")
        parts += [f"steps={self.steps}", f"train_loss={self.train_loss:.4f}",
                  f"time_s={time.monotonic() - self.started:.1f}"]
        if self.model_path is not None:
            parts.append(f"model={self.model_path}")
        return " ".join(parts)


def run(cfg: TrainConfig, stdout: IO[str] | None = None) -> int:
    """Train; print exactly one `final:` line on stdout. 0 on success, 1 when a stage failed."""
    stdout = stdout if stdout is not None else sys.stdout
    role = "chief" if cfg.is_chief else "worker"
    job = TrainingRun(cfg, stdout)
    try:
        job.run()
        code = 0
    except StageError as e:
        print(f"python -m pshard.worker: error: {e}", file=sys.stderr, flush=True)
        job.outcome.failed = e.stage
        job.leave_quietly()
        code = 1
    finally:
        job.close()
    print(job.outcome.final_line(role), file=stdout, flush=True)
    return code


class TrainingRun:
    def __init__(self, cfg: TrainConfig, stdout: IO[str]) -> None:
        self.cfg = cfg
        self.outcome = Outcome()
        self.rank = cfg.spec.data_rank or 0
        self.world_size = cfg.spec.world_size
        self.metrics = MetricsLog(None if cfg.metrics in (None, "-") else cfg.metrics,
                                  stream=stdout if cfg.metrics == "-" else None)
        self.progress = Progress(cfg.epochs, stream=sys.stderr)
        self.scheduler: SchedulerHandle | None = None
        self.sched: SchedulerClient | None = None
        self.client: PSClient | None = None
        self.trainer: PSTrainer | None = None
        self.data: Dataset | None = None
        self._left = False

    # ---- the run ----

    def run(self) -> None:
        cfg = self.cfg
        if cfg.spec.hosts_scheduler:
            with stage("scheduler", "starting the in-process scheduler"):
                port = split_address(cfg.spec.scheduler_address)[1]
                self.scheduler = start_scheduler_thread(f"0.0.0.0:{port}")
        with stage("data", "loading data"):
            self.data = load_dataset(cfg.data_dir)
            log.info("%s: %d training images, this worker's shard is rank %d of %d", self.data.name,
                     len(self.data.train_y), self.rank, self.world_size)
        with stage("model", "building the model"):
            device = select_device(cfg.device)
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            torch.manual_seed(cfg.seed)  # identical initial weights on every worker
            model = build_model(cfg.model, self.data.image_shape, self.data.num_classes).to(device)
        self._join(model)
        with stage("training", "training"):
            self._train()
        self._leave()
        if cfg.is_chief:
            self._finish_chief()

    def _join(self, model: nn.Module) -> None:
        cfg, spec = self.cfg, self.cfg.spec
        with stage("register", f"registering with the scheduler at {spec.scheduler_address}"):
            self.sched = SchedulerClient(spec.scheduler_address, spec.task_type,
                                         own_address=spec.own_address or "", node_id=spec.node_id,
                                         rank_hint=self.rank, connect_timeout_s=cfg.startup_timeout_s)
            self.sched.register()
        with stage("layout", "agreeing on the parameter layout"):
            layout = self.sched.propose_layout(param_specs(model), servers=spec.ps)
        with stage("declare", f"declaring the parameters on {', '.join(layout.servers)}"):
            sched = self.sched
            # Read at every request: after a scheduler restart the SchedulerClient re-registers under a
            # new generation, and the servers refuse requests stamped with the old one (fencing).
            self.client = PSClient(layout.servers, spec.node_id, generation=lambda: sched.generation,
                                   layout=layout, timeout_s=cfg.step_timeout_s)
            self.trainer = PSTrainer(model, self.client, cfg.job,
                                     local_optimizer=_local_optimizer(cfg, model))
        if self.trainer.clock == 0:  # a worker restarted mid-job must not wait for a start everyone passed
            with stage("barrier", f"waiting for {self.world_size} workers at the start barrier"):
                self.sched.barrier("start", count=self.world_size, timeout_s=cfg.startup_timeout_s)
        if cfg.job.mode != "async":  # async waits for nobody, so who counts does not matter
            with stage("quorum", "waiting for the servers to see every worker"):
                view = self.sched.view
                self._await_server_quorum(set(view.live_workers()) if view else set())

    def _await_server_quorum(self, expected: set[str]) -> None:
        """Before clock 0, every server must count every worker, or a sync clock completes without one.

        The barrier proves the scheduler has everyone; the servers learn it from the Watch stream,
        a moment later. Polling GetStats is cheap and happens once.
        """
        assert self.trainer is not None
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        delay = 0.02
        while True:
            quorums = [set(s.quorum) for s in self.trainer.client.stats()]
            if all(expected <= q for q in quorums):
                return
            if time.monotonic() > deadline:
                raise PullTimeoutError(f"after {self.cfg.startup_timeout_s:g} s the servers' quorums are "
                                       f"{[sorted(q) for q in quorums]}, expected {sorted(expected)}")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # ---- training ----

    def _train(self) -> None:
        cfg, data, trainer = self.cfg, self.data, self.trainer
        assert data is not None and trainer is not None and self.sched is not None
        for epoch in range(cfg.epochs):
            indices = shard(len(data.train_y), self.rank, self.world_size, epoch, cfg.seed)
            total = num_batches(len(indices), cfg.batch_size)
            if cfg.max_steps:
                total = min(total, cfg.max_steps - self.outcome.steps)
            if total <= 0:
                break
            self.progress.start_epoch(epoch, total)
            self.outcome.epoch = epoch
            losses, correct, seen, started = [], 0, 0, time.monotonic()
            for batch in itertools.islice(batches(indices, cfg.batch_size), total):
                loss, hits = self._step(data.train_x[batch], data.train_y[batch])
                losses.append(loss)
                correct, seen = correct + hits, seen + len(batch)
                self.outcome.steps += 1
                self.sched.report_clock(trainer.clock)
                self.progress.update(loss=loss)
                if self.outcome.steps % cfg.log_every == 0:
                    self.metrics.log("step", step=self.outcome.steps, clock=trainer.clock, epoch=epoch,
                                     loss=loss)
            self.outcome.train_loss = float(np.mean(losses))
            self.progress.end_epoch(loss=self.outcome.train_loss, acc=correct / seen)
            self.metrics.log("epoch", epoch=epoch, steps=len(losses), loss=self.outcome.train_loss,
                             accuracy=correct / seen, time_s=time.monotonic() - started)
            last = epoch == cfg.epochs - 1 or self.outcome.steps == cfg.max_steps
            if cfg.is_chief and not last:
                accuracy, test_loss = evaluate(trainer.model, data, trainer.device)
                self.metrics.log("eval", epoch=epoch, test_accuracy=accuracy, test_loss=test_loss)

    def _step(self, images: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        trainer = self.trainer
        assert trainer is not None
        x = torch.from_numpy(images).to(trainer.device, non_blocking=True)
        y = torch.from_numpy(labels).to(trainer.device, non_blocking=True)
        trainer.zero_grad()
        logits = trainer.model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        self._push_pull()
        return float(loss.item()), int((logits.argmax(dim=1) == y).sum().item())

    def _push_pull(self) -> None:
        """trainer.step(), once more if a re-registration overtook it.

        After a scheduler restart a server can hear of our new generation (through its own Watch)
        before our SchedulerClient has the Register reply: the step, stamped with the old one, is
        refused. Repeating it under the new generation is safe: servers drop slices they already have.
        """
        assert self.trainer is not None and self.sched is not None
        sched, stamped = self.sched, self.sched.generation
        try:
            self.trainer.step()
        except StaleGenerationError:
            try:
                sched.wait_for_view(lambda _view: sched.generation > stamped, self.cfg.step_timeout_s)
            except PullTimeoutError:
                raise StaleGenerationError(f"fenced out at generation {stamped} and not re-registered "
                                           f"within {self.cfg.step_timeout_s:g} s") from None
            log.info("re-registered as generation %d: repeating step %d", sched.generation,
                     self.trainer.clock)
            self.trainer.step()

    # ---- the end ----

    def _leave(self) -> None:
        """Out of data: leave, so the sync quorum shrinks at this clock boundary and peers go on."""
        if self.sched is not None and not self._left:
            with stage("leave", "leaving the cluster"):
                self.sched.leave()
            self._left = True

    def leave_quietly(self) -> None:
        """After a failure: leave if we can, so nobody waits for us; the failure is reported already."""
        try:
            self._leave()
        except StageError as e:
            log.warning("%s", e)

    def _finish_chief(self) -> None:
        cfg, trainer, data = self.cfg, self.trainer, self.data
        assert trainer is not None and data is not None
        if trainer.aggregate:
            log.info("aggregate mode: the servers hold gradients, evaluating this worker's own weights")
        else:
            with stage("peers", "waiting for the other workers to finish"):
                self._await_peers()
            with stage("final_pull", "pulling the final weights"):
                trainer.pull()
        with stage("evaluate", "evaluating on the test set"):
            accuracy, test_loss = evaluate(trainer.model, data, trainer.device)
            self.outcome.test_accuracy = accuracy
            self.metrics.log("eval", epoch=self.outcome.epoch, test_accuracy=accuracy, test_loss=test_loss)
        if cfg.output:
            with stage("save", f"saving the model to {cfg.output}"):
                self.outcome.model_path = save_state_dict(trainer.model, cfg.output)

    def _await_peers(self) -> None:
        """Until no other worker is live; gives up (saying so) when none progressed for a step timeout."""
        assert self.sched is not None
        me = self.cfg.spec.node_id

        def nobody_else(view: ClusterView) -> bool:
            return not set(view.live_workers()) - {me}

        progress = self._peer_clocks()
        while True:
            try:
                self.sched.wait_for_view(nobody_else, timeout_s=self.cfg.step_timeout_s)
                return
            except PullTimeoutError:
                now = self._peer_clocks()
                if now == progress:
                    view = self.sched.view
                    log.warning("workers %s are live but made no progress in %g s; using the weights as "
                                "they are", sorted(set(view.live_workers()) - {me}) if view else "?",
                                self.cfg.step_timeout_s)
                    return
                progress = now

    def _peer_clocks(self) -> dict[str, int]:
        assert self.trainer is not None
        clocks: dict[str, int] = {}
        with contextlib.suppress(PSError):
            for stats in self.trainer.client.stats():
                for worker, clock in stats.worker_clocks.items():
                    clocks[worker] = max(clocks.get(worker, -1), clock)
        return clocks

    def close(self) -> None:
        self.progress.close()
        if self.client is not None:
            self.client.close()  # what the trainer's close() would do; the trainer may not exist
        if self.sched is not None:
            self.sched.close()
        if self.scheduler is not None:
            self.scheduler.stop()
        self.metrics.log("final", role="chief" if self.cfg.is_chief else "worker", steps=self.outcome.steps,
                         train_loss=self.outcome.train_loss, test_accuracy=self.outcome.test_accuracy,
                         failed=self.outcome.failed, model=self.outcome.model_path,
                         time_s=time.monotonic() - self.outcome.started)
        self.metrics.close()


def evaluate(model: nn.Module, data: Dataset, device: torch.device) -> tuple[float, float]:
    """(accuracy, mean loss) on the test split."""
    model.eval()
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(data.test_y), _EVAL_BATCH):
            x = torch.from_numpy(data.test_x[start:start + _EVAL_BATCH]).to(device)
            y = torch.from_numpy(data.test_y[start:start + _EVAL_BATCH]).to(device)
            logits = model(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    model.train()
    n = max(len(data.test_y), 1)
    return correct / n, total_loss / n


def save_state_dict(model: nn.Module, path: str) -> str:
    """A plain torch state_dict on CPU; written aside and renamed, so nobody reads half a file."""
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, partial)
    partial.replace(target)
    return str(target)


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
