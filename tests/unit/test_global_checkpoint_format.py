"""The global checkpoint format (pshard.common.checkpoint_store, ps_server.checkpoints.global_part), without
a network:
what commits a checkpoint, what makes one torn, retention, and re-cutting slices by range."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pshard.common import checkpoint_store as ckpt
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.checkpoints.global_part import shard_snapshot, write_part
from pshard.ps_server.core.store import ShardStore

JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.9), job_id="fmt")
VALUE = np.arange(10, dtype=np.float32)


def _take(root: Path, clock: int, pieces: list[tuple[int, int]] = [(0, 6), (6, 4)]) -> ckpt.Checkpoint:  # noqa: B006
    """A checkpoint of parameter "p" (10 elements) cut into `pieces` (offset, numel), one server each,
    after one SGD step with momentum (so there is optimizer state to re-cut)."""
    directory = ckpt.new_directory(root, clock)
    parts = []
    for server, (offset, numel) in enumerate(pieces):
        store = ShardStore(JOB)
        key = SliceKey("p", server)
        store.declare([(key, VALUE[offset:offset + numel])])
        store.push(Stamp("w0", 0, 0), {key: np.ones(numel, np.float32)})
        ranges = {key: ckpt.Range("p", offset, numel, (2, 5))}
        parts.append(write_part(directory, server, store.snapshot(), ranges))
    ckpt.commit(directory, clock, JOB, {"p": ("float32", (2, 5))}, parts)
    return ckpt.load_manifest(directory, verify=True)


def test_slices_are_re_cut_by_range_whatever_the_pieces_were(tmp_path: Path) -> None:
    checkpoint = _take(tmp_path, 1)
    with ckpt.DenseReader(checkpoint) as reader:
        np.testing.assert_array_equal(reader.full("p"), (VALUE - 0.5).reshape(2, 5))
        np.testing.assert_array_equal(reader.read("p", 4, 4, "momentum_buffer"), np.ones(4, np.float32))
    new = {SliceKey("p", 0): ckpt.Range("p", 0, 3, (2, 5)), SliceKey("p", 1): ckpt.Range("p", 3, 7, (2, 5))}
    snap = shard_snapshot(checkpoint, JOB, new, None)
    assert [s.key for s in snap.slices] == list(new)
    np.testing.assert_array_equal(snap.slices[1].value, VALUE[3:] - 0.5)
    assert snap.slices[1].opt_state["step"] == 1 and snap.slices[1].clocks == {"w0": 0}
    assert snap.generations == {}  # a restore is a new incarnation of the job


def test_a_model_that_does_not_match_the_checkpoint_is_refused(tmp_path: Path) -> None:
    checkpoint = _take(tmp_path, 1)
    with pytest.raises(ckpt.CheckpointError,
                       match=r"parameter 'p' has shape \(2, 5\), the model has \(10,\)"):
        shard_snapshot(checkpoint, JOB, {SliceKey("p"): ckpt.Range("p", 0, 10, (10,))}, None)
    with pytest.raises(ckpt.CheckpointError, match=r"parameters \['q'\] are not in it"):
        shard_snapshot(checkpoint, JOB, {SliceKey("q"): ckpt.Range("q", 0, 10, (2, 5))}, None)


def test_without_manifest_or_with_a_damaged_file_a_checkpoint_is_torn(tmp_path: Path) -> None:
    good = _take(tmp_path, 1)
    no_manifest = _take(tmp_path, 2)
    (no_manifest.path / ckpt.MANIFEST).unlink()
    damaged = _take(tmp_path, 3)
    npz = damaged.path / "part-1.npz"
    raw = bytearray(npz.read_bytes())
    raw[-40] ^= 0xFF  # same size, other bytes: only the checksum tells
    npz.write_bytes(bytes(raw))
    missing = _take(tmp_path, 4)
    (missing.path / "part-0.json").unlink()

    committed, torn = ckpt.scan(tmp_path)  # sizes only: the damaged one still looks whole
    assert [c.clock for c in committed] == [1, 3]
    reasons = {t.path.name[:17]: t.reason for t in torn}
    assert "no MANIFEST.json" in reasons["ckpt-000000000002"]
    assert "part-0.json is missing" in reasons["ckpt-000000000004"]

    reported: list[ckpt.Torn] = []
    assert ckpt.latest(tmp_path, report=reported.append) == good
    assert sorted(t.path.name[:17] for t in reported) == [
        "ckpt-000000000002", "ckpt-000000000003", "ckpt-000000000004"]
    assert any("does not match its SHA-256" in t.reason for t in reported)


def test_retention_keeps_the_newest_and_torn_ones_that_may_still_be_written(tmp_path: Path) -> None:
    for clock in (1, 2, 3):
        _take(tmp_path, clock)
    old_torn = ckpt.new_directory(tmp_path, 0)
    new_torn = ckpt.new_directory(tmp_path, 9)
    removed = ckpt.retain(tmp_path, 2)
    assert sorted(p.name[:17] for p in removed) == ["ckpt-000000000000", "ckpt-000000000001"]
    assert [c.clock for c in ckpt.scan(tmp_path)[0]] == [2, 3]
    assert not old_torn.exists() and new_torn.exists()
    with pytest.raises(ValueError, match="keep: got 0"):
        ckpt.retain(tmp_path, 0)
