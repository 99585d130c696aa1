"""Your model, checked (issue 17, item 10): small but real architectures trained by one worker on real
servers (in-process, 127.0.0.1 port 0) end with what the same local torch.optim run gives, buffers
included: a ResNet-style convnet with BatchNorm, an nn.TransformerEncoder, an LSTM and an EmbeddingBag
model, with server-side SGD (momentum, a StepLR schedule) and Adam.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.worker.torch_api import PSTrainer
from torch import nn
from torch.nn import functional as F
from torch.optim import lr_scheduler

WAIT_S = 20.0
STEPS = 5
Batch = tuple[torch.Tensor, ...]

def _prefixed(prefix: str) -> Callable[[str], str]:
    """assert_close's msg: its own message under `prefix` (the key that differs)."""
    return lambda message: f"{prefix}: {message}"



class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(ResidualBlock(8), ResidualBlock(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="mean")
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids, offsets))


def images(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def tokens(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 20, (6, 7), generator=g), torch.randint(0, 3, (6,), generator=g)


def sequences(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 5, 6, generator=g), torch.randint(0, 3, (6,), generator=g)


def bags(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 50, (24,), generator=g), torch.arange(0, 24, 3),
            torch.randint(0, 2, (8,), generator=g))


SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
ADAM = OptimizerConfig(name="adam", lr=0.01)


def local_optimizer(config: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    if config.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay, foreach=False)
    return torch.optim.Adam(model.parameters(), lr=config.lr, foreach=False)


# name: (model, batches, optimizer, with a StepLR schedule)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Batch], OptimizerConfig, bool]] = {
    "resnet-batchnorm": (ResNet, images, SGD, True),
    # SGD: the attention's key bias gets gradients of pure rounding noise (softmax ignores it), which Adam
    # would blow up to lr-sized steps, so an ulp of difference anywhere changes them completely.
    "transformer-encoder": (Transformer, tokens, SGD, False),
    "lstm": (LSTMClassifier, sequences, ADAM, False),
    "embedding-bag": (BagModel, bags, ADAM, True),
}


@pytest.fixture
def servers() -> Iterator[list[ServerThread]]:
    started = [start_server_thread(ServerSettings(static_quorum={"w0": 0}, pull_timeout_s=WAIT_S))
               for _ in range(2)]
    yield started
    for server in started:
        server.stop(grace_s=0.2)


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: Callable[[int], Batch],
          schedule: bool) -> None:
    sched = lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    model.train()
    for step in range(STEPS):
        *inputs, target = batches(step)
        opt.zero_grad()
        F.cross_entropy(model(*inputs), target).backward()
        opt.step()
        if sched is not None:
            sched.step()


def built(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make()


@pytest.mark.parametrize("case", CASES)
def test_one_worker_trains_as_local_torch_optim(servers, case) -> None:
    make, batches, config, schedule = CASES[case]
    want = built(make)
    train(want, local_optimizer(config, want), batches, schedule)

    model = built(make)
    client = PSClient([s.address for s in servers], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S)
    with PSTrainer(model, client, JobConfig(mode="sync", optimizer=config)) as trainer:
        train(model, trainer, batches, schedule)
        assert trainer.clock == STEPS

    got, expected = model.state_dict(), want.state_dict()
    assert list(got) == list(expected)
    assert any("running_mean" in k for k in got) == (case == "resnet-batchnorm")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6,
                                   msg=_prefixed(f"{case} {key}"))
