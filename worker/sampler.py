"""`ShardSampler`: each worker's shard of a dataset, as `torch.utils.data.DistributedSampler` cuts it.

    sampler = ShardSampler(dataset, trainer)           # rank and world size from the joined trainer
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=2)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                        # the same shuffle on every worker, new each epoch
        for x, y in loader: ...

Every worker draws the same permutation (seeded by `seed + epoch`), pads it to a multiple of the
world size by repeating its head, and takes every world-size-th index from its rank on: the shards
are disjoint and equally long, so in sync mode every worker takes the same number of steps and no
clock waits for a worker that ran out of data. The world is the job's as TF_CONFIG lists it (the
trainers it started with), not who is live now: a shard does not move when a peer dies.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Protocol

import torch
from pshard.common.errors import InvalidArgumentError


class _Ranked(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class ShardSampler(torch.utils.data.Sampler[int]):
    """Indices of this worker's shard of `dataset`; `rank`/`world_size` default to `trainer`'s."""

    def __init__(self, dataset: Sized, trainer: _Ranked | None = None, *, rank: int | None = None,
                 world_size: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if trainer is None and (rank is None or world_size is None):
            raise InvalidArgumentError("trainer: got None, and rank/world_size are not both given; pass the "
                                       "PSTrainer, or rank= and world_size=")
        self.world_size = world_size if world_size is not None else trainer.world_size  # type: ignore[union-attr]
        self.rank = rank if rank is not None else trainer.rank  # type: ignore[union-attr]
        if self.world_size < 1:
            raise InvalidArgumentError(f"world_size: got {self.world_size}, expected >= 1")
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank: got {self.rank}, expected 0 <= rank < "
                                       f"world_size={self.world_size}")
        self.dataset = dataset
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        n = len(dataset)
        self.num_samples = n // self.world_size if drop_last else math.ceil(n / self.world_size)
        if self.num_samples == 0:
            raise InvalidArgumentError(f"dataset: got {n} samples, fewer than world_size={self.world_size} "
                                       "with drop_last=True: some worker would have none")

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch's iteration: the next permutation, the same on every worker."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        total = self.num_samples * self.world_size
        if total > n:  # pad by repeating the head (as often as needed for tiny datasets)
            indices += (indices * math.ceil((total - n) / n))[:total - n]
        return iter(indices[:total][self.rank:total:self.world_size])
