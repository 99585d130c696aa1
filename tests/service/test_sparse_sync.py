"""A sync table with dense sync layers: two workers on halves of each batch end where one process
ends on the whole batch (union-batch equivalence), and a pull waits for every worker's push."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.errors import PullTimeoutError, StaleGenerationError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.table import initial_rows
from pshard.worker.embedding import PSEmbedding
from pshard.worker.torch_api import PSTrainer
from torch import nn

from .conftest import WAIT_S

UNIVERSE = np.arange(30, dtype=np.int64) * 104729 + 5
DIM, LR, STEPS, BATCH = 3, 0.3, 5, 12
QUORUM = {"w0": 0, "w1": 0}


class Model(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        torch.manual_seed(0)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(dim=1)).squeeze(1)


def _batches() -> list[tuple[np.ndarray, torch.Tensor]]:
    rng = np.random.default_rng(5)
    return [(rng.integers(0, len(UNIVERSE), (BATCH, 2)),
             torch.from_numpy(rng.normal(size=BATCH).astype(np.float32))) for _ in range(STEPS)]


def test_two_workers_on_halves_train_as_one_on_the_whole_batch(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    servers = [start_server(ServerSettings(static_quorum=QUORUM, pull_timeout_s=WAIT_S)) for _ in range(2)]
    table_kw = {"optimizer": "sgd", "lr": LR, "initializer": "normal", "init_scale": 0.5, "mode": "sync"}
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
    batches = _batches()
    models = [Model(PSEmbedding(DIM, "emb", **table_kw)) for _ in range(2)]
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            trainer = PSTrainer(models[w], new_client(servers, f"w{w}"), job)
            half = slice(w * BATCH // 2, (w + 1) * BATCH // 2)
            for ids, y in batches:
                trainer.zero_grad()
                out = models[w](torch.from_numpy(UNIVERSE[ids[half]]))
                nn.functional.mse_loss(out, y[half]).backward()
                trainer.step()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)

    config = models[0].emb.config
    ref_emb = nn.Embedding(len(UNIVERSE), DIM, sparse=True)
    ref_emb.weight.data = torch.from_numpy(initial_rows(config, UNIVERSE))
    ref = Model(ref_emb)
    opts = [torch.optim.SGD(ref_emb.parameters(), lr=LR), torch.optim.SGD(ref.head.parameters(), lr=LR)]
    for ids, y in batches:
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(ref(torch.from_numpy(ids)), y).backward()
        for opt in opts:
            opt.step()

    reader = new_client(servers, "w0")
    reader.declare_table(config)
    np.testing.assert_allclose(reader.pull_rows("emb", UNIVERSE), ref_emb.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(models[1].head.weight.detach().numpy(), ref.head.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref_emb.weight.detach().numpy(), initial_rows(config, UNIVERSE))


def test_a_sync_pull_waits_for_the_quorum_and_strangers_are_refused(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    server = start_server(ServerSettings(static_quorum=QUORUM, pull_timeout_s=0.5))
    config = TableConfig("s", 2, lr=1.0, mode="sync")
    w0, w1, stranger = (new_client([server], w) for w in ("w0", "w1", "w9"))
    for c in (w0, w1, stranger):
        c.declare_table(config)
    ids = np.array([4], np.int64)
    init = initial_rows(config, ids)
    w0.push_rows("s", ids, np.full((1, 2), 2.0, np.float32), clock=0)
    with pytest.raises(PullTimeoutError, match=r"table 's' at clock 1: clock 0 still waits for \['w1'\]"):
        w0.pull_rows("s", ids, clock=1)
    with pytest.raises(StaleGenerationError, match="worker 'w9' is not in the quorum"):
        stranger.push_rows("s", ids, np.ones((1, 2), np.float32), clock=0)
    w1.push_rows("s", np.zeros(0, np.int64), np.zeros((0, 2), np.float32), clock=0)  # nothing to add
    np.testing.assert_array_equal(w0.pull_rows("s", ids, clock=1), init - 1.0)  # the mean of 2 and 0
