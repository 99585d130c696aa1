"""Incremental global checkpoints (issue 22), without a network: a chain of parts that hold only what
changed restores bit-identical to a full checkpoint of the same state, onto the server count that
wrote it and onto another; a damaged or missing link is refused naming its file; retention keeps the
links a kept checkpoint needs; compaction folds a chain into a full one that later parts build on.

Two "servers" here are a ShardStore and a SparseTable each, captured and written by the functions the
server's handler runs (ps_server.checkpoints.global_part), with table rows placed by row hash."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pshard.common import checkpoint_store as ckpt
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig, server_of
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.checkpoints.compaction import compact
from pshard.ps_server.checkpoints.global_part import capture_part, restore_tables, shard_snapshot, write_image
from pshard.ps_server.checkpoints.images import Pace, capture, save_npy
from pshard.ps_server.core.store import ShardSnapshot, ShardStore
from pshard.ps_server.tables import disktier
from pshard.ps_server.tables.table import CHUNK_ROWS, SparseTable

JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="adam", lr=0.01), job_id="inc")
PARAMS = {"w": ("float32", (6, 5)), "frozen": ("float32", (8,))}
CONFIG = TableConfig("emb", 4, optimizer="adagrad", lr=0.1, max_rows=900, seed=3)
ROWS = 2000  # ids pushed at first (two servers, a cap of 900 each: some are evicted)
# Two servers: "w" in two pieces, "frozen" (never pushed) on server 1.
LAYOUT = [{SliceKey("w", 0): ckpt.Range("w", 0, 12, (6, 5))},
          {SliceKey("w", 1): ckpt.Range("w", 12, 18, (6, 5)),
           SliceKey("frozen", 0): ckpt.Range("frozen", 0, 8, (8,))}]


class Server:
    def __init__(self, index: int) -> None:
        self.index = index
        self.writer = f"writer-{index}"
        self.store = ShardStore(JOB)
        rng = np.random.default_rng(index)
        self.store.declare([(k, rng.standard_normal(r.numel).astype(np.float32))
                            for k, r in LAYOUT[index].items()])
        self.table = SparseTable(CONFIG)
        self.clock = 0

    def step(self, ids: np.ndarray, seed: int) -> None:
        mine = ids[server_of(ids, 2) == self.index]
        rng = np.random.default_rng(seed)
        self.table.push(mine, rng.standard_normal((len(mine), 4)).astype(np.float32), clock=self.clock + 1)
        # A touch is part of the state too (LRU eviction, TTL): some rows are only read.
        read = np.arange(seed, ROWS, 61, dtype=np.int64)
        self.table.pull(read[server_of(read, 2) == self.index], clock=self.clock + 1)
        key = SliceKey("w", self.index)
        grad = rng.standard_normal(LAYOUT[self.index][key].numel).astype(np.float32)
        self.store.push(Stamp("w0", self.clock, 0), {key: grad})
        self.clock += 1


def _take(root: Path, servers: list[Server], clock: int, parent: ckpt.Checkpoint | None = None
          ) -> ckpt.Checkpoint:
    directory = ckpt.new_directory(root, clock)
    parts = [write_image(directory, capture_part(s.index, s.store.snapshot(), LAYOUT[s.index], [s.table],
                                                 parent.path if parent else None, s.writer))
             for s in servers]
    ckpt.commit(directory, clock, JOB, PARAMS, parts, parent=parent)
    return ckpt.load_manifest(directory, verify=True)


def _restore(checkpoint: ckpt.Checkpoint, servers: int) -> tuple[list[ShardSnapshot], dict[int, tuple]]:
    """Dense snapshots of `servers` servers (each parameter cut in `servers` pieces) and every row."""
    links = ckpt.chain(checkpoint)
    snaps = []
    for i in range(servers):
        ranges = {}
        for key, (_, shape) in PARAMS.items():
            n = int(np.prod(shape))
            cuts = np.linspace(0, n, servers + 1).astype(int)
            ranges[SliceKey(key, i)] = ckpt.Range(key, int(cuts[i]), int(cuts[i + 1] - cuts[i]), shape)
        snaps.append(shard_snapshot(checkpoint, JOB, ranges, None, links))
    rows: dict[int, tuple] = {}
    for i in range(servers):
        for table in restore_tables(checkpoint, i, servers, SparseTable, links=links):
            rows.update(_rows(table))
    return snaps, rows


def _rows(table: SparseTable) -> dict[int, tuple]:
    out = {}
    for rows, ids in table.chunks():
        cols = {name: a[rows] for name, (a, _) in table.columns().items()}
        for k, i in enumerate(ids.tolist()):
            out[i] = tuple(cols[name][k].tobytes() for name in sorted(cols))
    return out


def _same(a: tuple[list[ShardSnapshot], dict[int, tuple]], b: tuple[list[ShardSnapshot], dict[int, tuple]]
          ) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        for s, t in zip(x.slices, y.slices, strict=True):
            assert (s.key, s.version, s.clocks) == (t.key, t.version, t.clocks)
            assert s.value.tobytes() == t.value.tobytes()
            assert {k: np.asarray(v).tobytes() for k, v in s.opt_state.items()} == \
                {k: np.asarray(v).tobytes() for k, v in t.opt_state.items()}
    assert a[1] == b[1]


@pytest.fixture
def chain(tmp_path: Path) -> tuple[list[Server], list[ckpt.Checkpoint]]:
    """A full base and two incremental links, each after 1 % of the ids were pushed again or anew."""
    servers = [Server(0), Server(1)]
    for s in servers:
        s.step(np.arange(ROWS, dtype=np.int64), seed=1)
    links = [_take(tmp_path / "root", servers, 1)]
    for n, clock in enumerate((2, 3)):
        touched = np.concatenate([np.arange(n, ROWS, 200), np.arange(ROWS + 10 * n, ROWS + 10 * n + 10)])
        for s in servers:
            s.step(touched.astype(np.int64), seed=2 + n)
        links.append(_take(tmp_path / "root", servers, clock, parent=links[-1]))
    return servers, links


def test_a_chain_restores_bit_identical_to_a_full_checkpoint_onto_any_server_count(
        tmp_path: Path, chain: tuple[list[Server], list[ckpt.Checkpoint]]) -> None:
    servers, (base, _, head) = chain
    full = _take(tmp_path / "full", servers, 3)
    assert head.parent is not None and head.depth == 2 and full.parent is None
    live: dict[int, tuple] = {}
    for s in servers:
        live.update(_rows(s.table))
    for count in (2, 3, 1):
        restored = _restore(head, count)
        _same(restored, _restore(full, count))
        assert restored[1] == live
    # Only what changed was written: a fraction of the rows, and no copy of the frozen parameter.
    size = sum(f.size for f in head.files)
    assert size < 0.25 * sum(f.size for f in full.files)
    part = (head.path / "part-1.json").read_text()
    assert f'"npz": "../{base.path.name}/part-1.npz"' in part


def test_a_restore_onto_a_table_written_rows_since_removed_drops_them(
        tmp_path: Path, chain: tuple[list[Server], list[ckpt.Checkpoint]]) -> None:
    servers, (*_, head) = chain
    assert sum(s.table.evicted for s in servers) > 0  # the cap evicted rows the base held
    _, rows = _restore(head, 2)
    assert len(rows) == sum(len(s.table) for s in servers)


def test_a_damaged_or_missing_link_is_refused_naming_the_file(
        chain: tuple[list[Server], list[ckpt.Checkpoint]]) -> None:
    _, (base, middle, head) = chain
    values = next(base.path.glob("part-0.tables-*/t0/values.npy"))
    data = bytearray(values.read_bytes())
    data[-1] ^= 0xFF
    values.write_bytes(bytes(data))
    damaged = rf"{base.path.name}: part-0\.tables-\w+/t0/values\.npy does not match its SHA-256"
    with pytest.raises(ckpt.CheckpointError, match=damaged):
        ckpt.chain(head)
    shutil.rmtree(middle.path)
    with pytest.raises(ckpt.CheckpointError, match=rf"parent's manifest .*{middle.path.name}/MANIFEST\.json "
                       "is missing"):
        ckpt.chain(head)
    with pytest.raises(ckpt.CheckpointError, match="not a file of its chain"):
        ckpt.DenseReader(head)  # a reader not given the chain refuses the slices it would need


def test_retention_keeps_the_links_that_a_kept_checkpoint_needs(
        tmp_path: Path, chain: tuple[list[Server], list[ckpt.Checkpoint]]) -> None:
    servers, (base, middle, head) = chain
    assert ckpt.retain(tmp_path / "root", 1) == []
    assert all(c.path.is_dir() for c in (base, middle, head))
    newer = _take(tmp_path / "root", servers, 4)  # a full one: the chain is no longer needed
    assert sorted(ckpt.retain(tmp_path / "root", 1)) == sorted(c.path for c in (base, middle, head))
    assert ckpt.latest(tmp_path / "root") == newer


def test_compaction_folds_the_chain_into_a_full_checkpoint_that_later_links_build_on(
        tmp_path: Path, chain: tuple[list[Server], list[ckpt.Checkpoint]]) -> None:
    servers, (*_, head) = chain
    folded = compact(head)
    assert folded.parent is None and folded.clock == head.clock
    assert ckpt.latest(tmp_path / "root") == folded
    _same(_restore(folded, 3), _restore(head, 3))
    for s in servers:
        s.step(np.arange(5, 40, dtype=np.int64), seed=9)
    after = _take(tmp_path / "root", servers, 4, parent=folded)
    assert '"since": null' not in next(after.path.glob("part-0.tables-*/t0/table.json")).read_text()
    _same(_restore(after, 2), _restore(_take(tmp_path / "full", servers, 4), 2))


def test_a_server_that_did_not_write_the_parent_writes_a_full_part(
        tmp_path: Path, chain: tuple[list[Server], list[ckpt.Checkpoint]]) -> None:
    servers, (*_, head) = chain
    restarted = [Server(0), Server(1)]  # other processes: their stamps and versions mean nothing to it
    for old, new in zip(servers, restarted, strict=True):
        new.writer = f"restarted-{old.index}"
        for table in restore_tables(head, old.index, 2, SparseTable, links=ckpt.chain(head)):
            new.table = table
    after = _take(tmp_path / "root", restarted, 4, parent=head)
    assert '"parent": null' in (after.path / "part-0.json").read_text()
    assert '"npz"' not in (after.path / "part-1.json").read_text()
    _, rows = _restore(after, 2)
    assert rows == {**_rows(restarted[0].table), **_rows(restarted[1].table)}


def test_a_capture_is_the_table_as_it_was_whatever_the_requests_change_before_it_is_copied() -> None:
    table = SparseTable(TableConfig("cow", 2, optimizer="adagrad", lr=0.1, seed=5))
    ids = np.arange(3 * CHUNK_ROWS, dtype=np.int64)  # three chunks of row numbers
    table.push(ids, np.ones((len(ids), 2), np.float32), clock=1)
    before = _rows(table)
    image = capture(table, None)
    assert table.before_write is not None  # copy-on-write until filled
    # Requests change rows in two of the chunks, read others, and make rows that did not exist.
    table.push(ids[5:9], np.full((4, 2), 7, np.float32), clock=2)
    table.pull(ids[2 * CHUNK_ROWS + 1:2 * CHUNK_ROWS + 40], clock=3)
    table.push(np.arange(10**6, 10**6 + 3, dtype=np.int64), np.ones((3, 2), np.float32), clock=4)
    image.fill()
    assert table.before_write is None
    names = sorted(image.columns)
    copied = {i: tuple(image.columns[n][k].tobytes() for n in names)
              for k, i in enumerate(image.ids.tolist())}
    assert copied == before
    assert _rows(table) != before


def _held_reads(writer: threading.Thread, reached: threading.Event, release: threading.Event) -> type:
    """An array type whose slices, read on `writer`'s thread, wait for `release`: a writer held mid-copy."""

    class Held(np.ndarray):
        def __getitem__(self, key: Any) -> Any:  # type: ignore[override]  # numpy's overloads, all of them
            if isinstance(key, slice) and threading.current_thread() is writer:
                reached.set()
                release.wait(30)
            return super().__getitem__(key)
    return Held


