"""Every CUDA code path of the worker, on cuda:0, against real in-process parameter servers.

Device selection, pinned host buffers and non-blocking copies (pshard.worker.device.HostStaging), the
overlap's copy stream (pshard.worker.overlap), PSTrainer and PSEmbedding / PSEmbeddingBag on the GPU,
and sync training on the GPU equal to the same training on the CPU within float tolerance.

Marked `cuda` (`pytest -m cuda`; bench/gpu_check.py runs them on the GPU machine) and skipped, with
the reason, where torch sees no GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.worker.device import HostStaging, select_device
from pshard.worker.embedding import PSEmbedding, PSEmbeddingBag
from pshard.worker.model import build_model
from pshard.worker.torch_api import PSTrainer
from torch import nn
from torch.nn import functional as F

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: torch.cuda.is_available() is False here")]

WAIT_S = 30.0
STEPS = 5
CUDA = "cuda:0"
# SGD over a few steps of fp32 kernels that differ between the CPU and cuDNN/cuBLAS in summation order.
RTOL, ATOL = 1e-4, 1e-5
# Adam divides by the root of its second moment, which turns the last bits of a gradient that cuDNN and
# the CPU sum in different orders into weight differences of ~1e-5 (H200, 2 steps: 1.3e-5 on 1 of
# 4,608 weights): its comparisons allow that much more, and no more.
ADAM_ATOL = 5e-5


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    """TF32 (cuDNN's default for convolutions) rounds to 10 mantissa bits: compare real fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def servers() -> Iterator[Callable[..., list[str]]]:
    started: list[ServerThread] = []

    def start(n: int = 2, quorum: tuple[str, ...] = ("w0",)) -> list[str]:
        settings = ServerSettings(static_quorum={w: 0 for w in quorum}, pull_timeout_s=WAIT_S)
        new = [start_server_thread(settings) for _ in range(n)]
        started.extend(new)
        return [s.address for s in new]

    yield start
    for server in started:
        server.stop(grace_s=0.2)


def client(addresses: list[str], worker: str = "w0") -> PSClient:
    return PSClient(addresses, worker, timeout_s=WAIT_S, retry_budget_s=WAIT_S)


Batch = tuple[torch.Tensor, torch.Tensor]


def batches(n: int, shape: tuple[int, ...], classes: int, seed: int = 3) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, *shape, generator=g), torch.randint(0, classes, (16,), generator=g))
            for _ in range(n)]


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", (1, 8, 8), 10)


def train(model: nn.Module, step: Callable[[], object], data: list[Batch],
          device: str, zero: Callable[[], None]) -> list[float]:
    losses = []
    for x, y in data:
        zero()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def assert_same(got: nn.Module, want: nn.Module, atol: float = ATOL) -> None:
    for (key, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        def named(m: str, k: str = key) -> str:  # the default binds this iteration's key
            return f"{k}: {m}"

        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=RTOL, atol=atol, msg=named)


# ---- device selection ----

def test_auto_and_explicit_cuda_select_the_gpu() -> None:
    assert select_device("auto").type == "cuda"
    assert select_device(CUDA) == torch.device(CUDA)


# ---- HostStaging: pinned buffers, non-blocking copies ----

def busy_stream(cycles: int = 400_000_000) -> torch.cuda.Event:
    """Keep the current stream busy (a spin kernel, ~0.2 s); the event completes when it is done.

    Whatever the host does until then without waiting leaves the event pending: that is how a test
    tells an asynchronous copy from one that waited for the GPU."""
    torch.cuda._sleep(cycles)
    done = torch.cuda.Event()
    done.record()
    return done


def test_to_host_waits_for_the_kernels_that_produce_the_gradient() -> None:
    staging = HostStaging(CUDA)
    busy_stream()  # the kernel below and the copy are queued behind it
    grad = torch.arange(1 << 16, device=CUDA, dtype=torch.float32) * 2.0
    host = staging.to_host({"g": grad})["g"]
    assert staging._up["g"].is_pinned()
    np.testing.assert_array_equal(host, np.arange(1 << 16, dtype=np.float32) * 2.0)


