"""`--model ctr`: a click-through-rate model with its embeddings in a sparse table, on a synthetic click log.

The model is wide & deep over one `PSEmbedding` table shared by every field (ids are distinct across
fields, pshard.worker.ctr_data): each id's row holds a wide weight (column 0) and a `dim`-vector fed,
concatenated over the fields, to an MLP. The table's rows live on the servers, created on first
touch and trained there by per-row Adagrad, asynchronously; the MLP's dense parameters live on the
same servers and train in the job's mode (sync in `make demo-ctr`). One table, not one per field,
so a step makes one pull and one push per server whatever the number of fields.

Each worker trains, on the CPU (--device does not apply), on its shard of the log: every world-th
chunk, generated on the fly. The chief then pulls the final weights and scores the test set, and its
final line puts the model's test AUC beside the planted model's AUC on the same impressions, the
ceiling:

    final: role=chief test_auc=0.7612 ceiling_auc=0.7808 steps=... train_loss=... time_s=...
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch
from pshard.common.compression import CASTS
from pshard.common.job import JobConfig
from pshard.worker.config import TrainConfig, stage
from pshard.worker.ctr_data import CHUNK, ClickLog, Clicks, auc
from pshard.worker.embedding import PSEmbedding
from pshard.worker.session import ClusterSession
from pshard.worker.train import Outcome, TrainingRun, run
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("pshard.worker")

TABLE = "ctr_ids"
EMBEDDING_DIM = 8
HIDDEN = (128, 64)
_EVAL_BATCH = 8192


class CtrModel(nn.Module):
    """Logits (N,) of ids (N, fields): the sum of the ids' wide weights plus an MLP of their embeddings."""

    def __init__(self, fields: int, dim: int = EMBEDDING_DIM, hidden: tuple[int, ...] = HIDDEN,
                 **table: Any) -> None:
        super().__init__()
        self.embedding = PSEmbedding(dim + 1, table=TABLE, **table)
        layers: list[nn.Module] = []
        width = fields * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids)  # (N, fields, 1 + dim)
        return rows[..., 0].sum(dim=1) + self.mlp(rows[..., 1:].flatten(1)).squeeze(1)


def build_ctr_model(cfg: TrainConfig, fields: int) -> CtrModel:
    # Rows start near zero, as the planted weights' mean; Adagrad suits ids seen at very different rates.
    return CtrModel(fields, optimizer="adagrad", lr=cfg.table_lr, initializer="normal", init_scale=0.01,
                    seed=cfg.seed, mode="async", row_dtype=cfg.table_row_dtype,
                    compression=table_compression(cfg.job))


def table_compression(job: JobConfig) -> str:
    """The table's row pushes take the job's cast (`--compression bf16` or `fp16`); top-k, random-k and
    sign are for the dense parameters (a push of rows is sparse already)."""
    name = job.compression.compressor.name
    return name if name in CASTS else "none"


def scores(model: nn.Module, ids: np.ndarray) -> np.ndarray:
    """Click probabilities of `ids` (N, fields), pulling the rows in batches; no gradients are kept."""
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), _EVAL_BATCH):
            out.append(torch.sigmoid(model(torch.from_numpy(ids[start:start + _EVAL_BATCH]))).numpy())
    model.train()
    return np.concatenate(out) if out else np.zeros(0, np.float32)


@dataclass
class CtrOutcome(Outcome):
    test_auc: float | None = None
    ceiling_auc: float | None = None

    def final_line(self, role: str) -> str:
        line = super().final_line(role)
        if self.test_auc is None or self.ceiling_auc is None:
            return line
        final, role_field, rest = line.split(" ", 2)
        return " ".join([final, role_field, f"test_auc={self.test_auc:.4f}",
                         f"ceiling_auc={self.ceiling_auc:.4f}", rest])


