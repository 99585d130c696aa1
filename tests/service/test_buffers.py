"""Buffers follow the job (issue 17, item 3): BatchNorm's running statistics with two sync workers.

Two PSTrainers (threads, real in-process servers on 127.0.0.1 port 0) train a BatchNorm model, each on
its half of every batch, so their batch statistics differ at every step. With buffers="average" (sync's
default) both end with the same buffers, and with exactly what one process gets by averaging the two
halves' updates at every step, weights included.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.worker.torch_api import PSTrainer, param_specs
from torch import nn
from torch.nn import functional as F

WAIT_S = 20.0
WORKERS = ("w0", "w1")
STEPS = 4
BATCH = 16
LR = 0.1


def _prefixed(prefix: str) -> Callable[[str], str]:
    """assert_close's msg: its own message under `prefix` (the key that differs)."""
    return lambda message: f"{prefix}: {message}"


@pytest.fixture
def servers() -> Iterator[list[ServerThread]]:
    settings = ServerSettings(static_quorum={w: 0 for w in WORKERS}, pull_timeout_s=WAIT_S)
    started = [start_server_thread(settings) for _ in range(2)]
    yield started
    for server in started:
        server.stop(grace_s=0.2)


def running_mean(model: nn.Module) -> torch.Tensor:
    """The running mean of the model's BatchNorm layer (make_model's second)."""
    layer = list(model.children())[1]
    assert isinstance(layer, nn.BatchNorm1d) and layer.running_mean is not None
    return layer.running_mean


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * BATCH, 5, generator=g)
    x[:, 0] += torch.arange(STEPS * BATCH) % BATCH >= BATCH // 2  # the halves' statistics differ
    return x, torch.randint(0, 3, (STEPS * BATCH,), generator=g)


def half(step: int, rank: int) -> slice:
    start = step * BATCH + rank * BATCH // 2
    return slice(start, start + BATCH // 2)


def two_workers(servers: list[ServerThread], **kwargs: object) -> list[nn.Module]:
    x, y = data()
    models = [make_model() for _ in WORKERS]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))

    def run(rank: int) -> nn.Module:
        addresses = [s.address for s in servers]
        client = PSClient(addresses, WORKERS[rank], timeout_s=WAIT_S, retry_budget_s=WAIT_S)
        with PSTrainer(models[rank], client, job, **kwargs) as trainer:  # type: ignore[arg-type]
            for step in range(STEPS):
                trainer.zero_grad()
                F.cross_entropy(trainer.model(x[half(step, rank)]), y[half(step, rank)]).backward()
                trainer.step()
            trainer.synchronize()
        return models[rank]

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, r) for r in range(2)]  # leaving the block waits for both
    # Every worker's failure, not only the first: a worker that dies leaves the other timing out waiting
    # for it, and that timeout says nothing about why.
    errors = {WORKERS[r]: err for r, f in enumerate(futures) if (err := f.exception()) is not None}
    if errors:
        raise AssertionError("\n".join(f"worker {w} failed:\n{''.join(traceback.format_exception(err))}"
                                        for w, err in errors.items()))
    return [f.result() for f in futures]


