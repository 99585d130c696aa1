"""The store's exactly-once record for scheduled calls (pshard.coordinator): each (schedule id, push number,
slice) is applied once, whichever worker sends it; a call below the coordinator's floor applies nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pshard.common import checkpoint_store as ckpt
from pshard.common.errors import InvalidArgumentError, StaleGenerationError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.checkpoints.global_part import shard_snapshot, write_part
from pshard.ps_server.core import store as store_module
from pshard.ps_server.core.store import PushOutcome, ShardStore

W = SliceKey("w", 0)


def adding_store(quorum: dict[str, int] | None = None) -> ShardStore:
    """async, SGD with lr 1: a gradient of -x adds x, so the value counts the pushes that landed."""
    store = ShardStore(JobConfig(mode="async", optimizer=OptimizerConfig(lr=1.0)), quorum=quorum)
    store.declare([(W, np.zeros(1, np.float32))])
    return store


def add(store: ShardStore, worker: str, clock: int, x: float, schedule: int = 0, seq: int = 0,
        floor: int = 0, generation: int = 1) -> PushOutcome:
    stamp = Stamp(worker, generation, clock, None, schedule, seq, floor)
    return store.push(stamp, {W: np.array([-x], np.float32)})


def value(store: ShardStore) -> float:
    return float(store.read([W])[0][0][0])


def test_a_re_dispatched_calls_push_counts_once_whichever_worker_sends_it() -> None:
    store = adding_store()
    assert add(store, "worker-0", 0, 5.0, schedule=7, seq=0) == PushOutcome(applied=1, dropped=0)

    again = add(store, "worker-1", 0, 5.0, schedule=7, seq=0)  # worker-0 died; worker-1 runs call 7 again

    assert again == PushOutcome(applied=0, dropped=1)
    assert value(store) == 5.0


def test_the_calls_later_pushes_and_other_calls_apply() -> None:
    store = adding_store()
    add(store, "worker-0", 0, 1.0, schedule=7, seq=0)
    add(store, "worker-1", 0, 2.0, schedule=7, seq=1)  # the re-run goes on past where the first one died
    add(store, "worker-1", 0, 4.0, schedule=8, seq=0)  # scheduled pushes' clocks mean nothing
    add(store, "worker-0", 0, 8.0)  # an unscheduled push: the per-worker clock alone decides
    assert add(store, "worker-0", 0, 8.0).dropped == 1

    assert value(store) == 15.0


def test_a_partitioned_run_that_comes_back_after_its_call_finished_applies_nothing() -> None:
    store = adding_store()
    add(store, "worker-1", 0, 3.0, schedule=4, seq=0, floor=4)  # the re-dispatched run of call 4 lands
    add(store, "worker-1", 0, 1.0, schedule=5, seq=0, floor=5)  # call 4 has finished: the floor is 5

    late = add(store, "worker-0", 0, 3.0, schedule=4, seq=1, floor=2)  # the cut-off first run, push 1

    assert late == PushOutcome(applied=0, dropped=1)
    assert value(store) == 4.0


def test_finished_calls_are_forgotten_so_the_record_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_SCHEDULED_KEPT", 8)
    store = adding_store()
    for call in range(1, 41):
        add(store, "worker-0", 0, 1.0, schedule=call, floor=call)

    slot = store._slots[W]  # the record itself: nothing else shows its size
    assert len(slot.scheduled) <= 9
    assert value(store) == 40.0
    assert add(store, "worker-1", 0, 1.0, schedule=3).dropped == 1  # forgotten, and still refused


def test_a_refused_scheduled_push_leaves_the_record_and_the_value_unchanged() -> None:
    store = adding_store(quorum={"worker-0": 2})
    with pytest.raises(StaleGenerationError, match="worker-0"):
        add(store, "worker-0", 0, 5.0, schedule=9, generation=1)  # an old incarnation: fenced

    assert value(store) == 0.0
    assert store._slots[W].scheduled == {}
    assert add(store, "worker-0", 0, 5.0, schedule=9, generation=2).applied == 1


def test_a_restarted_worker_starting_at_clock_0_again_loses_no_scheduled_push() -> None:
    store = adding_store()
    for call in (1, 2, 3):
        add(store, "worker-0", 0, 1.0, schedule=call)

    assert add(store, "worker-0", 0, 1.0, schedule=4).applied == 1  # the same id, a new process
    assert value(store) == 4.0


def test_a_scheduled_push_to_a_sync_job_is_refused_naming_the_mode() -> None:
    store = ShardStore(JobConfig(mode="sync", optimizer=OptimizerConfig(lr=1.0)), quorum={"worker-0": 1})
    store.declare([(W, np.zeros(1, np.float32))])
    with pytest.raises(InvalidArgumentError, match="scheduled call 3 to a sync job, expected an async one"):
        add(store, "worker-0", 0, 1.0, schedule=3)
    assert value(store) == 0.0


def test_a_coordinator_launched_again_numbers_its_calls_above_the_last_ones_floor() -> None:
    from pshard.coordinator.coordinator import first_schedule_id

    store = adding_store()
    old, new = first_schedule_id(3), first_schedule_id(9)  # registration generations of the two
    add(store, "worker-0", 0, 1.0, schedule=old + 500, floor=old + 500)  # the first one got far

    assert add(store, "worker-0", 0, 2.0, schedule=new, floor=new).applied == 1
    assert add(store, "worker-1", 0, 4.0, schedule=old + 499).dropped == 1  # a straggler of the first
    assert value(store) == 3.0


def _restored(checkpoint: ckpt.Checkpoint, cuts: list[tuple[int, int]]) -> list[ShardStore]:
    """One store per cut (offset, numel) of parameter "p", restored from `checkpoint`."""
    ranges = [{SliceKey("p", i): ckpt.Range("p", o, n, (10,))} for i, (o, n) in enumerate(cuts)]
    return [ShardStore.restore(shard_snapshot(checkpoint, checkpoint.job, r, None)) for r in ranges]


def _push_to(store: ShardStore, schedule: int) -> PushOutcome:
    (key,) = [s.key for s in store.slots()]
    n = store.read([key])[0][0].size
    return store.push(Stamp("worker-2", 1, 0, None, schedule, 0, 5), {key: -np.arange(n, dtype=np.float32)})


def test_a_global_checkpoint_keeps_each_slices_record_of_the_calls_it_holds(tmp_path: Path) -> None:
    """Call 7's push had reached both pieces of "p" when the checkpoint was taken, call 8's only the first.
    Re-dispatched after a restore on the same cut, each lands where it had not; on another cut, a slice
    counts a push applied only where every piece it is cut from had it (call 8 lands again on its first
    three elements rather than be lost on the rest)."""
    job = JobConfig(mode="async", optimizer=OptimizerConfig(lr=1.0), job_id="sched")
    directory = ckpt.new_directory(tmp_path, 1)
    parts = []
    for server, (offset, numel) in enumerate([(0, 6), (6, 4)]):
        store = ShardStore(job)
        key = SliceKey("p", server)
        store.declare([(key, np.zeros(numel, np.float32))])
        for schedule in (7, 8) if server == 0 else (7,):
            assert _push_to(store, schedule).applied == 1
        ranges = {key: ckpt.Range("p", offset, numel, (10,))}
        parts.append(write_part(directory, server, store.snapshot(), ranges))
    ckpt.commit(directory, 1, job, {"p": ("float32", (10,))}, parts)
    checkpoint = ckpt.load_manifest(directory, verify=True)
    assert ckpt.last_scheduled_call(checkpoint) == 8  # a coordinator restoring it numbers its calls above

    same = _restored(checkpoint, [(0, 6), (6, 4)])
    assert [_push_to(s, 7).applied for s in same] == [0, 0]
    assert [_push_to(s, 8).applied for s in same] == [0, 1]
    recut = _restored(checkpoint, [(0, 3), (3, 7)])
    assert [_push_to(s, 7).applied for s in recut] == [0, 0]
    assert [_push_to(s, 8).applied for s in recut] == [0, 1]
