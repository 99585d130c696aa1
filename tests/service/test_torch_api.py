"""PSTrainer against real parameter servers (in-process, 127.0.0.1 port 0).

The sync contract (docs/architecture.md, 5 Consistency): two workers on disjoint halves of each
batch end with the weights one process gets on the whole batch. Also the aggregate-only mode with a local
torch optimizer, and the documentation's example (docs/guide/library.md), run exactly as it is quoted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.worker.torch_api import PSTrainer
from torch import nn
from torch.nn import functional as F

WAIT_S = 20.0
WORKERS = ("w0", "w1")
STEPS = 4

LIBRARY_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "library.md"


def library_example() -> str:
    """The docs' PSTrainer example, read from the page itself so the two cannot drift apart."""
    return LIBRARY_PAGE.read_text(encoding="utf-8").split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def start_servers() -> Iterator[Callable[[int, tuple[str, ...]], list[ServerThread]]]:
    started: list[ServerThread] = []

    def start(n: int, quorum: tuple[str, ...] = WORKERS) -> list[ServerThread]:
        settings = ServerSettings(static_quorum={w: 0 for w in quorum}, pull_timeout_s=WAIT_S)
        servers = [start_server_thread(settings) for _ in range(n)]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop(grace_s=0.2)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4))


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def halves(step: int, batch: int, rank: int) -> slice:
    """Worker `rank`'s half of batch `step`: the two halves together are the whole batch."""
    start = step * batch + rank * batch // 2
    return slice(start, start + batch // 2)


def train_worker(trainer: PSTrainer, x: torch.Tensor, y: torch.Tensor, rank: int, batch: int) -> None:
    for step in range(STEPS):
        part = halves(step, batch, rank)
        trainer.zero_grad()
        F.cross_entropy(trainer.model(x[part]), y[part]).backward()
        trainer.step()


def run_two_workers(servers: list[ServerThread], job: JobConfig, x: torch.Tensor, y: torch.Tensor,
                    batch: int, *, slice_bytes: int | None = None,
                    local: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
                    overlap: dict[str, object] | None = None) -> list[PSTrainer]:
    """Two trainers in threads, each on its half of every batch; returns them after STEPS steps.

    `overlap`: PSTrainer's overlap arguments (e.g. {"overlap": True, "bucket_bytes": 1})."""
    addresses = [s.address for s in servers]

    # Built here, not in the threads: torch's global RNG is shared, so concurrent seeding races.
    models = [make_model(seed=0) for _ in range(2)]

    def start(rank: int) -> PSTrainer:
        model = models[rank]
        layout = None
        if slice_bytes is not None:  # small slices: every tensor is cut and spread over both servers
            specs = [ParamSpec(k, "float32", tuple(p.shape)) for k, p in model.named_parameters()]
            layout = plan_layout(specs, addresses, slice_bytes)
        client = PSClient(addresses, WORKERS[rank], layout=layout, timeout_s=WAIT_S, retry_budget_s=WAIT_S)
        trainer = PSTrainer(model, client, job, local_optimizer=local(model) if local else None,
                            **(overlap or {}))  # type: ignore[arg-type]
        train_worker(trainer, x, y, rank, batch)
        return trainer

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, rank) for rank in range(2)]
        return [f.result(timeout=WAIT_S * 3) for f in futures]


def reference(opt: Callable[[nn.Module], torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor,
              batch: int) -> nn.Module:
    """One process, torch.optim, the whole of every batch, from the same initial weights."""
    model = make_model(seed=0)
    optimizer = opt(model)
    for step in range(STEPS):
        part = slice(step * batch, (step + 1) * batch)
        optimizer.zero_grad()
        F.cross_entropy(model(x[part]), y[part]).backward()
        optimizer.step()
    return model


def assert_same_weights(got: nn.Module, want: nn.Module) -> None:
    for (key, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        def named(m: str, k: str = key) -> str:  # the default binds this iteration's key
            return f"{k}: {m}"

        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=named)


def grad_of(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None, "backward() left this parameter no gradient"
    return param.grad


OVERLAP: dict[str, dict[str, object]] = {"one-bucket": {"overlap": True},
                                         "bucket-per-tensor": {"overlap": True, "bucket_bytes": 1},
                                         "priority": {"overlap": True, "bucket_bytes": 1, "priority": True}}


def land_by_forward(trainer: PSTrainer, x: torch.Tensor) -> None:
    """With overlap the last step's weights reach a layer when its forward starts: run one."""
    with torch.no_grad():
        trainer.model(x[:1])


@pytest.mark.parametrize("slice_bytes", [None, 64], ids=["whole-tensors", "split-tensors"])
@pytest.mark.parametrize("overlap", [None, *OVERLAP], ids=["no-overlap", *OVERLAP])
def test_sync_training_matches_single_process_on_union_batch(start_servers, slice_bytes, overlap) -> None:
    servers = start_servers(2)
    x, y = make_data(seed=7, n=STEPS * 32)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.2, momentum=0.9,
                                                           weight_decay=0.01))

    trainers = run_two_workers(servers, job, x, y, batch=32, slice_bytes=slice_bytes,
                               overlap=OVERLAP.get(overlap))

    want = reference(lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01),
                     x, y, batch=32)
    assert [t.clock for t in trainers] == [STEPS, STEPS]
    for trainer in trainers:
        trainer.synchronize()  # with overlap the last step's weights land now (or at the next forward)
        assert_same_weights(trainer.model, want)
        trainer.close()


