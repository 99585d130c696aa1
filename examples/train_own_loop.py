"""Your own model and training loop on pshard: a BatchNorm convnet on Fashion-MNIST.

    pshard launch --ps 2 --workers 2 examples/train_own_loop.py --output runs/own.pt
    python examples/train_own_loop.py --local --output runs/local.pt      # one process, torch.optim

Under the launcher (or compose, or a TFJob: anything that sets TF_CONFIG) `PSTrainer(model, job=...)`
joins the cluster: the weights live on the parameter servers, which run SGD on the mean gradient of
every worker's batch (sync mode). `--local` trains the same model on the union of those batches with
torch.optim, for comparison.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.worker import PSTrainer, ShardSampler
from pshard.worker.data import load_dataset
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


def build_model() -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(*block(1, 16), nn.MaxPool2d(2), *block(16, 32), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    return sum((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item()
               for i in range(0, len(y), 1000)) / len(y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-size", type=int, default=0, help="use the first N training images (0: all)")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST (default: Debian's dataset-fashion-mnist)")
    p.add_argument("--output", default=None, help="the chief saves the trained state_dict here")
    p.add_argument("--local", action="store_true", help="train in this process with torch.optim instead")
    p.add_argument("--workers", type=int, default=2, help="--local: train on the batches of this many")
    args = p.parse_args()

    data = load_dataset(args.data_dir)
    n = args.train_size or len(data.train_y)
    train = TensorDataset(torch.from_numpy(data.train_x[:n]), torch.from_numpy(data.train_y[:n]))
    test = TensorDataset(torch.from_numpy(data.test_x), torch.from_numpy(data.test_y))
    torch.manual_seed(0)  # the same initial weights everywhere (on pshard, the first declaration wins)
    model = build_model()

    if args.local:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        sampler = ShardSampler(train, rank=0, world_size=1)
        batch_size = args.batch_size * args.workers  # the union of the workers' batches
    else:
        optimizer = PSTrainer(model, job=JobConfig(mode="sync", optimizer=OptimizerConfig(
            name="sgd", lr=args.lr, momentum=0.9)))
        sampler = ShardSampler(train, optimizer)  # this worker's shard, like DistributedSampler
        batch_size = args.batch_size
    scheduler = StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(train, batch_size=batch_size, sampler=sampler, num_workers=2, persistent_workers=True)

    rank = getattr(optimizer, "rank", 0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        losses = []
        for i, (x, y) in enumerate(loader):
            if isinstance(optimizer, PSTrainer) and epoch * len(loader) + i < optimizer.clock:
                continue  # restarted: the job trained this batch without us, rejoin at its clock
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        mean = sum(losses) / max(len(losses), 1)
        print(f"epoch {epoch + 1}/{args.epochs}: rank={rank} steps={len(losses)} loss={mean:.4f}", flush=True)

    if isinstance(optimizer, PSTrainer):
        optimizer.close()  # leave the job: the others go on without waiting for us
    running_stats = b"".join(b.numpy().tobytes() for b in model.buffers() if b.is_floating_point())
    digest = hashlib.sha256(running_stats).hexdigest()[:16]  # the same on every worker
    print(f"final: rank={rank} test_accuracy={accuracy(model, test):.4f} "
          f"lr={optimizer.param_groups[0]['lr']:g} buffers={digest}", flush=True)
    if args.output and getattr(optimizer, "is_chief", True):
        torch.save(model.state_dict(), args.output)


if __name__ == "__main__":
    main()