def test_a_request_does_not_wait_for_the_writers_copy_of_a_chunk_and_the_image_is_the_capture() -> None:
    table = SparseTable(TableConfig("held", 2, optimizer="adagrad", lr=0.1, seed=5))
    ids = np.arange(3 * CHUNK_ROWS, dtype=np.int64)
    table.push(ids, np.ones((len(ids), 2), np.float32), clock=1)
    rows = table.index.live_rows()
    before = {name: a[rows].copy() for name, (a, _) in table.columns().items()}
    image = capture(table, None)
    reached, release = threading.Event(), threading.Event()
    writer = threading.Thread(target=image.fill)
    plain = table.values
    table.values = plain.view(_held_reads(writer, reached, release))
    writer.start()
    try:
        assert reached.wait(30), "the writer never began its copy"
        table.values = plain  # the request's kernels read the same rows through the plain array
        # Rows of the chunk being copied, and of one not reached yet, changed while the writer copies.
        request = threading.Thread(target=lambda: table.push(
            np.r_[ids[5:9], ids[-3:]], np.full((7, 2), 7, np.float32), clock=2))
        request.start()
        request.join(10)
        waited = request.is_alive()
    finally:
        release.set()
        writer.join(30)
    request.join(30)
    assert not waited, "a request waited for the writer's copy of a chunk"
    assert np.array_equal(image.ids, table.index.ids[rows])
    for name, column in before.items():
        assert np.array_equal(image.columns[name], column), name
    assert not np.array_equal(table.values[rows], before["values"])


