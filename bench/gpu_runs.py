"""The measured runs of the GPU check (bench.gpu_check): PSTrainer against local torch.optim, and CTR.

Every run starts its own 2 parameter servers (real processes, sync mode, SGD), so no run inherits a
clock or weights from another. Servers are started with `python -P` from a scratch directory: on the
GPU machine the repository copy's own `pshard/` folder (no stubs, no package-dir mapping) must not
shadow the installed package on PYTHONPATH.

Timing is honest by construction: the same model, weights, batches and learning rate for both loops,
warm-up steps untimed, and every timed block ends with `torch.cuda.synchronize()` (and, for the
trainer, `synchronize()`, so no step of a block is left in flight for the next).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from bench.common import WorkerRun, run_workers, stop_processes
from bench.gpu_models import build, parameter_count

if TYPE_CHECKING:
    from pshard.worker.torch_api import PSTrainer

LR = 0.01
CLIENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Shape:
    """What one training benchmark trains, and for how many steps."""

    model: str
    image: tuple[int, int, int]
    classes: int
    batch: int
    warmup: int
    steps: int
    block: int


def training_shapes(cuda: bool, quick: bool) -> list[Shape]:
    """GPU: sizes such models train at on a GPU; CPU: small enough to keep the code paths exercised."""
    if cuda:
        cnn, resnet = (Shape("cnn", (1, 28, 28), 10, 256, 20, 300, 50),
                       Shape("resnet18", (3, 224, 224), 1000, 128, 10, 100, 25))
    else:
        cnn, resnet = (Shape("cnn", (1, 28, 28), 10, 64, 4, 40, 10),
                       Shape("resnet18", (3, 64, 64), 10, 8, 2, 6, 3))
    if quick and not cuda:  # make test's run: 2 blocks per loop keep the code paths, the rate is not a bar
        return [replace(cnn, steps=2 * cnn.block)]
    # ResNet-18 first: its 1-worker ratio is the bar, so a tight budget cuts the demo CNN instead.
    return [cnn] if quick else [resnet, cnn]


def start_servers(workers: Sequence[str], timeout_s: float = 90.0) -> tuple[list[subprocess.Popen[str]],
                                                                             list[str]]:
    """2 parameter servers on 127.0.0.1 (sync, SGD at LR, quorum `workers`); their processes and addresses."""
    argv = [sys.executable, "-P", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--no-scheduler",
            "--workers", ",".join(workers), "--mode", "sync", "--optimizer", "sgd", "--lr", str(LR),
            "--log-level", "WARNING"]
    scratch = tempfile.gettempdir()
    procs = [subprocess.Popen(argv, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL) for _ in range(2)]
    addresses = []
    try:
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            seen: list[str] = []
            while not seen or "listening on port" not in seen[-1]:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"parameter server did not start (exit {proc.poll()}): "
                                       + "".join(seen[-20:]))
                seen.append(proc.stdout.readline())  # type: ignore[union-attr]
            addresses.append(f"127.0.0.1:{int(seen[-1].rsplit(' ', 1)[1])}")
    except BaseException:
        stop_processes(procs)
        raise
    return procs, addresses


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic(shape: Shape, device: torch.device, seed: int, count: int = 4) -> list[tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
    """`count` batches made once on `device` and cycled: the input pipeline is not what is measured."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape.batch, *shape.image, generator=g).to(device),
             torch.randint(0, shape.classes, (shape.batch,), generator=g).to(device)) for _ in range(count)]