class CtrRun(TrainingRun):
    """TrainingRun's cluster protocol (join, leave, the chief's end) with the click log and CtrModel."""

    def __init__(self, cfg: TrainConfig, stdout: IO[str], session: ClusterSession) -> None:
        super().__init__(cfg, stdout, session)
        self.stdout = stdout
        self.outcome: CtrOutcome = CtrOutcome()
        self.clicks: ClickLog | None = None

    def _prepare(self) -> nn.Module:
        cfg, session = self.cfg, self.session
        with stage("data", "generating the click log"):
            self.clicks = ClickLog(cfg.ctr)
            log.info("click log: %d fields, %d ids, %d training impressions; this worker's shard is rank %d "
                     "of %d", cfg.ctr.fields, sum(cfg.ctr.vocab_sizes), cfg.ctr.train_chunks * CHUNK,
                     session.rank, cfg.spec.world_size)
        with stage("model", "building the model"):
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            torch.manual_seed(cfg.seed)  # identical dense weights on every worker
            return build_ctr_model(cfg, cfg.ctr.fields)

    def _train(self) -> None:
        cfg, clicks, trainer, session = self.cfg, self.clicks, self.trainer, self.session
        assert clicks is not None and trainer is not None
        per_chunk = max(CHUNK // cfg.batch_size, 1)
        per_epoch = len(range(session.rank, cfg.ctr.train_chunks, cfg.spec.world_size)) * per_chunk
        planned = 0  # the plan's step; in sync mode, the clock it trains (see TrainingRun._train)
        for epoch in range(cfg.epochs):
            total = min(per_epoch, cfg.max_steps - planned) if cfg.max_steps else per_epoch
            if total <= 0:
                break
            self.progress.start_epoch(epoch, total)
            self.outcome.epoch = epoch
            losses: list[float] = []
            seen, started = 0, time.monotonic()
            for chunk in clicks.shard(session.rank, cfg.spec.world_size):
                for start in range(0, per_chunk * cfg.batch_size, cfg.batch_size):
                    if len(losses) == total:
                        break
                    planned += 1
                    if self._steps_to_skip(planned - 1, 1):
                        continue  # the others trained this clock while we were away
                    loss = self._ctr_step(chunk, start)
                    self._check_divergence(loss)
                    losses.append(loss)
                    seen += cfg.batch_size
                    self.outcome.steps += 1
                    session.report_clock(trainer.clock)
                    self.progress.update(samples=cfg.batch_size, loss=loss)
                    if self.outcome.steps % cfg.log_every == 0:
                        rate = seen / max(time.monotonic() - started, 1e-9)
                        self.metrics.log("step", step=self.outcome.steps, clock=trainer.clock,
                                         epoch=epoch + 1, loss=loss, samples_per_s=rate)
                if len(losses) == total:
                    break
            if not losses:
                continue
            self.outcome.train_loss = float(np.mean(losses))
            self.progress.end_epoch(loss=self.outcome.train_loss)
            self.metrics.log("epoch", epoch=epoch + 1, steps=len(losses), loss=self.outcome.train_loss,
                             time_s=time.monotonic() - started)

    def _ctr_step(self, chunk: Clicks, start: int) -> float:
        trainer = self.trainer
        assert trainer is not None
        end = start + self.cfg.batch_size
        ids = torch.from_numpy(chunk.ids[start:end])
        labels = torch.from_numpy(chunk.labels[start:end])
        trainer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(trainer.model(ids), labels)
        loss.backward()
        trainer.step()
        return float(loss.item())

    def _finish_chief(self) -> None:
        trainer, clicks = self.trainer, self.clicks
        assert trainer is not None and clicks is not None
        self.session.await_peers()
        with stage("final_pull", "pulling the final weights"):
            trainer.pull()
        with stage("evaluate", "scoring the test set"):
            # Before scoring: a pull creates the rows of unseen test ids too.
            rows = sum(int(r.rows) for r in trainer.client.tables.stats(TABLE))
            test = clicks.test_set
            predicted = scores(trainer.model, test.ids)
            self.outcome.test_auc = auc(test.labels, predicted)
            self.outcome.ceiling_auc = auc(test.labels, test.prob)
            eps = 1e-7
            p = np.clip(predicted.astype(np.float64), eps, 1 - eps)
            test_loss = float(-np.mean(test.labels * np.log(p) + (1 - test.labels) * np.log1p(-p)))
            self.metrics.log("eval", epoch=self.outcome.epoch + 1, step=self.outcome.steps,
                             test_auc=self.outcome.test_auc, ceiling_auc=self.outcome.ceiling_auc,
                             test_loss=test_loss, test_samples=len(test), table_rows=rows)
        got, ceiling = self.outcome.test_auc, self.outcome.ceiling_auc
        print(f"CTR test AUC {got:.4f}, planted model (ceiling) {ceiling:.4f}, gap {ceiling - got:.4f} "
              f"on {len(test)} test impressions; {rows} embedding rows trained on the servers",
              file=self.stdout, flush=True)


def run_ctr(cfg: TrainConfig, stdout: IO[str] | None = None) -> int:
    return run(cfg, stdout, runner=CtrRun)