def test_a_paced_write_takes_at_least_its_bytes_over_the_pace_and_writes_the_same_file(
        tmp_path: Path) -> None:
    array = np.arange(3 << 20, dtype=np.float32)  # 12 MiB
    started = time.monotonic()
    paced = save_npy(tmp_path / "paced.npy", array, Pace(60.0))
    assert time.monotonic() - started >= 12 / 60 - 0.05  # the first piece is not waited for
    assert paced == save_npy(tmp_path / "unpaced.npy", array)
    assert paced == ckpt.digest(tmp_path / "paced.npy")
    assert np.array_equal(np.load(tmp_path / "paced.npy"), array)


class _Tally(Pace):
    """A pace that counts the bytes it is told of, and runs `between` (a request) at each."""

    def __init__(self, between: Callable[[], object] = lambda: None) -> None:
        super().__init__(1e6)
        self.bytes = 0
        self._between = between

    def wrote(self, n: int) -> None:
        self.bytes += n
        self._between()
        super().wrote(n)


def test_a_background_part_paces_its_dense_npz_as_it_writes_and_hashes_it(tmp_path: Path) -> None:
    server = Server(0)
    image = capture_part(0, server.store.snapshot(), LAYOUT[0], [], None, server.writer)
    pace = _Tally()
    files = write_image(tmp_path, image, pace=pace)
    npz = next(f for f in files if f.name == "part-0.npz")
    assert (npz.sha256, npz.size) == ckpt.digest(tmp_path / "part-0.npz")  # hashed as it was written
    # Each byte paced once, as it is written: it is not read back for its checksum (before, the npz was
    # written and read back, each byte paced twice).
    assert pace.bytes == npz.size
    with np.load(tmp_path / "part-0.npz", allow_pickle=False) as written:
        assert sorted(written.files) == sorted(image.arrays)
        for key, array in image.arrays.items():
            assert written[key].dtype == array.dtype and np.array_equal(written[key], array), key