def test_to_device_does_not_wait_for_the_gpu() -> None:
    # The copy is queued after the busy stream; a blocking or pageable copy would return only after it.
    staging = HostStaging(CUDA)
    target = torch.zeros(1 << 16, device=CUDA)
    staging.to_device({"w": np.ones(1 << 16, np.float32)}, {"w": target})
    torch.cuda.synchronize()
    asleep = busy_stream()
    staging.to_device({"w": np.full(1 << 16, 2.0, np.float32)}, {"w": target})
    assert not asleep.query(), "to_device waited for the stream: the copy is not asynchronous"
    torch.cuda.synchronize()
    assert float(target.min()) == 2.0
    assert staging._down["w"].is_pinned()


def test_to_device_of_another_key_does_not_wait_for_a_copy_still_queued() -> None:
    # Overlap lands each module's keys at its forward: landing one layer must not wait until the GPU
    # has run every earlier layer (the copy of the previous key is still queued behind them).
    staging = HostStaging(CUDA)
    targets = {k: torch.zeros(1 << 16, device=CUDA) for k in ("a", "b")}
    # Buffers allocated first: allocating pinned memory may itself wait for the device.
    staging.to_device({k: np.zeros(1 << 16, np.float32) for k in targets}, targets)
    torch.cuda.synchronize()
    asleep = busy_stream()
    staging.to_device({"a": np.ones(1 << 16, np.float32)}, {"a": targets["a"]})
    staging.to_device({"b": np.full(1 << 16, 2.0, np.float32)}, {"b": targets["b"]})
    assert not asleep.query(), "landing key b waited for key a's copy, queued behind the busy stream"
    torch.cuda.synchronize()
    assert float(targets["a"].min()) == 1.0 and float(targets["b"].min()) == 2.0


def test_to_device_of_the_same_key_waits_before_rewriting_its_pinned_buffer() -> None:
    staging = HostStaging(CUDA)
    first, second = torch.zeros(1 << 20, device=CUDA), torch.zeros(1 << 20, device=CUDA)
    busy_stream()  # the first copy is still queued when the buffer is wanted again
    staging.to_device({"w": np.full(1 << 20, 1.0, np.float32)}, {"w": first})
    staging.to_device({"w": np.full(1 << 20, 2.0, np.float32)}, {"w": second})
    torch.cuda.synchronize()
    assert float(first.min()) == float(first.max()) == 1.0
    assert float(second.min()) == 2.0


def test_a_landing_written_in_place_goes_to_the_device_without_a_host_copy() -> None:
    staging = HostStaging(CUDA)
    target = torch.zeros(1 << 16, device=CUDA)
    landing = staging.landing("w", target)
    assert landing is not None and landing.ctypes.data == staging._down["w"].data_ptr()
    assert staging._down["w"].is_pinned()
    landing[...] = 3.0  # where a pull writes
    staging.to_device({"w": landing}, {"w": target})
    torch.cuda.synchronize()
    assert float(target.min()) == float(target.max()) == 3.0
    assert staging.landing("w", target) is landing  # the same buffer every step