def _local_step(shape: Shape, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = build(shape.model, shape.image, shape.classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _trainer(shape: Shape, device: torch.device, addresses: list[str], worker: str,
             overlap: bool, bucket_bytes: int | None = None) -> PSTrainer:
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker.torch_api import PSTrainer

    model = build(shape.model, shape.image, shape.classes)
    client = PSClient(addresses, worker, timeout_s=CLIENT_TIMEOUT_S, retry_budget_s=CLIENT_TIMEOUT_S)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
    sizes = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return PSTrainer(model, client, job, device=device, overlap=overlap, **sizes)


def one_worker(shape: Shape, device: torch.device, overlap: bool) -> dict[str, Any]:
    """This process as the only worker, its blocks of steps alternating with the local loop's."""
    procs, addresses = start_servers(["w0"])
    try:
        local = _local_step(shape, device)
        trainer = _trainer(shape, device, addresses, "w0", overlap)
        model = trainer.model

        def served(x: torch.Tensor, y: torch.Tensor) -> None:
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.step()

        def settle_served() -> None:
            trainer.synchronize()
            _sync(device)

        batches = synthetic(shape, device, seed=1)
        try:
            for i in range(shape.warmup):
                local(*batches[i % len(batches)])
                served(*batches[i % len(batches)])
            settle_served()
            spent = [0.0, 0.0]
            done = 0
            while done < shape.steps:
                n = min(shape.block, shape.steps - done)
                loops = ((local, lambda: _sync(device)), (served, settle_served))
                for which, (step, settle) in enumerate(loops):
                    began = time.perf_counter()
                    for i in range(done, done + n):
                        step(*batches[i % len(batches)])
                    settle()
                    spent[which] += time.perf_counter() - began
                done += n
            clock = trainer.clock
            transports = list(trainer.client.transports)
        finally:
            trainer.close()
        if clock != shape.warmup + shape.steps:
            raise RuntimeError(f"clock {clock} after training, expected {shape.warmup + shape.steps}")
    finally:
        stop_processes(procs)
    local_rate, served_rate = shape.steps / spent[0], shape.steps / spent[1]
    return {"local_steps_per_s": round(local_rate, 2), "pstrainer_steps_per_s": round(served_rate, 2),
            "ratio": round(served_rate / local_rate, 3),
            "samples_per_s": round(served_rate * shape.batch, 1), "transports_used": transports}


def _worker(run: WorkerRun, shape: Shape, device_name: str, addresses: list[str], overlap: bool) -> dict:
    """One of several worker processes sharing the device (spawned: CUDA does not survive fork)."""
    device = torch.device(device_name)
    trainer = _trainer(shape, device, addresses, f"w{run.index}", overlap)
    model = trainer.model
    batches = synthetic(shape, device, seed=1 + run.index)

    def steps(first: int, count: int) -> None:
        for i in range(first, first + count):
            trainer.zero_grad()
            F.cross_entropy(model(batches[i % len(batches)][0]), batches[i % len(batches)][1]).backward()
            trainer.step()
        trainer.synchronize()
        _sync(device)

    try:
        run.sync()
        steps(0, shape.warmup)
        run.sync()
        start = time.monotonic()
        steps(shape.warmup, shape.steps)
        end = time.monotonic()
        return {"start": start, "end": end, "clock": trainer.clock,
                "transports": list(trainer.client.transports)}
    finally:
        trainer.close()


def several_workers(shape: Shape, device: torch.device, overlap: bool, workers: int,
                    timeout_s: float) -> dict[str, Any]:
    """`workers` spawned worker processes on the same device, sync: each clock is workers x batch samples."""
    names = [f"w{i}" for i in range(workers)]
    procs, addresses = start_servers(names)
    try:
        results = run_workers(_worker, workers, (shape, str(device), addresses, overlap), timeout_s=timeout_s)
    finally:
        stop_processes(procs)
    clocks = {r["clock"] for r in results}
    if clocks != {shape.warmup + shape.steps}:
        raise RuntimeError(f"worker clocks {sorted(clocks)}, expected {shape.warmup + shape.steps}")
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    rate = shape.steps / span
    return {"pstrainer_steps_per_s": round(rate, 2),
            "samples_per_s": round(rate * shape.batch * workers, 1),
            "transports_used": results[0]["transports"]}


def describe(shape: Shape) -> dict[str, object]:
    model = build(shape.model, shape.image, shape.classes)
    return {**asdict(shape), "params": parameter_count(model), "lr": LR, "servers": 2, "mode": "sync"}


# ---- CTR ----

@dataclass(frozen=True)
class CtrShape:
    batch: int
    warmup: int
    steps: int
    num_ids: int


def ctr_shape(cuda: bool, quick: bool) -> CtrShape:
    if quick:
        return CtrShape(batch=512, warmup=2, steps=10, num_ids=100_000)
    return CtrShape(batch=4096, warmup=10, steps=100, num_ids=1_000_000) if cuda else \
        CtrShape(batch=1024, warmup=3, steps=20, num_ids=200_000)


def ctr_run(shape: CtrShape, device: torch.device) -> dict[str, Any]:
    """The CTR demo's model (pshard.worker.ctr: a PSEmbedding table and an MLP), a fixed number of steps."""
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker.ctr import CtrModel
    from pshard.worker.ctr_data import CHUNK, ClickLog, CtrSpec
    from pshard.worker.torch_api import PSTrainer

    total = shape.warmup + shape.steps
    spec = CtrSpec(num_ids=shape.num_ids, train_samples=max(total * shape.batch, CHUNK), test_samples=CHUNK)
    clicks = ClickLog(spec)
    per_chunk = CHUNK // shape.batch
    chunks = [clicks.chunk("train", i) for i in range(-(-total // per_chunk))]
    procs, addresses = start_servers(["w0"])
    try:
        torch.manual_seed(0)
        # The table settings of pshard.worker.ctr.build_ctr_model, at the demo's --table-lr.
        model = CtrModel(spec.fields, optimizer="adagrad", lr=0.05, initializer="normal", init_scale=0.01,
                         seed=0, mode="async")
        client = PSClient(addresses, "w0", timeout_s=CLIENT_TIMEOUT_S, retry_budget_s=CLIENT_TIMEOUT_S)
        job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
        trainer = PSTrainer(model, client, job, device=device)
        try:
            losses = []
            began = 0.0
            for i in range(total):
                if i == shape.warmup:
                    _sync(device)
                    began = time.perf_counter()
                chunk, start = chunks[i // per_chunk], (i % per_chunk) * shape.batch
                # As the demo's step: host batches moved to the device, the loss read back every step.
                ids = torch.from_numpy(chunk.ids[start:start + shape.batch]).to(device)
                labels = torch.from_numpy(chunk.labels[start:start + shape.batch]).to(device)
                trainer.zero_grad()
                loss = F.binary_cross_entropy_with_logits(model(ids), labels)
                loss.backward()
                trainer.step()
                losses.append(float(loss.item()))
            _sync(device)
            spent = time.perf_counter() - began
        finally:
            trainer.close()
    finally:
        stop_processes(procs)
    return {"device": str(device), "samples_per_s": round(shape.steps * shape.batch / spent, 1),
            "steps_per_s": round(shape.steps / spent, 2), "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4), "torch_threads": torch.get_num_threads()}
