"""A user's script: PSTrainer fed by `DataLoader(num_workers=2)` (fork, the default), for
tests/service/test_dataloader_workers.py. Run as its own process, like a user's, against a real server.

Each epoch makes the loader fork its workers again (unless --persistent), while the trainer's channels,
fast path and threads are alive. A worker also tries the trainer's client once, which must refuse.
"""

from __future__ import annotations

import argparse

import torch
from pshard.client.ps_client import PSClient
from pshard.common.errors import ForkedClientError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.worker.torch_api import PSTrainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, get_worker_info

EPOCHS = 3


class Probing(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Random samples; item 0 also says whether the parent's client refused to work in this process."""

    def __init__(self, client: PSClient, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)
        self.client = client

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        refused = 0
        if i == 0 and get_worker_info() is not None:
            try:
                self.client.stats()
            except ForkedClientError:
                refused = 1
        return self.x[i], self.y[i], refused


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    client = PSClient([args.server], "w0", transport=args.transport, timeout_s=30, retry_budget_s=30)
    job = JobConfig(mode=args.mode, staleness=1 if args.mode == "ssp" else 0,
                    optimizer=OptimizerConfig(name="sgd", lr=0.1))
    trainer = PSTrainer(model, client, job, overlap=args.overlap)
    loader = DataLoader(Probing(client, 192), batch_size=32, num_workers=2,
                        persistent_workers=args.persistent)
    refusals = 0
    for epoch in range(EPOCHS):
        for x, y, refused in loader:
            refusals += int(refused.sum())
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.step()
        print(f"epoch {epoch} clock {trainer.clock}", flush=True)
    print(f"transports {client.transports} refusals {refusals}", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
