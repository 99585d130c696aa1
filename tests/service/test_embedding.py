"""PSEmbedding and PSEmbeddingBag under PSTrainer against real servers: a model mixing tables and dense
layers trains exactly as the same model does in plain torch (nn.Embedding(sparse=True) and
nn.EmbeddingBag(sparse=True) with torch's sparse optimizers, dense layers with SGD)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.table import initial_rows
from pshard.worker.embedding import PSEmbedding, PSEmbeddingBag
from pshard.worker.torch_api import PSTrainer
from torch import nn

from .conftest import WAIT_S

UNIVERSE = (np.arange(40, dtype=np.int64) * 7919 + 10**12)  # ids far beyond any dense index
DIM, LR = 4, 0.2


class Model(nn.Module):
    def __init__(self, emb: nn.Module, bag: nn.Module) -> None:
        super().__init__()
        self.emb, self.bag = emb, bag
        torch.manual_seed(0)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, single: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.emb(single), self.bag(bags)], dim=1)).squeeze(1)


def test_a_model_of_tables_and_dense_layers_trains_as_plain_torch(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    servers = [start_server(ServerSettings(static_quorum={"w0": 0}, pull_timeout_s=WAIT_S)) for _ in range(2)]
    emb_kw = {"optimizer": "adagrad", "lr": LR, "initializer": "normal", "init_scale": 0.5,
              "initial_accumulator_value": 0.1}
    bag_kw = {"optimizer": "sgd", "lr": LR, "initializer": "uniform", "init_scale": 0.5}
    ps_model = Model(PSEmbedding(DIM, "emb", **emb_kw), PSEmbeddingBag(DIM, "bag", mode="mean", **bag_kw))
    trainer = PSTrainer(ps_model, new_client(servers, "w0"),
                        JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR)))

    ref_emb = nn.Embedding(len(UNIVERSE), DIM, sparse=True)
    ref_emb.weight.data = torch.from_numpy(initial_rows(ps_model.emb.config, UNIVERSE))
    ref_bag = nn.EmbeddingBag(len(UNIVERSE), DIM, mode="mean", sparse=True)
    ref_bag.weight.data = torch.from_numpy(initial_rows(ps_model.bag.config, UNIVERSE))
    ref = Model(ref_emb, ref_bag)
    opts = [torch.optim.Adagrad(ref_emb.parameters(), lr=LR, initial_accumulator_value=0.1, eps=1e-8),
            torch.optim.SGD(ref_bag.parameters(), lr=LR), torch.optim.SGD(ref.head.parameters(), lr=LR)]

    rng = np.random.default_rng(3)
    for _ in range(6):
        single, bags = rng.integers(0, 40, 16), rng.integers(0, 40, (16, 3))  # repeats within and across
        y = torch.from_numpy(rng.normal(size=16).astype(np.float32))
        trainer.zero_grad()
        nn.functional.mse_loss(ps_model(torch.from_numpy(UNIVERSE[single]), torch.from_numpy(UNIVERSE[bags])),
                               y).backward()
        trainer.step()
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(ref(torch.from_numpy(single), torch.from_numpy(bags)), y).backward()
        for opt in opts:
            opt.step()

    with torch.no_grad():
        got_emb = ps_model.emb(torch.from_numpy(UNIVERSE)).numpy()
        got_bag = ps_model.bag(torch.from_numpy(UNIVERSE[:, None])).numpy()
    np.testing.assert_allclose(got_emb, ref_emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bag, ref_bag.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ps_model.head.weight.detach().numpy(), ref.head.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(got_emb, initial_rows(ps_model.emb.config, UNIVERSE))


def test_a_module_without_a_client_or_with_float_ids_says_so() -> None:
    emb = PSEmbedding(DIM, "lonely")
    with pytest.raises(InvalidArgumentError, match="table 'lonely': the module has no client"):
        emb(torch.tensor([1]))
    with pytest.raises(InvalidArgumentError, match="mode 'max'"):
        PSEmbeddingBag(DIM, "b", mode="max")
