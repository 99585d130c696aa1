"""The contract every consistency policy shares, run against sync, async and SSP.

The store is set up with a single live worker 'a', so every policy applies a push
at once and the differences between policies do not show here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from pshard.common.errors import (
    DTypeMismatchError,
    EmptyRequestError,
    FutureClockError,
    InvalidArgumentError,
    PSError,
    ShapeMismatchError,
    StaleGenerationError,
    UnknownKeyError,
)
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.policies import AsyncPolicy, BoundedStalenessPolicy, SyncPolicy
from pshard.ps_server.core.store import ShardStore, SliceMeta

from tests.unit.snapshots import declared_keys, snapshot_diff
from tests.unit.store_waits import wait_pull

W = SliceKey("fc.weight")
B = SliceKey("fc.bias")
BIG = SliceKey("emb", part=3)
GEN = 2


def stamp(clock: int, worker: str = "a", generation: int = GEN) -> Stamp:
    return Stamp(worker, generation, clock)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


@pytest.fixture(params=["sync", "async", "ssp"])
def config(request: pytest.FixtureRequest) -> JobConfig:
    return JobConfig(mode=request.param, staleness=1, optimizer=OptimizerConfig(lr=0.5))


@pytest.fixture
def store(config: JobConfig) -> ShardStore:
    s = ShardStore(config, quorum={"a": GEN})
    s.declare([(W, f32(1, 2, 3)), (B, f32(0, 0))])
    return s


def test_make_policy_picks_the_type_of_the_mode() -> None:
    modes = ("sync", "async", "ssp")
    stores = {m: ShardStore(JobConfig(mode=m, staleness=4, backup_workers=1)) for m in modes}
    assert isinstance(stores["sync"].policy, SyncPolicy) and stores["sync"].policy.backup_workers == 1
    assert isinstance(stores["async"].policy, AsyncPolicy)
    assert isinstance(stores["ssp"].policy, BoundedStalenessPolicy) and stores["ssp"].policy.staleness == 4


class TestStoreContract:
    # ---- declare ----

    def test_declare_creates_missing_slices_from_copies_of_the_values(self, config: JobConfig) -> None:
        store = ShardStore(config, quorum={"a": GEN})
        value = f32(1, 2)

        created = store.declare([(W, value)])
        value[:] = 99

        assert created == [True]
        [(stored, version)] = store.read([W])
        assert stored.tolist() == [1, 2] and version == 0
        assert declared_keys(store) == {W}

    def test_declare_is_idempotent_and_the_first_value_wins(self, store: ShardStore) -> None:
        created = store.declare([(W, f32(7, 7, 7)), (BIG, f32(5))])

        assert created == [False, True]
        assert store.read([W])[0][0].tolist() == [1, 2, 3]
        assert store.read([BIG])[0][0].tolist() == [5]

    def test_the_first_of_two_declarations_in_one_request_wins(self, config: JobConfig) -> None:
        store = ShardStore(config)

        created = store.declare([(W, f32(1)), (W, f32(2))])

        assert created == [True, False]
        assert store.read([W])[0][0].tolist() == [1]

    @pytest.mark.parametrize(("value", "error", "got", "has"), [
        (np.zeros(4, np.float32), ShapeMismatchError, "(4,)", "(3,)"),
        (np.zeros(3, np.float64), DTypeMismatchError, "float64", "float32"),
    ])
    def test_conflicting_declaration_is_refused_naming_both_values_and_creates_nothing(
            self, store: ShardStore, value: np.ndarray, error: type[PSError], got: str, has: str) -> None:
        before = store.snapshot()

        with pytest.raises(error) as info:
            store.declare([(BIG, f32(1)), (W, value)])

        assert "fc.weight" in str(info.value) and got in str(info.value) and has in str(info.value)
        assert snapshot_diff(store.snapshot(), before) == []
        assert declared_keys(store) == {W, B}

    def test_declare_refuses_values_that_are_not_floating_point(self, store: ShardStore) -> None:
        with pytest.raises(DTypeMismatchError, match="int64"):
            store.declare([(BIG, np.arange(3))])

    def test_empty_declare_is_refused(self, store: ShardStore) -> None:
        with pytest.raises(EmptyRequestError):
            store.declare([])

    # ---- push ----

    def test_push_applies_one_optimizer_step_and_bumps_the_version(self, store: ShardStore) -> None:
        outcome = store.push(stamp(0), {W: f32(2, 2, 2), B: f32(-2, 4)})

        assert (outcome.applied, outcome.dropped) == (2, 0)
        assert [(v.tolist(), ver) for v, ver in store.read([W, B])] == [([0, 1, 2], 1), ([1, -2], 1)]
        stats = store.stats()
        assert stats.pushes_applied == 2 and stats.worker_clocks == {"a": 0}
        assert (stats.min_version, stats.max_version, stats.slices, stats.bytes_stored) == (1, 1, 2, 20)

    def test_float16_slices_update_a_float32_master_and_read_back_as_float16(self, config: JobConfig) -> None:
        store = ShardStore(config, quorum={"a": GEN})
        store.declare([(W, np.full(2, 2048, np.float16))])

        # 2048 - 0.5 is not a float16 (spacing 2 there): only a float32 master keeps the step.
        store.push(stamp(0), {W: np.ones(2, np.float16)})
        store.push(stamp(1), {W: np.ones(2, np.float16)})

        [(value, _)] = store.read([W])
        assert value.dtype == np.float16 and value.tolist() == [2047, 2047]
        assert store.snapshot().slices[0].value.dtype == np.float32

    def test_wire_dtype_lets_float16_gradients_update_a_float32_slice(self) -> None:
        store = ShardStore(JobConfig(mode="async", wire_dtype="float16", optimizer=OptimizerConfig(lr=1.0)))
        store.declare([(W, f32(1, 1))])

        store.push(stamp(0), {W: np.array([0.5, 0.25], np.float16)})

        assert store.read([W])[0][0].tolist() == [0.5, 0.75]

    def test_duplicate_push_of_a_worker_clock_and_slice_is_applied_once(self, store: ShardStore) -> None:
        store.push(stamp(0), {W: f32(2, 2, 2)})

        again = store.push(stamp(0), {W: f32(2, 2, 2), B: f32(2, 2)})

        assert (again.applied, again.dropped) == (1, 1)
        assert store.read([W])[0] [0].tolist() == [0, 1, 2]
        assert store.read([W])[0][1] == 1
        assert store.stats().pushes_dropped == 1

    def test_push_never_keeps_a_reference_to_the_gradient(self, store: ShardStore) -> None:
        grad = f32(2, 2, 2)
        grad.flags.writeable = False  # like np.frombuffer over a network buffer
        store.push(stamp(0), {W: grad})

        snap = store.snapshot()
        assert all(not np.shares_memory(grad, s.value) for s in snap.slices)
        assert store.read([W])[0][0].tolist() == [0, 1, 2]

    # Each bad push carries a valid gradient for fc.weight first: nothing of it may land.
    BAD_PUSHES: dict[str, tuple[Callable[[], tuple[Stamp, dict[SliceKey, np.ndarray]]],
                                type[PSError], tuple[str, ...]]] = {
        "unknown key": (lambda: (stamp(1), {W: f32(1, 1, 1), SliceKey("nope"): f32(1)}),
                        UnknownKeyError, ("nope",)),
        "wrong shape": (lambda: (stamp(1), {W: f32(1, 1, 1), B: f32(1, 1, 1)}),
                        ShapeMismatchError, ("fc.bias", "(3,)", "(2,)")),
        "wrong dtype": (lambda: (stamp(1), {W: f32(1, 1, 1), B: np.ones(2, np.float64)}),
                        DTypeMismatchError, ("fc.bias", "float64", "float32")),
        "float16 without wire dtype": (lambda: (stamp(1), {W: f32(1, 1, 1), B: np.ones(2, np.float16)}),
                                       DTypeMismatchError, ("fc.bias", "float16", "float32")),
        "empty": (lambda: (stamp(1), {}), EmptyRequestError, ("'a'", "clock 1")),
        # fc.bias was never pushed: clock 1 is two clocks past it in every mode.
        "future clock on one slice": (lambda: (stamp(1), {W: f32(1, 1, 1), B: f32(1, 1)}),
                                      FutureClockError, ("fc.bias", "clock 1")),
        "far future clock": (lambda: (stamp(9), {W: f32(1, 1, 1)}),
                             FutureClockError, ("fc.weight", "clock 9")),
        "stale generation": (lambda: (stamp(1, generation=GEN - 1), {W: f32(1, 1, 1)}),
                             StaleGenerationError, ("'a'", f"generation {GEN - 1}", f"generation {GEN}")),
        "not a member": (lambda: (stamp(0, worker="worker-3", generation=9), {W: f32(1, 1, 1)}),
                         StaleGenerationError, ("worker-3", "not a live member", "'a'")),
    }

    @pytest.mark.parametrize("case", list(BAD_PUSHES))
    def test_bad_push_raises_naming_the_values_and_leaves_the_store_byte_for_byte_unchanged(
            self, store: ShardStore, case: str) -> None:
        make, error, words = self.BAD_PUSHES[case]
        store.push(stamp(0), {W: f32(2, 2, 2)})
        before, stats_before = store.snapshot(), store.stats()
        bad_stamp, grads = make()

        with pytest.raises(error) as info:
            store.push(bad_stamp, grads)

        for word in words:
            assert word in str(info.value)
        assert snapshot_diff(store.snapshot(), before) == []
        assert store.stats() == stats_before

    # ---- pull ----

    def test_pull_of_pushed_clock_is_ready(self, store: ShardStore) -> None:
        store.push(stamp(0), {W: f32(2, 2, 2)})

        assert store.pull_status(stamp(1), [W]) is None
        assert wait_pull(store, stamp(1), [W], timeout_s=5)[0][1] == 1

    @pytest.mark.parametrize(("pull", "error", "words"), [
        (lambda: (stamp(0), [W, SliceKey("nope")]), UnknownKeyError, ("nope",)),
        (lambda: (stamp(5), [W]), FutureClockError, ("fc.weight", "clock 5")),
        (lambda: (stamp(0, generation=GEN - 1), [W]), StaleGenerationError,
         (f"generation {GEN - 1}", f"generation {GEN}")),
        (lambda: (stamp(0), []), EmptyRequestError, ("'a'",)),
    ], ids=["unknown key", "future clock", "stale generation", "empty"])
    def test_bad_pull_raises_naming_the_values(
            self, store: ShardStore, pull: Callable[[], tuple[Stamp, list[SliceKey]]],
            error: type[PSError], words: tuple[str, ...]) -> None:
        bad_stamp, keys = pull()

        with pytest.raises(error) as info:
            store.pull_status(bad_stamp, keys)

        for word in words:
            assert word in str(info.value)

    def test_a_worker_outside_the_quorum_may_read_but_not_write(self, store: ShardStore) -> None:
        # Fencing guards writes; a chief that left the quorum still fetches the final weights.
        outsider = stamp(0, worker="worker-3")

        assert store.pull_status(outsider, [W]) is None
        with pytest.raises(StaleGenerationError, match="not a live member"):
            store.push(outsider, {W: f32(1, 1, 1)})

    def test_read_returns_copies(self, store: ShardStore) -> None:
        [(value, _)] = store.read([W])
        value[:] = 42

        assert store.read([W])[0][0].tolist() == [1, 2, 3]

    def test_a_newer_generation_fences_off_the_older_one(self, store: ShardStore) -> None:
        store.push(stamp(0, generation=GEN + 1), {W: f32(2, 2, 2)})

        with pytest.raises(StaleGenerationError, match=f"generation {GEN}"):
            store.push(stamp(1, generation=GEN), {W: f32(2, 2, 2)})

    def test_a_read_with_a_newer_generation_fences_nobody(self, store: ShardStore) -> None:
        # Anyone may stamp a read with a real worker's id: only that worker's writes move its stamp.
        assert store.pull_status(stamp(0, generation=2**64 - 1), [W]) is None

        assert store.push(stamp(0), {W: f32(2, 2, 2)}).applied == 1

    # ---- whole requests: validated before any part lands ----

    BAD_REQUESTS = {
        # fc.bias was never pushed: a pull at clock 2 is from the future in every mode, while the push
        # part (fc.weight at clock 1) alone would be accepted.
        "pull part from the future": (lambda: (stamp(1), [SliceMeta(W, "float32", (3,))], [B]),
                                      FutureClockError, ("fc.bias", "clock 2")),
        "pull part of an unknown key": (lambda: (stamp(0), [SliceMeta(W, "float32", (3,))], [SliceKey("no")]),
                                        UnknownKeyError, ("'no'",)),
        "push part from the future": (lambda: (stamp(3), [SliceMeta(W, "float32", (3,))], [W]),
                                      FutureClockError, ("fc.weight", "clock 3")),
        "a slice pushed twice": (lambda: (stamp(0), [SliceMeta(W, "float32", (3,))] * 2, []),
                                 InvalidArgumentError, ("fc.weight", "2 times")),
        "a slice pulled twice": (lambda: (stamp(0), [], [W, W]),
                                 InvalidArgumentError, ("fc.weight", "2 times")),
        "a push from a non-member": (lambda: (stamp(0, worker="x"), [SliceMeta(W, "float32", (3,))], [W]),
                                     StaleGenerationError, ("'x'", "not a live member")),
        "nothing": (lambda: (stamp(0), [], []), EmptyRequestError, ("'a'",)),
    }

    @pytest.mark.parametrize("case", list(BAD_REQUESTS))
    def test_check_request_refuses_the_whole_request_and_changes_nothing(
            self, store: ShardStore, case: str) -> None:
        make, error, words = self.BAD_REQUESTS[case]
        store.push(stamp(0), {W: f32(2, 2, 2)})
        before, stats_before = store.snapshot(), store.stats()

        with pytest.raises(error) as info:
            store.check_request(*make())

        for word in words:
            assert word in str(info.value)
        assert snapshot_diff(store.snapshot(), before) == []
        assert store.stats() == stats_before

    def test_check_request_passes_a_push_pull_of_its_own_slices(self, store: ShardStore) -> None:
        # Pulling at clock 1 what this request pushes at clock 0 is fine once the push lands.
        specs = store.check_request(stamp(0), [SliceMeta(W, "float32", (3,)), SliceMeta(B, "float32", (2,))],
                                    [W, B])

        assert [s.shape for s in specs] == [(3,), (2,)]

    # ---- observing, snapshots ----

    def test_subscribers_are_called_after_an_applied_push_outside_the_locks(self, store: ShardStore) -> None:
        calls: list[bool] = []

        def callback() -> None:
            # If the store still held a lock, these calls from another thread would block.
            probe = threading.Thread(target=lambda: (store.stats(), store.snapshot(), store.read([W])))
            probe.start()
            probe.join(timeout=5)
            calls.append(not probe.is_alive())

        store.subscribe(callback)
        store.push(stamp(0), {W: f32(2, 2, 2)})
        store.push(stamp(0), {W: f32(2, 2, 2)})  # duplicate: nothing changed, nobody to wake

        assert calls == [True]

    def test_restore_of_a_snapshot_equals_the_original_and_continues_identically(
            self, store: ShardStore) -> None:
        store.push(stamp(0), {W: f32(2, 2, 2), B: f32(1, 1)})
        store.push(stamp(1), {W: f32(4, 0, 2)})
        original = store.snapshot()

        restored = ShardStore.restore(original)
        for s in (store, restored):
            s.push(stamp(1), {W: f32(9, 9, 9), B: f32(2, 2)})
            s.push(stamp(2), {W: f32(1, 1, 1)})

        assert snapshot_diff(restored.snapshot(), original) != []  # the pushes above changed it...
        assert snapshot_diff(restored.snapshot(), store.snapshot()) == []  # ...as they changed the original
        assert restored.stats() == store.stats()

    def test_snapshot_is_a_copy(self, store: ShardStore) -> None:
        snap = store.snapshot()

        store.push(stamp(0), {W: f32(2, 2, 2)})

        assert snap.slices[1].value.tolist() == [1, 2, 3] and snap.slices[1].version == 0