@pytest.mark.parametrize("overlap", [*OVERLAP], ids=[*OVERLAP])
def test_overlapped_sync_training_lands_the_weights_at_forward(start_servers, overlap) -> None:
    servers = start_servers(2)
    x, y = make_data(seed=7, n=STEPS * 32)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.2, momentum=0.9,
                                                           weight_decay=0.01))

    trainers = run_two_workers(servers, job, x, y, batch=32, overlap=OVERLAP[overlap])

    want = reference(lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01),
                     x, y, batch=32)
    for trainer in trainers:
        assert trainer.clock == STEPS
        # Until a forward reaches them, the parameters hold the weights the last backward used.
        with pytest.raises(AssertionError):
            assert_same_weights(trainer.model, want)
        land_by_forward(trainer, x)
        assert_same_weights(trainer.model, want)
        trainer.close()


class _Probe(torch.autograd.Function):
    """Identity; its backward, the last of the step (it is the first layer), calls `seen()`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seen: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.seen()
        return grad, None


def test_overlap_exchanges_the_last_layer_while_backward_still_runs(start_servers) -> None:
    servers = start_servers(1, quorum=("w0",))
    model = make_model(seed=0)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    x, y = make_data(seed=3, n=8)
    with PSTrainer(model, PSClient([servers[0].address], "w0", timeout_s=WAIT_S), job, overlap=True,
                   bucket_bytes=1) as trainer:
        last_layer = trainer._overlap.buckets[0]  # type: ignore[union-attr]
        assert last_layer.keys == ("2.bias",)
        done_during_backward = []

        def seen() -> None:  # backward has not reached the first layer's input yet: step() is not called
            assert last_layer.inflight is not None, "the last layer's bucket was not sent during backward"
            last_layer.inflight.result(timeout=WAIT_S)  # its reply arrives while backward waits here
            done_during_backward.append(True)

        for _ in range(3):
            trainer.zero_grad()
            F.cross_entropy(model(_Probe.apply(x.requires_grad_(), seen)), y).backward()
            assert trainer.step() is None
        assert done_during_backward == [True] * 3
        assert trainer.clock == 3
        trainer.synchronize()
        assert trainer.last_result is not None and trainer.last_result.min_version == 3


@pytest.mark.parametrize("overlap", [None, "one-bucket"], ids=["no-overlap", "overlap"])
def test_aggregate_mode_with_local_adam_matches_single_process_adam(start_servers, overlap) -> None:
    servers = start_servers(2)
    x, y = make_data(seed=8, n=STEPS * 32)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="aggregate"))

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=0.01)

    trainers = run_two_workers(servers, job, x, y, batch=32, local=adam, overlap=OVERLAP.get(overlap or ""))

    want = reference(adam, x, y, batch=32)
    for trainer in trainers:
        assert_same_weights(trainer.model, want)
        trainer.close()


def test_every_worker_loads_the_first_declared_initial_weights(start_servers) -> None:
    servers = start_servers(1)
    job = JobConfig(mode="sync")
    first = PSTrainer(make_model(seed=1), PSClient([servers[0].address], "w0", timeout_s=WAIT_S), job)
    second = PSTrainer(make_model(seed=2), PSClient([servers[0].address], "w1", timeout_s=WAIT_S), job)

    assert_same_weights(second.model, make_model(seed=1))
    assert (first.clock, second.clock) == (0, 0)
    first.close()
    second.close()


def test_bfloat16_parameters_are_held_as_float32_and_trained(start_servers) -> None:
    servers = start_servers(1, quorum=("w0",))
    model = make_model(seed=0).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.5), wire_dtype="bfloat16")
    x, y = make_data(seed=9, n=32)

    with PSTrainer(model, PSClient([servers[0].address], "w0", timeout_s=WAIT_S), job) as trainer:
        assert {p.dtype for p in trainer.client.layout.params} == {"float32"}
        F.cross_entropy(model(x.to(torch.bfloat16)), y).backward()
        grads = [grad_of(p).float() for p in model.parameters()]
        trainer.step()

    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), (b.float() - 0.5 * g).bfloat16().float(), rtol=0.02, atol=0.02)


def test_aggregate_mode_needs_a_local_optimizer(start_servers) -> None:
    servers = start_servers(1, quorum=("w0",))
    client = PSClient([servers[0].address], "w0", timeout_s=WAIT_S)
    with pytest.raises(InvalidArgumentError, match="local_optimizer"):
        PSTrainer(make_model(seed=0), client, JobConfig(optimizer=OptimizerConfig(name="aggregate")))
    client.close()


def test_library_page_example_runs_as_written(capsys) -> None:
    # The example starts its own servers on free ports and stops them: it runs with no edit.
    exec(compile(library_example(), str(LIBRARY_PAGE), "exec"), {"__name__": "docs_example"})

    assert capsys.readouterr().out == "clock 8\n"


def test_priority_pushes_the_queued_first_layers_first_and_pulls_them_first(start_servers) -> None:
    """While the link is busy with the first bucket backward produced, the rest queue up: with priority
    the one nearest the input goes next (FIFO would send them in backward's order), and the pulls go
    first layer first, so the next forward can start before the last layers' weights are back."""
    servers = start_servers(1, quorum=("w0",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    client = PSClient([servers[0].address], "w0", timeout_s=WAIT_S)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    layer_order = [k for k, _ in model.named_parameters()]  # 0.weight, 0.bias, 2.weight, ...
    pushes: list[str] = []
    pulls: list[str] = []
    link_free = threading.Event()
    push, pull_into = client.push, client.pull_into

    def busy_push(grads, clock, *, lr=None):  # type: ignore[no-untyped-def]
        pushes.extend(grads)
        if len(pushes) == 1:  # the link is busy with the first bucket until backward has queued the rest
            assert link_free.wait(WAIT_S)
        return push(grads, clock, lr=lr)

    def noted_pull(clock, keys, out):  # type: ignore[no-untyped-def]
        pulls.extend(keys)
        return pull_into(clock, keys, out)

    client.push, client.pull_into = busy_push, noted_pull  # type: ignore[method-assign]
    x, y = make_data(seed=3, n=8)
    with PSTrainer(model, client, job, overlap=True, bucket_bytes=1, priority=True) as trainer:
        trainer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert trainer.step() is None
        link_free.set()
        trainer.synchronize()
        assert pushes[1:] == [k for k in layer_order if k != pushes[0]]
        assert pulls == layer_order
        assert trainer.clock == 1 and trainer.last_result is not None
        assert trainer.last_result.applied == len(layer_order) and trainer.last_result.min_version == 1


def test_priority_without_overlap_is_refused_naming_both(start_servers) -> None:
    servers = start_servers(1, quorum=("w0",))
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    with pytest.raises(InvalidArgumentError, match="priority: got True with overlap False"):
        PSTrainer(make_model(seed=0), PSClient([servers[0].address], "w0", timeout_s=WAIT_S), job,
                  priority=True)


def test_two_priority_workers_whose_push_orders_differ_wait_for_no_one(start_servers) -> None:
    """Worker 0's link is busy with its first bucket until its backward ends, so it pushes the rest first
    layer first; worker 1 pushes as backward goes. A fused push+pull per bucket in those orders waited for
    each other until the deadline (each worker's one thread in a pull the other had not pushed yet); split
    pushes and pulls in one pull order end as one process on the union batch would."""
    servers = start_servers(2)
    x, y = make_data(seed=7, n=STEPS * 32)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.2, momentum=0.9))
    models = [make_model(seed=0) for _ in range(2)]
    layer_order = [k for k, _ in models[0].named_parameters()]
    backward_done = [threading.Event() for _ in range(STEPS)]
    pushed: list[list[str]] = [[] for _ in range(STEPS)]  # worker 0's pushes, per clock

    def train(rank: int) -> PSTrainer:
        client = PSClient([s.address for s in servers], WORKERS[rank], timeout_s=WAIT_S)
        push = client.push

        def busy_push(grads, clock, *, lr=None):  # type: ignore[no-untyped-def]
            pushed[clock].extend(grads)
            if len(pushed[clock]) == len(grads):  # its first push of this clock holds the link
                assert backward_done[clock].wait(WAIT_S)
            return push(grads, clock, lr=lr)

        if rank == 0:
            client.push = busy_push  # type: ignore[method-assign]
        trainer = PSTrainer(models[rank], client, job, overlap=True, bucket_bytes=1, priority=True)
        for step in range(STEPS):
            part = halves(step, 32, rank)
            trainer.zero_grad()
            F.cross_entropy(trainer.model(x[part]), y[part]).backward()
            if rank == 0:
                backward_done[step].set()
            trainer.step()
        trainer.synchronize()
        return trainer

    with ThreadPoolExecutor(2) as pool:
        trainers = [f.result(timeout=WAIT_S * 3) for f in [pool.submit(train, rank) for rank in range(2)]]
    for clock in range(STEPS):
        assert pushed[clock][1:] == [k for k in layer_order if k != pushed[clock][0]]
    want = reference(lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9), x, y, batch=32)
    for trainer in trainers:
        assert trainer.clock == STEPS
        assert_same_weights(trainer.model, want)
        trainer.close()