def averaged_reference() -> nn.Module:
    """One process: at every step each half's forward from the same buffers, then the mean of the two
    halves' gradients (SGD) and of their updated buffers."""
    x, y = data()
    model = make_model()
    buffers = dict(model.named_buffers())  # num_batches_tracked too: each worker counts one batch a step
    for step in range(STEPS):
        start = {k: b.clone() for k, b in buffers.items()}
        grads, updated = [], []
        for rank in range(2):
            for k, b in buffers.items():
                b.copy_(start[k])
            model.zero_grad()
            F.cross_entropy(model(x[half(step, rank)]), y[half(step, rank)]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            updated.append({k: b.clone() for k, b in buffers.items()})
        with torch.no_grad():
            for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
                p -= LR * (g0 + g1) / 2
            for k, b in buffers.items():
                b.copy_((updated[0][k] + updated[1][k]) / 2 if b.is_floating_point() else updated[0][k])
    return model


def assert_same(got: nn.Module, want: nn.Module) -> None:
    for (key, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=_prefixed(key))


@pytest.mark.parametrize("overlap", [{}, {"overlap": True}, {"overlap": True, "priority": True}],
                         ids=["no-overlap", "overlap", "priority"])
def test_sync_workers_end_with_the_same_averaged_buffers(servers, overlap) -> None:
    got = two_workers(servers, **overlap)
    assert_same(got[0], got[1])
    assert_same(got[0], averaged_reference())


def test_servers_given_the_jobs_flags_learn_its_buffers_from_the_trainers() -> None:
    """`pshard ps --mode sync --optimizer sgd ...` configures a server before any worker declares, with no
    flag for the model's buffers: the trainers' declaration adds them (it was refused as another config)."""
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
    settings = ServerSettings(static_quorum={w: 0 for w in WORKERS}, pull_timeout_s=WAIT_S, default_job=job)
    started = [start_server_thread(settings) for _ in range(2)]
    try:
        got = two_workers(started)
        assert_same(got[0], got[1])
        assert_same(got[0], averaged_reference())
    finally:
        for server in started:
            server.stop(grace_s=0.2)


def test_local_buffers_drift_apart(servers) -> None:
    """What the default prevents, and what "local" keeps: each worker's own statistics."""
    got = two_workers(servers, buffers="local")
    torch.testing.assert_close(got[0].state_dict()["0.weight"], got[1].state_dict()["0.weight"])  # shared
    assert not torch.allclose(running_mean(got[0]), running_mean(got[1]))


def test_declared_specs_include_the_synced_buffers() -> None:
    keys = [s.key for s in param_specs(make_model())]
    assert "1.running_mean" in keys and "1.running_var" in keys and "1.num_batches_tracked" not in keys
    assert "1.running_mean" not in [s.key for s in param_specs(make_model(), "async")]


def test_a_restarted_worker_loads_the_jobs_buffers(servers) -> None:
    got = two_workers(servers)
    fresh = make_model()  # a restarted process: its buffers are back at their initial values
    client = PSClient([s.address for s in servers], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S)
    with PSTrainer(fresh, client, JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))) as t:
        assert_same_floats(fresh, got[0])  # num_batches_tracked is each worker's own count
        running_mean(fresh).zero_()
        t.pull()
        assert_same_floats(fresh, got[0])


def assert_same_floats(got: nn.Module, want: nn.Module) -> None:
    expected = want.state_dict()
    for key, value in got.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6,
                                       msg=_prefixed(key))


class _GatedClient(PSClient):
    """A real client whose overlapped bucket exchanges wait for `gate`, and which notes, at each push
    of the buffers, whether the gate was open (every bucket exchange then free to end) at that moment."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.buffer_push_after_buckets: list[bool] = []

    def push_pull(self, *args: object, **kwargs: object) -> dict[str, np.ndarray]:
        self.gate.wait(WAIT_S)
        return super().push_pull(*args, **kwargs)  # type: ignore[arg-type]

    def push(self, grads, clock, *, lr=None):  # type: ignore[no-untyped-def,override]
        if "1.running_mean" in grads:
            self.buffer_push_after_buckets.append(self.gate.is_set())
            self.gate.set()  # without the order asked for, let the step go on rather than hang
        return super().push(grads, clock, lr=lr)


def test_overlap_exchanges_the_buffers_after_the_steps_buckets() -> None:
    """The buffers' push and pull wait for the step's bucket exchanges to end. Over a fast path (one
    request at a time per server, a sync pull holding it while the server waits for the other workers),
    a buffer pull sent while a bucket is still queued kept that bucket's push unsent while a peer's
    bucket waited for it: both workers stalled until their deadline (1 run in 2 of the test above)."""
    server = start_server_thread(ServerSettings(static_quorum={"w0": 0}, pull_timeout_s=WAIT_S))
    try:
        client = _GatedClient([server.address], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S)
        x, y = data()
        # The gate opens on its own after a while: a buffer push before then came before the buckets ended.
        opener = threading.Timer(2.0, client.gate.set)
        opener.start()
        job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
        with PSTrainer(make_model(), client, job, overlap=True) as trainer:
            trainer.zero_grad()
            F.cross_entropy(trainer.model(x[:BATCH]), y[:BATCH]).backward()
            trainer.step()
        opener.cancel()
        assert client.buffer_push_after_buckets == [True]
    finally:
        server.stop(grace_s=0.2)
