"""The replication core (ps_server/replication/dense.py): what a primary records of each step, how a backup
replays it, and how promoted copies become a store's own slices. Real stores, no network."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.policies import Slot
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.replication.dense import ReplicaSet
from pshard.ps_server.replication.records import (
    Record,
    record_from_proto,
    record_to_proto,
    state_record,
    step_record,
)

A, B = SliceKey("a"), SliceKey("b", 1)
ADAM_SYNC = JobConfig(mode="sync", optimizer=OptimizerConfig(name="adam", lr=0.01))
ADAM_ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="adam", lr=0.01))


class Recorder:
    """The primary side without the network: every step's record, and each slice's state first."""

    def __init__(self, store: ShardStore) -> None:
        self.records: list[Record] = []
        self.seeded: set[SliceKey] = set()
        store.set_step_hook(self)

    def __call__(self, slot: Slot, update: np.ndarray, count: int) -> None:
        if slot.key not in self.seeded:
            self.records.append(state_record(slot, 0))
            self.seeded.add(slot.key)
        self.records.append(step_record(slot, update, count, 0))


def _same(a: Slot, b: Slot) -> None:
    assert (a.key, a.version, a.last_clock, a.dtype) == (b.key, b.version, b.last_clock, b.dtype)
    assert a.value.tobytes() == b.value.tobytes()
    assert a.opt_state.keys() == b.opt_state.keys()
    for name, value in a.opt_state.items():
        other = b.opt_state[name]
        assert (other.tobytes() == value.tobytes()) if isinstance(value, np.ndarray) else other == value


def _primary(config: JobConfig, workers: tuple[str, ...]) -> ShardStore:
    store = ShardStore(config, quorum=dict.fromkeys(workers, 0))
    rng = np.random.default_rng(0)
    store.declare([(A, rng.standard_normal(50).astype(np.float32)),
                   (B, rng.standard_normal((4, 3)).astype(np.float16))])
    return store


def _train(store: ShardStore, workers: tuple[str, ...], clocks: range) -> None:
    for clock in clocks:
        for w, worker in enumerate(workers):
            rng = np.random.default_rng([w, clock])
            store.push(Stamp(worker, 0, clock), {A: rng.standard_normal(50).astype(np.float32),
                                                 B: rng.standard_normal((4, 3)).astype(np.float16)})


@pytest.mark.parametrize("config, workers", [(ADAM_SYNC, ("w0", "w1", "w2")), (ADAM_SYNC, ("w0",)),
                                             (ADAM_ASYNC, ("w0", "w1"))])
def test_a_backup_replaying_the_records_is_bit_identical(config, workers):
    primary = _primary(config, workers)
    recorder = Recorder(primary)
    _train(primary, workers, range(5))
    # Through the wire form, as a Replicate call carries them.
    replayed = [record_from_proto(record_to_proto(r)) for r in recorder.records]
    backup = ReplicaSet()
    assert backup.apply(config, replayed) == []
    for slot in primary.slots():
        _same(slot, backup._slots[slot.key])


def test_duplicates_are_skipped_gaps_ask_for_state_and_an_older_state_never_rolls_back():
    primary = _primary(ADAM_ASYNC, ("w0",))
    recorder = Recorder(primary)
    _train(primary, ("w0",), range(4))
    records = recorder.records
    a = [r for r in records if r.key == A]
    state, steps = a[0], a[1:]
    backup = ReplicaSet()
    assert backup.apply(ADAM_ASYNC, [steps[1]]) == [A]  # no state yet: a gap
    assert backup.apply(ADAM_ASYNC, [state, steps[0], steps[0], steps[1]]) == []  # the resent one skipped
    assert backup.apply(ADAM_ASYNC, [steps[3]]) == [A]  # steps[2] missing
    assert backup.apply(ADAM_ASYNC, [steps[2], steps[3], state]) == []  # the old state is ignored
    _same(next(s for s in primary.slots() if s.key == A), backup._slots[A])


def test_promoted_copies_continue_as_the_store_would_have():
    workers = ("w0", "w1")
    primary = _primary(ADAM_SYNC, workers)
    recorder = Recorder(primary)
    _train(primary, workers, range(3))
    backup = ReplicaSet()
    backup.apply(ADAM_SYNC, recorder.records)
    # A half-done clock on the primary is lost with it: only w0 pushed clock 3.
    primary.push(Stamp("w0", 0, 3), {A: np.ones(50, np.float32), B: np.ones((4, 3), np.float16)})
    heir = ShardStore(ADAM_SYNC, quorum=dict.fromkeys(workers, 0))
    heir.adopt(backup.take([A, B]))
    assert not backup.holds(A) and heir.holds(A)
    # Resent: clock 2 is a duplicate on the heir as on the primary; clock 3 is taken again from both.
    for store in (primary, heir):
        assert store.push(Stamp("w0", 0, 2), {A: np.ones(50, np.float32)}).dropped == 1
    heir.push(Stamp("w0", 0, 3), {A: np.ones(50, np.float32), B: np.ones((4, 3), np.float16)})
    for store in (primary, heir):
        store.push(Stamp("w1", 0, 3), {A: np.full(50, 2, np.float32), B: np.full((4, 3), 2, np.float16)})
    for mine, theirs in zip(primary.slots(), heir.slots(), strict=True):
        _same(mine, theirs)


def test_a_copy_taken_mid_clock_takes_the_resent_push_of_that_clock():
    # A joining server's catch-up copy (issue 20) is the slices' state, taken while w0's push of clock 3
    # waits in the primary's aggregate for w1's: the copy's clocks say w0 pushed 3, but the aggregate is
    # not copied, so the heir must take w0's resend of clock 3 (else the clock never completes there).
    workers = ("w0", "w1")
    primary = _primary(ADAM_SYNC, workers)
    _train(primary, workers, range(3))
    primary.push(Stamp("w0", 0, 3), {A: np.ones(50, np.float32), B: np.ones((4, 3), np.float16)})
    backup = ReplicaSet()
    backup.apply(ADAM_SYNC, [record_from_proto(record_to_proto(state_record(s, 0))) for s in primary.slots()])
    heir = ShardStore(ADAM_SYNC, quorum=dict.fromkeys(workers, 0))
    heir.adopt(backup.take([A, B]))
    assert heir.push(Stamp("w0", 0, 2), {A: np.ones(50, np.float32)}).dropped == 1  # completed: a duplicate
    assert heir.push(Stamp("w0", 0, 3), {A: np.ones(50, np.float32), B: np.ones((4, 3), np.float16)}
                     ).applied == 2
    for store in (primary, heir):
        store.push(Stamp("w1", 0, 3), {A: np.full(50, 2, np.float32), B: np.full((4, 3), 2, np.float16)})
    for mine, theirs in zip(primary.slots(), heir.slots(), strict=True):
        _same(mine, theirs)


def test_another_jobs_copies_are_dropped():
    primary = _primary(ADAM_ASYNC, ("w0",))
    recorder = Recorder(primary)
    _train(primary, ("w0",), range(1))
    backup = ReplicaSet()
    backup.apply(ADAM_ASYNC, recorder.records)
    assert backup.keys() == [A, B]
    backup.apply(ADAM_SYNC, [])
    assert backup.keys() == []


def test_a_release_drops_only_that_primarys_copies():
    first, second = _primary(ADAM_ASYNC, ("w0",)), ShardStore(ADAM_ASYNC, quorum={"w0": 0})
    second.declare([(SliceKey("c"), np.zeros(7, np.float32))])
    backup = ReplicaSet()
    recorders = Recorder(first), Recorder(second)
    _train(first, ("w0",), range(1))
    second.push(Stamp("w0", 0, 0), {SliceKey("c"): np.ones(7, np.float32)})
    for recorder, name in zip(recorders, ("p0", "p1"), strict=True):
        backup.apply(ADAM_ASYNC, recorder.records, name)
    assert backup.keys() == [A, B, SliceKey("c")]
    assert backup.release("p0") == 2
    assert backup.keys() == [SliceKey("c")]
    assert backup.release("p0") == 0


@pytest.mark.parametrize("wire", ["state", "steps"])
def test_a_promoted_backup_applies_a_redispatched_scheduled_call_once(wire):
    # A coordinator's call ran on w0 and pushed; the primary died before the coordinator saw it finish, so
    # the call runs again on w1 with the same schedule id: the heir must drop it as the primary would.
    primary = _primary(ADAM_ASYNC, ("w0", "w1"))
    recorder = Recorder(primary)
    _train(primary, ("w0",), range(2))
    call = {"schedule": (1 << 32) + 7, "schedule_seq": 0, "schedule_floor": 1 << 32}
    grads = {A: np.ones(50, np.float32), B: np.ones((4, 3), np.float16)}
    assert primary.push(Stamp("w0", 0, 0, **call), grads).applied == 2
    records = [state_record(slot, 0) for slot in primary.slots()] if wire == "state" else recorder.records
    backup = ReplicaSet()
    assert backup.apply(ADAM_ASYNC, [record_from_proto(record_to_proto(r)) for r in records]) == []
    heir = ShardStore(ADAM_ASYNC, quorum=dict.fromkeys(("w0", "w1"), 0))
    heir.adopt(backup.take([A, B]))
    for store in (primary, heir):
        assert store.push(Stamp("w1", 0, 0, **call), grads).dropped == 2
    # Its next push is new to both.
    for store in (primary, heir):
        assert store.push(Stamp("w1", 0, 0, **{**call, "schedule_seq": 1}), grads).applied == 2
    for mine, theirs in zip(primary.slots(), heir.slots(), strict=True):
        _same(mine, theirs)
        assert mine.scheduled == theirs.scheduled
