"""Admission counts in bounded memory (ps_server.tables.admission): the count-min sketch's stated error
(never late against the exact count decayed alike, rarely early), its fixed memory in a table whatever
the id stream, and a backup's counts following its primary's."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pshard.common.checkpoint_store import Checkpoint, FileEntry
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import spec_from_proto, spec_to_proto
from pshard.ps_server.checkpoints.global_part import restore_tables
from pshard.ps_server.replication.table_rows import capture, install
from pshard.ps_server.replication.table_wire import batch_from_proto, batch_to_proto
from pshard.ps_server.tables.admission import DEPTH, CountMinSketch, counter_dtype
from pshard.ps_server.tables.files import load_tables, pointer_path, restore_admission, save_tables
from pshard.ps_server.tables.table import SparseTable


class _Exact:
    """The reference: an exact count per id, capped and halved on the sketch's schedule."""

    def __init__(self, cap: int, window: int) -> None:
        self.cap, self.window, self.added, self.counts = cap, window, 0, dict[int, int]()

    def add(self, ids: list[int]) -> None:
        for i in ids:
            self.counts[i] = min(self.counts.get(i, 0) + 1, self.cap)
        self.added += len(ids)
        for _ in range(self.added // self.window):
            self.counts = {i: c // 2 for i, c in self.counts.items()}
        self.added %= self.window


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(2, 300), memory=st.integers(8, 256), seed=st.integers(0, 2**32),
       batches=st.lists(st.lists(st.integers(-50, 50), max_size=40, unique=True), max_size=30))
def test_the_estimate_is_never_below_the_exact_count_decayed_alike(
        cap: int, memory: int, seed: int, batches: list[list[int]]) -> None:
    # A few bytes of counters for ~100 ids: collisions and halvings on most streams.
    sketch = CountMinSketch(memory, cap, seed)
    exact = _Exact(cap, sketch.window)
    for batch in batches:
        ids = np.array(batch, np.int64)
        counted = sketch.add(ids)
        expected = [min(exact.counts.get(i, 0) + 1, cap) for i in batch]
        assert all(int(c) >= e for c, e in zip(counted, expected, strict=True))
        exact.add(batch)
        every = np.arange(-50, 51, dtype=np.int64)
        got = sketch.estimate(every)
        assert all(int(g) >= exact.counts.get(int(i), 0) for i, g in zip(every, got, strict=True))
        assert int(got.max(initial=0)) <= cap


def test_once_seen_ids_are_rarely_admitted_early_at_the_default_size() -> None:
    # 2 M distinct ids, each seen once, through 4 MB of counters (8 windows: halvings included).
    sketch = CountMinSketch(4 << 20, 2, seed=7)
    early = sum(int((sketch.add(np.arange(s, s + 8192, dtype=np.int64)) >= 2).sum())
                for s in range(0, 2_000_000, 8192))
    assert sketch.epoch >= 7
    # The stated bound is (1/2)**DEPTH (Markov's, per row); conservative update does far better.
    assert early / 2_000_000 <= 0.002 < 0.5 ** DEPTH


def test_an_id_seen_within_a_window_is_admitted_at_most_half_admit_after_late() -> None:
    admit_after = 6
    for before in range(1, admit_after):  # sightings before the halving falls
        sketch = CountMinSketch(1 << 14, admit_after, seed=before)
        target = np.array([-1], np.int64)
        for _ in range(before):
            assert int(sketch.add(target)[0]) < admit_after
        # Once-seen ids up to the window: the halving falls here, after `before` sightings.
        sketch.add(np.arange(1, sketch.window - before + 1, dtype=np.int64))
        assert sketch.epoch == 1
        after = 1
        while int(sketch.add(target)[0]) < admit_after:
            after += 1
        assert sketch.epoch == 1
        # Exact and never forgetting: admitted at sighting admit_after; halved: later, by at most half.
        assert admit_after <= before + after <= admit_after + admit_after // 2


def test_a_table_counts_sightings_in_fixed_memory_whatever_the_stream() -> None:
    table = SparseTable(TableConfig("emb", 2, admit_after=2, admit_memory_mb=1, max_rows=1000))
    assert table.admission is not None and table.admission.nbytes == 1 << 20
    ones = np.ones((4096, 2), np.float32)
    table.push(np.arange(4096, dtype=np.int64), ones)  # warm: the buffers a push keeps
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(4096, 300_000, 4096):
            table.push(np.arange(start, start + 4096, dtype=np.int64), ones)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # An exact record grew ~21 bytes per id (6 MB here); the sketch does not grow at all. The rows
    # admitted early (at most max_rows) are the only growth.
    assert grown < 1 << 20, grown
    assert table.admission.nbytes == 1 << 20 and len(table) <= 1000
    # A second sighting admits: the counts held.
    assert table.push(np.arange(299_000, 299_008, dtype=np.int64), ones[:8]) == 8


def test_without_admission_by_count_no_counters_are_kept() -> None:
    assert SparseTable(TableConfig("emb", 2, admit_prob=0.5)).admission is None
    assert [counter_dtype(cap) for cap in (255, 256, 1 << 30)] == [np.uint8, np.uint16, np.uint32]


def test_admit_memory_mb_is_checked_and_crosses_the_wire() -> None:
    for bad in (-1.0, 0.0, 2048.0, float("nan")):
        message = rf"table 'emb': admit_memory_mb: got {bad}, expected a number in \[0.001, 1024.0\]"
        with pytest.raises(InvalidArgumentError, match=message):
            TableConfig("emb", 2, admit_memory_mb=bad)
    config = TableConfig("emb", 2, admit_after=3, admit_memory_mb=0.5)
    assert spec_from_proto(spec_to_proto(config)) == config
    unset = spec_to_proto(TableConfig("emb", 2))
    unset.admit_memory_mb = 0  # a client that does not know the field: the default
    assert spec_from_proto(unset).admit_memory_mb == TableConfig("emb", 2).admit_memory_mb


def test_a_backup_follows_its_primarys_counts_across_halvings() -> None:
    config = TableConfig("emb", 2, admit_after=3, admit_memory_mb=0.001)  # 1 KiB: halvings every 64 ids
    primary, backup = SparseTable(config), SparseTable(config)
    grads = np.ones((100, 2), np.float32)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = np.unique(rng.integers(0, 300, 50))
        primary.push(ids, grads[: len(ids)])
        install(backup, batch_from_proto(batch_to_proto(capture(primary, ids))))
        assert backup.admit_epoch == primary.admit_epoch
        assert backup.sightings(ids).tolist() == primary.sightings(ids).tolist()
    assert primary.admit_epoch > 3
    every = np.arange(300, dtype=np.int64)
    assert (backup.sightings(every) <= primary.sightings(every)).all()  # never earlier than its primary


def test_loading_counters_of_another_size_names_both() -> None:
    sketch = CountMinSketch(1024, 2)
    counters, added, epoch = CountMinSketch(2048, 2).state()
    with pytest.raises(ValueError, match=r"got uint8\(4, 512\), expected uint8\(4, 256\)"):
        sketch.load(counters, added, epoch)


def test_the_counts_survive_a_checkpoint_and_fold_onto_another_server_count(tmp_path: Path) -> None:
    config = TableConfig("emb", 2, admit_after=3, admit_memory_mb=0.01)
    parts = [SparseTable(config), SparseTable(config)]
    once, twice = np.arange(0, 400, 2, dtype=np.int64), np.arange(1, 400, 2, dtype=np.int64)
    for number, (part, ids) in enumerate(zip(parts, (once, twice), strict=True)):
        for _ in range(1 + number):  # part0 saw its ids once, part1 twice
            part.push(ids, np.ones((len(ids), 2), np.float32))
        save_tables(tmp_path, f"part{number}", [part])

    (loaded,) = load_tables(tmp_path, "part1", SparseTable)  # the same server: its counts exactly
    assert loaded.admission is not None and parts[1].admission is not None
    assert np.array_equal(loaded.admission.counters, parts[1].admission.counters)
    assert loaded.admit_epoch == parts[1].admit_epoch and len(loaded) == 0
    assert loaded.push(twice[:5], np.ones((5, 2), np.float32)) == 5  # the third sighting admits

    # One server takes both parts (a global checkpoint's restore): every id counts at least as before.
    files = tuple(FileEntry(f"part{n}.tables.json", "", 0) for n in range(2))
    checkpoint = Checkpoint(tmp_path, 0, 0.0, JobConfig(), {}, files, servers=2)
    (folded,) = restore_tables(checkpoint, 0, 1, SparseTable)
    for part, ids in zip(parts, (once, twice), strict=True):
        assert (folded.sightings(ids) >= part.sightings(ids)).all()
    index = json.loads(pointer_path(tmp_path, "part1").read_text())
    sub = tmp_path / index["directory"] / index["tables"][0]

    fresh = SparseTable(TableConfig("emb", 2, admit_after=3, admit_memory_mb=0.02))  # another size: anew
    restore_admission(fresh, sub, json.loads((sub / "table.json").read_text()))
    assert fresh.sightings(twice).max() == 0
