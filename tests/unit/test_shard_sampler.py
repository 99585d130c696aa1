"""ShardSampler cuts a dataset as torch's DistributedSampler does, with rank and world from the trainer."""

from __future__ import annotations

import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.worker import ShardSampler
from torch.utils.data import DistributedSampler


class _Trainer:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("n,world,shuffle,drop_last", [(10, 3, True, False), (10, 3, False, False),
                                                       (11, 4, True, True), (2, 5, True, False)])
def test_shards_equal_distributed_samplers_every_epoch(n: int, world: int, shuffle: bool,
                                                       drop_last: bool) -> None:
    data = list(range(n))
    for rank in range(world):
        ours = ShardSampler(data, _Trainer(rank, world), shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=shuffle, seed=7,  # type: ignore[arg-type]
            drop_last=drop_last)  # a list is a map-style dataset to torch, not to its stubs
        for epoch in range(3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_shards_are_disjoint_cover_the_data_and_reshuffle_per_epoch() -> None:
    shards = [ShardSampler(range(12), rank=r, world_size=3) for r in range(3)]
    first = [list(s) for s in shards]
    assert sorted(i for shard in first for i in shard) == list(range(12))
    for s in shards:
        s.set_epoch(1)
    assert [list(s) for s in shards] != first


def test_a_rank_outside_the_world_is_refused_naming_both() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rank: got 3, expected 0 <= rank < world_size=3"):
        ShardSampler(range(9), _Trainer(3, 3))
    with pytest.raises(InvalidArgumentError, match="trainer: got None"):
        ShardSampler(range(9), rank=0)