def test_landing_waits_until_the_gpu_has_read_the_last_values() -> None:
    # The pull writes the landing right after landing() returns: the H2D copy of the last values,
    # still queued behind the busy stream, must have read them by then.
    staging = HostStaging(CUDA)
    first, second = torch.zeros(1 << 20, device=CUDA), torch.zeros(1 << 20, device=CUDA)
    landing = staging.landing("w", first)
    assert landing is not None
    busy_stream()
    landing[...] = 1.0
    staging.to_device({"w": landing}, {"w": first})
    again = staging.landing("w", second)
    assert again is landing
    again[...] = 2.0
    staging.to_device({"w": again}, {"w": second})
    torch.cuda.synchronize()
    assert float(first.min()) == float(first.max()) == 1.0
    assert float(second.min()) == 2.0


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_pulled_weights_land_in_pinned_memory(servers, overlap) -> None:
    # Pulled straight into the pinned staging buffers: no host copy of the whole model before the
    # H2D copies (47 MB a step for a ResNet-18).
    data = batches(2, (1, 8, 8), 10)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    model = cnn()
    with PSTrainer(model, client(servers()), job, device=CUDA, overlap=overlap) as trainer:
        train(model, trainer.step, data, CUDA, trainer.zero_grad)
        trainer.synchronize()
        assert set(trainer._buffers) == set(trainer.params)
        for key, landed in trainer._buffers.items():
            assert landed.ctypes.data == trainer._staging._down[key].data_ptr(), key
            np.testing.assert_array_equal(landed, trainer.params[key].detach().cpu().numpy())


# ---- PSTrainer on cuda:0 ----

@pytest.mark.parametrize("overlap", [{}, {"overlap": True}, {"overlap": True, "bucket_bytes": 1}],
                         ids=["no-overlap", "overlap", "bucket-per-tensor"])
def test_sync_training_on_the_gpu_equals_the_same_training_on_the_cpu(servers, overlap) -> None:
    data = batches(STEPS, (1, 8, 8), 10)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
    runs = {}
    for device in ("cpu", CUDA):
        model = cnn()
        with PSTrainer(model, client(servers()), job, device=device, **overlap) as trainer:
            assert all(p.device == torch.device(device) for p in model.parameters())
            losses = train(model, trainer.step, data, device, trainer.zero_grad)
            trainer.synchronize()
            assert trainer.clock == STEPS
        runs[device] = model, losses
    np.testing.assert_allclose(runs[CUDA][1], runs["cpu"][1], rtol=RTOL, atol=ATOL)
    assert_same(runs[CUDA][0], runs["cpu"][0])
    reference = cnn()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train(reference, optimizer.step, data, "cpu", optimizer.zero_grad)
    assert_same(runs[CUDA][0], reference)


def test_a_gpu_worker_and_a_cpu_worker_train_one_sync_job(servers) -> None:
    import threading

    addresses = servers(quorum=("w0", "w1"))
    data = batches(STEPS, (1, 8, 8), 10)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    models = {"w0": cnn(), "w1": cnn()}
    errors: list[BaseException] = []

    def work(worker: str, device: str) -> None:
        try:
            model = models[worker]
            with PSTrainer(model, client(addresses, worker), job, device=device) as trainer:
                half = slice(0, 8) if worker == "w0" else slice(8, 16)
                train(model, trainer.step, [(x[half], y[half]) for x, y in data], device, trainer.zero_grad)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=a) for a in (("w0", CUDA), ("w1", "cpu"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert not errors, errors
    reference = cnn()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    train(reference, optimizer.step, data, "cpu", optimizer.zero_grad)
    assert_same(models["w0"], reference)
    assert_same(models["w1"], reference)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_aggregate_mode_with_local_adam_on_the_gpu_matches_adam_on_the_cpu(servers, overlap) -> None:
    data = batches(STEPS, (1, 8, 8), 10)
    model = cnn().to(CUDA)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="aggregate"))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    with PSTrainer(model, client(servers()), job, local_optimizer=adam, overlap=overlap) as trainer:
        train(model, trainer.step, data, CUDA, trainer.zero_grad)
    reference = cnn()
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    train(reference, optimizer.step, data, "cpu", optimizer.zero_grad)
    assert_same(model, reference, atol=ADAM_ATOL)


