"""torch.optim.lr_scheduler driving the server-side optimizer through PSTrainer (issue 17, item 4).

One worker against a real server (in-process, 127.0.0.1 port 0) ends with the weights that the same
model, data and schedule give with a local torch.optim optimizer; the trainer's state_dict resumes a
run mid-schedule; a push whose lr disagrees with its clock's earlier pushes is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.worker.torch_api import PSTrainer
from torch import nn
from torch.nn import functional as F
from torch.optim import lr_scheduler

WAIT_S = 20.0
STEPS = 8

OPTIMIZERS: dict[str, tuple[OptimizerConfig, Callable[[nn.Module], torch.optim.Optimizer]]] = {
    "sgd-momentum": (OptimizerConfig(name="sgd", lr=0.2, momentum=0.9, weight_decay=0.01),
                     lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01,
                                               foreach=False)),
    "adam": (OptimizerConfig(name="adam", lr=0.05), lambda m: torch.optim.Adam(m.parameters(), lr=0.05,
                                                                                foreach=False)),
}
SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]] = {
    "step": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.3),
    "cosine": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001),
}

def _prefixed(prefix: str) -> Callable[[str], str]:
    """assert_close's msg: its own message under `prefix` (the key that differs)."""
    return lambda message: f"{prefix}: {message}"



@pytest.fixture
def server() -> Iterator[ServerThread]:
    started = start_server_thread(ServerSettings(static_quorum={"w0": 0}, pull_timeout_s=WAIT_S))
    yield started
    started.stop(grace_s=0.2)


@pytest.fixture
def server_pair() -> Iterator[list[ServerThread]]:
    settings = ServerSettings(static_quorum={"w0": 0, "w1": 0}, pull_timeout_s=WAIT_S)
    started = [start_server_thread(settings) for _ in range(2)]
    yield started
    for s in started:
        s.stop(grace_s=0.2)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: lr_scheduler.LRScheduler,
          steps: range) -> list[float]:
    """The usual loop; returns the lr each step used."""
    used = []
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return used


def trainer_on(server: ServerThread, model: nn.Module, config: OptimizerConfig,
               **kwargs: object) -> PSTrainer:
    client = PSClient([server.address], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S)
    return PSTrainer(model, client, JobConfig(mode="sync", optimizer=config), **kwargs)  # type: ignore[arg-type]


def assert_same(got: nn.Module, want: nn.Module) -> None:
    for (key, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=_prefixed(key))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_scheduler_on_trainer_matches_local_torch_optim(server, optimizer, schedule, overlap) -> None:
    config, local = OPTIMIZERS[optimizer]
    want = make_model()
    want_opt = local(want)
    want_lrs = train(want, want_opt, SCHEDULES[schedule](want_opt), range(STEPS))

    model = make_model()
    with trainer_on(server, model, config, overlap=overlap) as trainer:
        assert isinstance(trainer, torch.optim.Optimizer)
        got_lrs = train(model, trainer, SCHEDULES[schedule](trainer), range(STEPS))
        ours = cast(PSTrainer, trainer)  # the isinstance above narrowed it to what torch sees
        ours.synchronize()
        assert ours.clock == STEPS
    assert got_lrs == want_lrs and len(set(want_lrs)) > 2  # the schedule really moved
    assert_same(model, want)


def test_state_dict_resumes_mid_schedule(server) -> None:
    config, local = OPTIMIZERS["sgd-momentum"]
    want = make_model()
    want_opt = local(want)
    train(want, want_opt, lr_scheduler.StepLR(want_opt, step_size=3, gamma=0.3), range(STEPS))

    half = STEPS // 2 + 1  # mid-way between two of the schedule's drops
    first = make_model()
    with trainer_on(server, first, config) as trainer:
        sched = lr_scheduler.StepLR(trainer, step_size=3, gamma=0.3)
        train(first, trainer, sched, range(half))
        saved = trainer.state_dict(), sched.state_dict()
    assert saved[0]["param_groups"][0]["lr"] == pytest.approx(0.2 * 0.3)

    model = make_model()  # a fresh process's model: its weights come from the servers
    with trainer_on(server, model, config) as trainer:
        trainer.load_state_dict(saved[0])
        sched = lr_scheduler.StepLR(trainer, step_size=3, gamma=0.3)
        sched.load_state_dict(saved[1])
        assert trainer.clock == half
        train(model, trainer, sched, range(half, STEPS))
    assert_same(model, want)


def test_momentum_cannot_follow_a_schedule(server) -> None:
    config, _ = OPTIMIZERS["sgd-momentum"]
    model = make_model()
    with trainer_on(server, model, config) as trainer:
        trainer.param_groups[0]["momentum"] = 0.8
        x, y = batch(0)
        F.cross_entropy(model(x), y).backward()
        refused = r"param_groups\[0\]\['momentum'\]: got 0.8.*momentum=0.9"
        with pytest.raises(InvalidArgumentError, match=refused):
            trainer.step()
        assert trainer.clock == 0  # nothing was pushed


def test_two_sync_workers_follow_one_schedule(server_pair) -> None:
    """Each worker on its half of every batch, each with its own StepLR: the one process on the whole
    batch with the same schedule."""
    config, local = OPTIMIZERS["sgd-momentum"]
    want = make_model()
    want_opt = local(want)
    train(want, want_opt, lr_scheduler.StepLR(want_opt, step_size=3, gamma=0.3), range(STEPS))

    models = [make_model() for _ in range(2)]  # here, not in the threads: torch's global RNG is shared

    def run(rank: int) -> nn.Module:
        model = models[rank]
        addresses = [s.address for s in server_pair]
        client = PSClient(addresses, f"w{rank}", timeout_s=WAIT_S, retry_budget_s=WAIT_S)
        with PSTrainer(model, client, JobConfig(mode="sync", optimizer=config)) as trainer:
            sched = lr_scheduler.StepLR(trainer, step_size=3, gamma=0.3)
            for step in range(STEPS):
                x, y = batch(step)
                part = slice(rank * 8, rank * 8 + 8)
                trainer.zero_grad()
                F.cross_entropy(model(x[part]), y[part]).backward()
                trainer.step()
                sched.step()
        return model

    with ThreadPoolExecutor(2) as pool:
        got = [f.result(timeout=WAIT_S * 3) for f in [pool.submit(run, rank) for rank in range(2)]]
    assert_same(got[0], want)
    assert_same(got[1], want)