def test_a_capture_copied_while_requests_change_rows_between_its_chunks_is_the_table_as_it_was() -> None:
    table = SparseTable(TableConfig("cow", 2, optimizer="adagrad", lr=0.1, seed=5))
    ids = np.arange(3 * CHUNK_ROWS, dtype=np.int64)
    table.push(ids, np.ones((len(ids), 2), np.float32), clock=1)
    rows = table.index.live_rows()
    before = {name: a[rows].copy() for name, (a, _) in table.columns().items()}
    image = capture(table, None)
    rng = np.random.default_rng(0)
    clock = iter(range(2, 100))

    def request() -> None:  # ids all over the table: chunks copied, being copied and not yet reached
        if table.before_write is not None:
            touched = np.unique(rng.choice(len(ids), 500, replace=False)).astype(np.int64)
            table.push(touched, np.full((len(touched), 2), 3, np.float32), clock=next(clock))

    image.fill(_Tally(request))
    assert np.array_equal(image.ids, table.index.ids[rows])
    for name, column in before.items():
        assert np.array_equal(image.columns[name], column), name
    assert not np.array_equal(table.values[rows], before["values"])


def test_a_request_during_a_capture_saves_its_rows_aside_and_leaves_the_image_to_the_writer() -> None:
    # A request's writes into the image's fresh arrays were a page fault a row on the training's path.
    table = SparseTable(TableConfig("aside", 2, optimizer="sgd", lr=0.1, seed=5))
    ids = np.arange(1000, dtype=np.int64)
    table.push(ids, np.ones((len(ids), 2), np.float32), clock=1)
    rows = table.index.live_rows()
    before = table.values[rows].copy()
    image = capture(table, None)
    for column in image.columns.values():
        column.setflags(write=False)  # a request that wrote here would raise
    table.push(ids[::3], np.full((len(ids[::3]), 2), 5, np.float32), clock=2)
    for column in image.columns.values():
        column.setflags(write=True)
    image.fill()
    assert np.array_equal(image.columns["values"], before)


def test_a_table_with_a_disk_tier_is_captured_whole_with_its_spilled_rows(tmp_path: Path) -> None:
    plain = TableConfig("tiered", 4, optimizer="adagrad", lr=0.1)
    probe = disktier.RecordLayout.of(SparseTable(plain).columns())
    per_row = probe.record_bytes + disktier.DIRECTORY_BYTES
    config = dataclasses.replace(plain, memory_mb=200 * per_row / 2**20)  # about 200 rows in RAM
    table = SparseTable(config, store=tmp_path / "rows")
    ids = np.arange(2000, dtype=np.int64)
    for batch in np.split(ids, 10):  # a request's own rows stay in RAM: later ones spill earlier ones
        table.push(batch, np.ones((len(batch), 4), np.float32), clock=1)
    assert table.disk is not None and len(table.disk) > 0  # most rows are on disk
    image = capture(table, {"token": table.token, "epoch": 0})  # never incremental with a disk tier
    assert image.meta["since"] is None and image.copier is None
    assert sorted(image.ids.tolist()) == ids.tolist()
    np.testing.assert_array_equal(image.columns["values"][np.argsort(image.ids)], table.pull(ids))
