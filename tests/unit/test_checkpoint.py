"""Shard checkpoints: weights, optimizer state and clocks survive a save and load, and a crash mid-save."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import FutureClockError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.checkpoints import shard as checkpoint
from pshard.ps_server.checkpoints.shard import load_shard, save_shard
from pshard.ps_server.core.optimizers import Optimizer, SliceState, make_optimizer
from pshard.ps_server.core.store import ShardStore

from tests.unit.snapshots import snapshot_diff

W = SliceKey("fc.weight")
H = SliceKey("emb", part=2)


class MomentumStub:
    """A stateful optimizer with array and scalar state, whatever the real optimizers support yet."""

    def init_state(self, param: np.ndarray) -> SliceState:
        return {"buf": np.zeros_like(param), "step": 0, "scale": 0.5}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        buf = state["buf"]
        assert isinstance(buf, np.ndarray)
        buf *= 0.9
        buf += grad
        param -= float(state["scale"]) * buf
        state["step"] = int(state["step"]) + 1
        state["scale"] = float(state["scale"]) * 0.75


def trained_store(optimizer: Optimizer | None, config: JobConfig | None = None) -> ShardStore:
    """A sync store after two clocks, with a third one half aggregated (a pending sum and contributor)."""
    config = config or JobConfig(mode="sync", optimizer=OptimizerConfig(lr=0.1))
    store = ShardStore(config, quorum={"a": 3, "b": 4}, optimizer=optimizer)
    rng = np.random.default_rng(0)
    store.declare([(W, rng.standard_normal((3, 2)).astype(np.float32)),
                   (H, rng.standard_normal(5).astype(np.float16))])
    for clock in range(2):
        for worker, generation in (("a", 3), ("b", 4)):
            store.push(Stamp(worker, generation, clock),
                       {W: rng.standard_normal((3, 2)).astype(np.float32),
                        H: rng.standard_normal(5).astype(np.float16)})
    store.push(Stamp("a", 3, 2), {W: np.ones((3, 2), np.float32)})
    return store


def test_save_then_load_round_trips_values_versions_optimizer_state_and_clocks(tmp_path: Path) -> None:
    store = trained_store(MomentumStub())
    snap = store.snapshot()

    save_shard(tmp_path, snap, "shard-0")
    loaded = load_shard(tmp_path, "shard-0")

    assert loaded is not None
    assert snapshot_diff(loaded, snap) == []
    by_key = {s.key: s for s in loaded.slices}
    assert by_key[W].version == 2 and by_key[W].clocks == {"a": 2, "b": 1}
    assert by_key[W].contributors == ("a",)
    assert by_key[H].opt_state["step"] == 2
    assert by_key[H].value.dtype == np.float32  # the float16 slice's master copy
    assert loaded.generations == {"a": 3, "b": 4} and loaded.config == store.config


def test_a_restored_store_continues_exactly_like_the_original(tmp_path: Path) -> None:
    store = trained_store(MomentumStub())
    save_shard(tmp_path, store.snapshot(), "shard-0")
    loaded = load_shard(tmp_path, "shard-0")
    assert loaded is not None
    restored = ShardStore.restore(loaded, optimizer=MomentumStub())

    for s in (store, restored):
        s.push(Stamp("b", 4, 2), {W: np.full((3, 2), 2, np.float32)})  # completes the pending clock

    assert snapshot_diff(restored.snapshot(), store.snapshot()) == []
    assert restored.read([W, H])[1][0].dtype == np.float16


def test_a_restored_async_shard_drops_a_scheduled_call_it_had_applied(tmp_path: Path) -> None:
    # A coordinator's call pushed to this server, which saved and crashed before the call's result came
    # back: the call runs again on another worker, and the restored server must not apply it twice.
    store = ShardStore(JobConfig(mode="async", optimizer=OptimizerConfig(lr=0.1)), quorum={"a": 0, "b": 0})
    store.declare([(W, np.zeros((3, 2), np.float32))])
    call = {"schedule": (1 << 32) + 3, "schedule_seq": 0, "schedule_floor": (1 << 32) + 1}
    assert store.push(Stamp("a", 0, 0, **call), {W: np.ones((3, 2), np.float32)}).applied == 1
    save_shard(tmp_path, store.snapshot(), "shard-0")
    loaded = load_shard(tmp_path, "shard-0")
    assert loaded is not None and snapshot_diff(loaded, store.snapshot()) == []
    restored = ShardStore.restore(loaded)
    assert restored.push(Stamp("b", 0, 0, **call), {W: np.ones((3, 2), np.float32)}).dropped == 1
    # A call below the floor (it finished before the save) is dropped too; the next push number is new.
    below = {**call, "schedule": 1 << 32}
    assert restored.push(Stamp("b", 0, 0, **below), {W: np.ones((3, 2), np.float32)}).dropped == 1
    assert restored.push(Stamp("b", 0, 0, **{**call, "schedule_seq": 1}),
                         {W: np.ones((3, 2), np.float32)}).applied == 1


def test_round_trip_with_the_servers_stateful_optimizers(tmp_path: Path) -> None:
    configs = [OptimizerConfig(name="adam", lr=0.01), OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)]
    for opt in configs:
        try:
            make_optimizer(opt)
        except NotImplementedError:
            pytest.skip(f"optimizer {opt.name!r} is not implemented yet")
        store = trained_store(None, JobConfig(mode="sync", optimizer=opt))
        snap = store.snapshot()
        assert any(isinstance(v, np.ndarray) for s in snap.slices for v in s.opt_state.values())

        save_shard(tmp_path, snap, f"shard-{opt.name}")
        loaded = load_shard(tmp_path, f"shard-{opt.name}")

        assert loaded is not None and snapshot_diff(loaded, snap) == []


def test_loading_a_checkpoint_that_was_never_written_gives_none(tmp_path: Path) -> None:
    assert load_shard(tmp_path, "shard-0") is None


def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = trained_store(MomentumStub())
    first = store.snapshot()
    save_shard(tmp_path, first, "shard-0")
    store.push(Stamp("b", 4, 2), {W: np.ones((3, 2), np.float32)})
    real_replace = os.replace

    def crash_before_the_json_lands(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if str(dst).endswith(".json"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_before_the_json_lands)
    with pytest.raises(OSError, match="simulated crash"):
        save_shard(tmp_path, store.snapshot(), "shard-0")
    monkeypatch.undo()
    # What a process killed while writing leaves behind: half-written temporary files.
    (tmp_path / ".shard-0.json.0123abcd.tmp").write_bytes(b'{"format": 1, "arr')
    (tmp_path / ".shard-0.ckpt-0123456789ab.npz.0123abcd.tmp").write_bytes(b"PK\x03\x04 torn")

    loaded = load_shard(tmp_path, "shard-0")

    assert loaded is not None and snapshot_diff(loaded, first) == []


def test_a_later_save_replaces_the_checkpoint_and_removes_what_it_superseded(tmp_path: Path) -> None:
    store = trained_store(MomentumStub())
    save_shard(tmp_path, store.snapshot(), "shard-0")
    save_shard(tmp_path, store.snapshot(), "shard-1")  # another shard in the same directory
    (tmp_path / ".shard-0.json.0123abcd.tmp").write_bytes(b"torn")
    store.push(Stamp("b", 4, 2), {W: np.ones((3, 2), np.float32)})
    second = store.snapshot()

    path = save_shard(tmp_path, second, "shard-0")
    loaded = load_shard(tmp_path, "shard-0")

    assert path == tmp_path / "shard-0.json"
    assert loaded is not None and snapshot_diff(loaded, second) == []
    names = sorted(p.name for p in tmp_path.iterdir())
    arrays = json.loads(path.read_text())["arrays"]
    assert [n for n in names if n.startswith("shard-0")] == sorted(["shard-0.json", arrays])
    assert sum(n.startswith("shard-1") for n in names) == 2
    assert not any(n.startswith(".") for n in names)


def test_the_arrays_load_without_pickle(tmp_path: Path) -> None:
    path = save_shard(tmp_path, trained_store(MomentumStub()).snapshot(), "shard-0")
    arrays = tmp_path / json.loads(path.read_text())["arrays"]

    with np.load(arrays, allow_pickle=False) as npz:
        dtypes = {npz[name].dtype for name in npz.files}

    assert dtypes and all(d != np.dtype(object) for d in dtypes)


def test_a_checkpoint_name_with_a_path_in_it_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        save_shard(tmp_path, trained_store(MomentumStub()).snapshot(), "../elsewhere")


def _two_worker_sync_store() -> ShardStore:
    store = ShardStore(JobConfig(mode="sync", optimizer=OptimizerConfig("sgd", lr=1.0)),
                       quorum={"a": 0, "b": 0})
    store.declare([(SliceKey("w"), np.zeros(2, np.float32))])
    return store


def _sync_step(store: ShardStore, clock: int) -> None:
    for worker in ("a", "b"):
        store.push(Stamp(worker, 0, clock), {SliceKey("w"): np.ones(2, np.float32)})


def test_a_restored_sync_shard_catches_up_with_the_workers_clock_and_goes_on() -> None:
    store = _two_worker_sync_store()
    _sync_step(store, 0)
    snap = store.snapshot()  # the checkpoint: version 1
    for clock in (1, 2, 3):
        _sync_step(store, clock)  # updates the crash will lose

    restored = ShardStore.restore(snap)
    _sync_step(restored, 4)  # the workers carry on at their own clock

    [(value, version)] = restored.read([SliceKey("w")])
    assert version == 5
    assert value.tolist() == [-2.0, -2.0]  # the checkpoint's -1, one more step; clocks 1-3 are lost
    assert restored.pull_status(Stamp("a", 0, 5), [SliceKey("w")]) is None


def test_a_store_that_was_not_restored_still_refuses_a_clock_from_the_future() -> None:
    store = _two_worker_sync_store()
    _sync_step(store, 0)

    with pytest.raises(FutureClockError, match="clock 4"):
        store.push(Stamp("a", 0, 4), {SliceKey("w"): np.ones(2, np.float32)})


def test_a_restored_async_shard_accepts_the_workers_clock() -> None:
    store = ShardStore(JobConfig(mode="async", optimizer=OptimizerConfig("sgd", lr=1.0)))
    store.declare([(SliceKey("w"), np.zeros(2, np.float32))])
    store.push(Stamp("a", 0, 0), {SliceKey("w"): np.ones(2, np.float32)})
    restored = ShardStore.restore(store.snapshot())

    outcome = restored.push(Stamp("a", 0, 7), {SliceKey("w"): np.ones(2, np.float32)})

    assert outcome.applied == 1
    assert restored.read([SliceKey("w")])[0][0].tolist() == [-2.0, -2.0]


def test_a_restored_sync_shard_follows_the_faster_worker_when_the_two_are_a_clock_apart() -> None:
    # The crash caught worker a still retrying clock 1 (its pull had not come back) while b had
    # moved on to clock 2. Whatever order their retries arrive in, the shard must follow the
    # newest clock and neither worker may be refused or left waiting.
    for first in ("a", "b"):
        store = _two_worker_sync_store()
        store.push(Stamp("a", 0, 0), {SliceKey("w"): np.ones(2, np.float32)})
        snap = store.snapshot()  # version 0, a's clock-0 gradient pending
        restored = ShardStore.restore(snap)
        pushes = {"a": Stamp("a", 0, 1), "b": Stamp("b", 0, 2)}
        for worker in (first, "b" if first == "a" else "a"):
            restored.push(pushes[worker], {SliceKey("w"): np.ones(2, np.float32)})

        assert restored.pull_status(Stamp("a", 0, 2), [SliceKey("w")]) is None  # a gets clock 2's weights
        restored.push(Stamp("a", 0, 2), {SliceKey("w"): np.ones(2, np.float32)})
        assert restored.read([SliceKey("w")])[0][1] == 3, first  # clock 2 completed with both
