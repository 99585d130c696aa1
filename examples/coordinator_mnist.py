"""Fashion-MNIST trained by a coordinator: the chief holds the loop, workers run the steps it schedules.

    pshard launch --ps 2 --workers 2 --coordinator examples/coordinator_mnist.py -- --steps 4000

The model's weights are variables on the parameter servers (async mode, the servers' SGD with momentum).
Each worker reads its own shuffle of the training set through a per-worker dataset; a scheduled `train_step`
computes one batch's gradients on the weights its worker's last step got back and pushes them in one
push+pull, counted once even when a worker dies and
the step runs again elsewhere. The coordinator then reads the weights and scores the test set: the last line
is `final: test_accuracy=...` (>= 0.85 at the default 4000 steps of 64 images, about 4 epochs).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Iterator

import numpy as np
import torch
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.coordinator import ClusterCoordinator, current
from pshard.worker.data import load_dataset
from pshard.worker.model import build_model
from torch import nn
from torch.nn import functional as F

# Each worker process builds the model once and loads the pulled weights into it at every step.
_models: dict[str, nn.Module] = {}


def model_of(shape: tuple[int, int, int]) -> nn.Module:
    key = repr(shape)
    if key not in _models:
        _models[key] = build_model("mlp", shape, 10)
    return _models[key]


def batches(data_dir: str, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A worker's endless shuffled batches; the worker's id seeds its order, so workers differ."""
    data = load_dataset(data_dir or None)
    seed = int(hashlib.sha256(current().client.worker_id.encode()).hexdigest()[:8], 16)
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(data.train_y))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            yield data.train_x[idx], data.train_y[idx]


def train_step(batches_it: Iterator[tuple[np.ndarray, np.ndarray]]) -> float:
    """One step on this worker's next batch: pull the weights, push their gradients; returns the loss."""
    ctx = current()
    x, y = next(batches_it)
    model = model_of(tuple(x.shape[1:]))  # type: ignore[arg-type]
    # The weights this worker's last step got back (a pull on its first): one round trip per step.
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ctx.latest().items()})
    model.zero_grad()
    loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    ctx.push_pull({name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None})
    return loss.item()


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    hits = sum(int((model(torch.from_numpy(x[i:i + 1000])).argmax(1) == torch.from_numpy(y[i:i + 1000]))
                   .sum()) for i in range(0, len(y), 1000))
    return hits / len(y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4000, help="scheduled training steps in all (default 4000)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02, help="the servers' SGD, momentum 0.9 (default 0.02)")
    p.add_argument("--data-dir", default="", help="Fashion-MNIST (default: Debian's dataset-fashion-mnist)")
    args = p.parse_args()

    data = load_dataset(args.data_dir or None)
    torch.manual_seed(0)
    model = build_model("mlp", data.image_shape, data.num_classes)
    job = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=args.lr, momentum=0.9))
    with ClusterCoordinator(job) as coordinator:
        coordinator.create_variables({k: v for k, v in model.state_dict().items() if v.is_floating_point()})
        it = iter(coordinator.create_per_worker_dataset(batches, args.data_dir, args.batch_size))
        start = time.perf_counter()
        losses = [coordinator.schedule(train_step, args=(it,)) for _ in range(args.steps)]
        coordinator.join()
        took = time.perf_counter() - start
        last = [r.fetch() for r in losses[-100:]]
        print(f"{args.steps} steps in {took:.1f} s ({args.steps / took:.0f} steps/s), last 100 losses "
              f"{np.mean(last):.3f}, {coordinator.redispatched} re-dispatched", flush=True)
        weights = {name: torch.from_numpy(coordinator.read(name)) for name in model.state_dict()}
    model.load_state_dict(weights)
    print(f"final: test_accuracy={accuracy(model, data.test_x, data.test_y):.4f}", flush=True)


if __name__ == "__main__":
    main()
