"""Dynamic data shards (pshard.coordinator.shards): one call per shard, the finished ones and the batches
trained of the others as the position a checkpoint keeps, and a restored position skipping what the restored
weights have seen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pshard.common import checkpoint_store as gc
from pshard.common.errors import InvalidArgumentError, ScheduledFunctionError
from pshard.common.job import JobConfig
from pshard.coordinator.closures import RemoteValue
from pshard.coordinator.shards import ShardQueue


class Scheduled:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []
        self.starts: list[int] = []
        self.remotes: list[RemoteValue] = []

    def __call__(self, fn: Any, args: tuple[Any, ...], kwargs: Any, resume_at: int) -> RemoteValue:
        self.calls.append((fn, args))
        self.starts.append(resume_at)
        self.remotes.append(RemoteValue(len(self.remotes) + 1, str(fn), resume_at))
        return self.remotes[-1]


def test_each_pending_shard_is_one_call_and_the_finished_ones_are_the_position() -> None:
    scheduled = Scheduled()
    queue = ShardQueue("train", 4, scheduled)

    queue.schedule("m:f", args=("x",))
    scheduled.remotes[0]._settle(None, None, "worker-0")
    scheduled.remotes[2]._settle(None, None, "worker-1")
    scheduled.remotes[3]._settle(None, ScheduledFunctionError("boom"), "worker-1")

    assert scheduled.calls == [("m:f", (s, "x")) for s in range(4)]
    assert queue.position() == {"num_shards": 4, "done": [0, 2], "offsets": {}}
    assert queue.pending() == [3]  # failed: pending again; 1 still runs
    queue.schedule("m:f")
    assert scheduled.calls[-1] == ("m:f", (3,))


def test_a_restored_position_schedules_only_what_the_restored_weights_have_not_seen() -> None:
    scheduled = Scheduled()
    queue = ShardQueue("train", 5, scheduled, done=[0, 1, 3])

    queue.schedule("m:f")

    assert [args for _, args in scheduled.calls] == [(2,), (4,)]
    assert queue.done() == [0, 1, 3]


def test_a_position_that_does_not_fit_the_queue_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match=r"shard_queue\('train'\): the checkpoint's shards \[7\]"):
        ShardQueue("train", 5, Scheduled(), done=[1, 7])
    with pytest.raises(InvalidArgumentError, match="num_shards: got 0, expected >= 1"):
        ShardQueue("train", 0, Scheduled())
    with pytest.raises(InvalidArgumentError, match=r"offsets of shards \[1, 6\] \(\[2, 3\]\)"):
        ShardQueue("train", 5, Scheduled(), done=[1], offsets={1: 2, 6: 3, 2: 4})


def test_a_shard_that_failed_part_way_resumes_at_the_batches_its_run_trained() -> None:
    scheduled = Scheduled()
    queue = ShardQueue("train", 3, scheduled)

    queue.schedule("m:f")
    scheduled.remotes[0]._settle(None, None, "worker-0", progress=4)
    scheduled.remotes[1]._settle(None, ScheduledFunctionError("boom"), "worker-1", progress=3)
    scheduled.remotes[2]._settle(None, ScheduledFunctionError("cancelled"), "")  # never ran

    assert queue.position() == {"num_shards": 3, "done": [0], "offsets": {"1": 3}}
    queue.schedule("m:f")
    assert [args for _, args in scheduled.calls[3:]] == [(1,), (2,)]
    assert scheduled.starts == [0, 0, 0, 3, 0]  # shard 1 goes on at batch 3: its first 3 counted once


def test_a_restored_offset_resumes_its_shard_there_and_goes_on_from_the_new_runs_count() -> None:
    scheduled = Scheduled()
    queue = ShardQueue("train", 3, scheduled, done=[0], offsets={"2": 5})  # json's keys: strings

    queue.schedule("m:f")
    assert [args for _, args in scheduled.calls] == [(1,), (2,)]
    assert scheduled.starts == [0, 5]
    scheduled.remotes[1]._settle(None, ScheduledFunctionError("boom"), "worker-0", progress=7)
    assert queue.position()["offsets"] == {"2": 7}


def test_a_manifest_commits_a_coordinators_state_with_the_weights(tmp_path: Path) -> None:
    state = {"shards": {"train": {"num_shards": 4, "done": [0, 2]}}}
    with_state, without = gc.new_directory(tmp_path, 3), gc.new_directory(tmp_path, 4)
    gc.commit(with_state, 3, JobConfig(), {}, [[]], coordinator=state)
    gc.commit(without, 4, JobConfig(), {}, [[]])

    assert gc.load_manifest(with_state).coordinator == state
    assert gc.load_manifest(without).coordinator == {}  # a worker-driven job's, and older manifests