def test_overlap_with_zero_grad_to_none_keeps_the_gradients_until_copied(servers) -> None:
    # zero_grad(set_to_none=True) drops the trainer's last reference to a gradient whose copy to the
    # host may still be queued on the copy stream (record_stream keeps the memory from being reused).
    data = batches(20, (1, 8, 8), 10)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.05))
    model = cnn().to(CUDA)
    with PSTrainer(model, client(servers()), job, overlap=True, bucket_bytes=1) as trainer:
        for x, y in data:
            trainer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x.to(CUDA)), y.to(CUDA)).backward()
            trainer.step()
            torch.empty(1 << 20, device=CUDA).fill_(float("nan"))  # would land in a freed gradient's memory
        trainer.synchronize()
    reference = cnn()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    train(reference, optimizer.step, data, "cpu", optimizer.zero_grad)
    assert_same(model, reference)


def test_bfloat16_parameters_on_the_gpu_are_held_as_float32_and_trained(servers) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).to(CUDA, torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.5), wire_dtype="bfloat16")
    x, y = torch.randn(32, 6, device=CUDA, dtype=torch.bfloat16), torch.randint(0, 4, (32,), device=CUDA)
    with PSTrainer(model, client(servers(1)), job) as trainer:
        assert {p.dtype for p in trainer.client.layout.params} == {"float32"}
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.float() for p in model.parameters()]  # type: ignore[union-attr]
        trainer.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert p.device == torch.device(CUDA) and p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), (b.float() - 0.5 * g).bfloat16().float(), rtol=0.02, atol=0.02)


# ---- PSEmbedding / PSEmbeddingBag on cuda:0 ----

class TableModel(nn.Module):
    def __init__(self, bag: bool) -> None:
        super().__init__()
        table = {"optimizer": "adagrad", "lr": 0.1, "initializer": "normal", "init_scale": 0.1, "seed": 5}
        self.bag = bag
        self.embedding = PSEmbeddingBag(4, "t", mode="mean", **table) if bag else PSEmbedding(4, "t", **table)
        self.head = nn.Linear(4 if bag else 12, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids)
        return self.head(rows if self.bag else rows.flatten(1)).squeeze(1)


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding-bag"])
def test_embedding_tables_train_the_same_on_the_gpu_as_on_the_cpu(servers, bag) -> None:
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, 48, (32, 3), generator=g) for _ in range(STEPS)]
    labels = [torch.randint(0, 2, (32,), generator=g).float() for _ in range(STEPS)]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    runs = {}
    for device in ("cpu", CUDA):
        torch.manual_seed(0)
        model = TableModel(bag)
        with PSTrainer(model, client(servers()), job, device=device) as trainer:
            losses = []
            for x, y in zip(ids, labels, strict=True):
                trainer.zero_grad()
                out = model(x.to(device))
                assert out.device == torch.device(device)
                loss = F.binary_cross_entropy_with_logits(out, y.to(device))
                loss.backward()
                trainer.step()
                losses.append(loss.item())
            model.eval()
            with torch.no_grad():
                every = torch.arange(48, device=device)  # one lookup of each id the batches drew from
                rows = model.embedding(every.reshape(-1, 1) if bag else every.reshape(-1, 3))
        runs[device] = losses, rows.cpu(), model.head.weight.detach().cpu()
    np.testing.assert_allclose(runs[CUDA][0], runs["cpu"][0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(runs[CUDA][1], runs["cpu"][1], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(runs[CUDA][2], runs["cpu"][2], rtol=RTOL, atol=ATOL)


def test_embedding_bag_with_offsets_on_the_gpu(servers) -> None:
    bag = PSEmbeddingBag(4, "bags", mode="sum", initializer="normal", init_scale=0.1, seed=1)
    bag.attach(client(servers(1)))
    ids = torch.tensor([3, 1, 4, 1, 5], device=CUDA)
    offsets = torch.tensor([0, 2], device=CUDA)
    out = bag(ids, offsets)
    assert out.device == torch.device(CUDA) and out.shape == (2, 4)
    rows = bag(ids.reshape(-1, 1)).detach()  # each id alone: its own row
    torch.testing.assert_close(out.detach(), torch.stack([rows[:2].sum(0), rows[2:].sum(0)]))
    out.sum().backward()
    assert bag.push_grads(0) == 4  # distinct ids 1, 3, 4, 5
