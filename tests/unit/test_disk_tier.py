"""The disk tier of sparse tables (memory_mb, issue 22 item 2): with a tenth of the table's rows in RAM,
pulls, pushes, evictions, checkpoints and exports give what the same table all in RAM gives, bit for
bit; the store is a cache wiped at start; its rows, bytes and movements are counted; a table or a
server set up without a usable --table-dir is refused, naming it."""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pshard.common.errors import ClusterConfigError, InvalidArgumentError
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import spec_from_proto, spec_to_proto
from pshard.ps_server import __main__ as ps_main
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.replication import table_rows
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables import disktier
from pshard.ps_server.tables.files import export_table, load_tables, save_tables
from pshard.ps_server.tables.table import SparseTable

DIM, IDS = 8, 4000


def budget(config: TableConfig, rows: int) -> float:
    """memory_mb that holds about `rows` rows of `config` in RAM."""
    probe = SparseTable(config)
    layout = disktier.RecordLayout.of(probe.columns())
    return rows * (layout.record_bytes + disktier.DIRECTORY_BYTES) / 2**20


def pair(tmp_path: Path, ram_rows: int, **kw: object) -> tuple[SparseTable, SparseTable]:
    """The same table all in RAM and with `ram_rows` of RAM, its disk tier under tmp_path."""
    plain = TableConfig("emb", DIM, **kw)  # type: ignore[arg-type]
    tiered = TableConfig("emb", DIM, memory_mb=budget(plain, ram_rows), **kw)  # type: ignore[arg-type]
    return SparseTable(plain), SparseTable(tiered, store=tmp_path / "emb.rows")


def zipf_stream(seed: int, steps: int, batch: int = 256) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.unique(rng.zipf(1.1, batch).astype(np.int64) % IDS * 7919 - 50_000) for _ in range(steps)]


def drive(tables: tuple[SparseTable, SparseTable], stream: list[np.ndarray], seed: int) -> None:
    """Push each batch of `stream` and pull a sample, into both tables, asserting equal answers."""
    rng = np.random.default_rng(seed)
    for clock, ids in enumerate(stream):
        grads = rng.normal(size=(len(ids), DIM)).astype(np.float32)
        assert tables[0].push(ids, grads, clock=clock) == tables[1].push(ids, grads, clock=clock)
        sample = np.unique(rng.choice(stream[rng.integers(len(stream))], 20))
        np.testing.assert_array_equal(tables[0].pull(sample, clock=clock),
                                      tables[1].pull(sample, clock=clock))


def everything(table: SparseTable, tmp_path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, rows) of every row, sorted by id, as an export writes them."""
    ids_path, rows_path, n = export_table(table, tmp_path / name)
    ids, rows = np.load(ids_path), np.load(rows_path)
    assert len(ids) == n == len(table)
    order = np.argsort(ids)
    return ids[order], rows[order]


@pytest.mark.parametrize(("optimizer", "row_dtype"), [("sgd", "float32"), ("adagrad", "int8"),
                                                       ("adam", "float32"), ("lazy_adam", "bfloat16")])
def test_a_tenth_in_ram_gives_the_rows_of_the_table_all_in_ram(
        tmp_path: Path, optimizer: str, row_dtype: str) -> None:
    plain, tiered = pair(tmp_path, 340, optimizer=optimizer, row_dtype=row_dtype, seed=3)
    drive((plain, tiered), zipf_stream(1, 60), seed=2)

    assert len(plain) == len(tiered) > 3400
    stats = tiered.tiers()
    # A tenth in RAM (1/64 slack below the budget), the rest on disk, and rows went both ways.
    assert stats.ram_rows <= tiered.ram_rows and stats.disk_rows >= len(tiered) - tiered.ram_rows
    assert stats.spilled > stats.disk_rows and stats.fetched > 0
    assert tiered.ram_rows * 10 <= len(tiered)
    for got, want in zip(everything(tiered, tmp_path, "t"), everything(plain, tmp_path, "p"), strict=True):
        np.testing.assert_array_equal(got, want)
    # The optimizer state came back with its rows: the next push moves them alike.
    ids = everything(plain, tmp_path, "p")[0]
    grads = np.full((len(ids), DIM), 0.5, np.float32)
    plain.push(ids, grads, clock=100)
    tiered.push(ids, grads, clock=100)
    np.testing.assert_array_equal(tiered.pull(ids, clock=101), plain.pull(ids, clock=101))


_BATCHES = st.lists(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 60), min_size=1, max_size=40),
                    min_size=1, max_size=25)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=_BATCHES, ram_rows=st.integers(1, 12),
       optimizer=st.sampled_from(["sgd", "adagrad", "lazy_adam"]), policy=st.sampled_from(["lru", "lfu"]))
def test_any_id_stream_gives_the_rows_of_the_table_all_in_ram(
        batches: list[list[int]], ram_rows: int, optimizer: str, policy: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        tables = pair(Path(folder), ram_rows, optimizer=optimizer, cap_policy=policy)
        drive(tables, [np.unique(np.array(b, np.int64)) for b in batches], seed=len(batches))
        ids = np.unique(np.concatenate([np.array(b, np.int64) for b in batches]))
        assert len(tables[0]) == len(tables[1]) == len(ids)
        np.testing.assert_array_equal(tables[1].pull(ids, clock=99), tables[0].pull(ids, clock=99))


def test_max_rows_evicts_the_coldest_rows_of_either_tier(tmp_path: Path) -> None:
    plain, tiered = pair(tmp_path, 20, max_rows=128, cap_policy="lfu")
    evicted: list[np.ndarray] = []
    tiered._on_evict = evicted.append
    first = np.arange(100, dtype=np.int64)
    ones = np.ones((100, DIM), np.float32)
    for table in (plain, tiered):
        for k in range(100):  # id k is updated k + 1 times: no two rows as warm
            table.push(first[k:], ones[k:], clock=k)
        table.pull(first[:5], clock=100)  # back in RAM, and still the coldest by updates
    assert tiered.disk is not None and len(tiered.disk) >= 75
    assert (tiered.disk.slots(first[:5]) < 0).all() and (tiered.disk.slots(first[5:24]) >= 0).all()
    later = np.arange(1000, 1050, dtype=np.int64)
    for table in (plain, tiered):
        table.push(later, ones[:50], clock=101)
    # 150 rows over a cap of 128: down to 126, the 24 coldest go, 5 from RAM and 19 from disk.
    assert len(plain) == len(tiered) == 126 and plain.evicted == tiered.evicted == 24
    np.testing.assert_array_equal(np.sort(np.concatenate(evicted)), first[:24])
    assert (tiered.disk.slots(first[:24]) < 0).all()
    everyone = np.concatenate([first, later])
    np.testing.assert_array_equal(tiered.pull(everyone, clock=102), plain.pull(everyone, clock=102))


def test_ttl_evicts_spilled_rows_when_swept_and_when_named(tmp_path: Path) -> None:
    plain, tiered = pair(tmp_path, 10, ttl=5.0)
    old, fresh = np.arange(40, dtype=np.int64), np.arange(100, 140, dtype=np.int64)
    ones = np.ones((40, DIM), np.float32)
    for table in (plain, tiered):
        table.push(old, ones, clock=0)
        table.push(fresh, ones, clock=4)
    assert tiered.disk is not None and len(tiered.disk) == 40
    for table in (plain, tiered):
        table.push(fresh[:5], ones[:5], clock=7)  # the old rows are 7 clocks old: swept from both tiers
    assert len(plain) == len(tiered) == 40 and plain.evicted == tiered.evicted == 40
    assert (tiered.disk.slots(old) < 0).all()
    # Past the ttl, a spilled row fetched by a pull reads as absent too (its initial value).
    both = np.concatenate([old, fresh])
    np.testing.assert_array_equal(tiered.pull(both, clock=12), plain.pull(both, clock=12))
    assert len(tiered) == len(plain)


def test_a_checkpoint_holds_both_tiers_and_a_restart_starts_the_store_empty(tmp_path: Path) -> None:
    plain, tiered = pair(tmp_path, 300, optimizer="adagrad")
    drive((plain, tiered), zipf_stream(5, 25), seed=6)
    assert tiered.disk is not None and len(tiered.disk) > 1000
    save_tables(tmp_path / "ckpt", "shard", [tiered])
    # Rows changed after the checkpoint, spilled or not, are not what a restart restores.
    drive((plain, tiered), zipf_stream(7, 5), seed=8)

    store = tmp_path / "emb.rows"
    (restored,) = load_tables(tmp_path / "ckpt", "shard", lambda c: SparseTable(c, store=store))
    # The store was wiped when the table was made, then the restore filled it again.
    assert restored.disk is not None and restored.tiers().fetched == 0
    (in_ram,) = load_tables(tmp_path / "ckpt", "shard", SparseTable)
    assert in_ram.disk is None and len(in_ram) == len(restored)
    for got, want in zip(everything(restored, tmp_path, "r"), everything(in_ram, tmp_path, "m"), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_store_left_by_another_process_is_wiped(tmp_path: Path) -> None:
    store = tmp_path / "emb.rows"
    store.mkdir()
    (store / "rows.slab").write_bytes(b"left by a crashed server")
    config = TableConfig("emb", DIM, memory_mb=0.001)
    table = SparseTable(config, store=store)
    assert len(table) == 0 and (store / "rows.slab").stat().st_size == 0
    np.testing.assert_array_equal(table.pull(np.arange(3, dtype=np.int64)),
                                  SparseTable(TableConfig("emb", DIM)).pull(np.arange(3, dtype=np.int64)))


def test_a_full_disk_keeps_the_rows_in_ram_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plain, tiered = pair(tmp_path, 10)
    ids = np.arange(20_000, dtype=np.int64)
    grads = np.ones((20_000, DIM), np.float32)
    plain.push(ids, grads)
    tiered.push(ids, grads)  # in RAM: the request's own rows are never spilled
    # A file size limit stands in for a full disk: the slab's growth to 20,000 records (640 KB) is refused.
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not the signal's default kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, limits[1]))
    try:
        with caplog.at_level(logging.WARNING, "pshard.ps"):
            for _ in range(3):  # applied, not refused: a refusal would have the client apply it twice
                assert tiered.push(ids[:1], grads[:1]) == plain.push(ids[:1], grads[:1]) == 1
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    warnings = [r.getMessage() for r in caplog.records if "over its memory_mb" in r.getMessage()]
    assert len(warnings) == 1 and re.search(r"'emb' keeps 20000 rows .*emb\.rows: no room .*--table-dir",
                                            warnings[0])
    assert len(tiered) == 20_000 and tiered.disk is not None and len(tiered.disk) == 0
    np.testing.assert_array_equal(tiered.pull(ids), plain.pull(ids))
    tiered.push(ids[:1], grads[:1])  # with room again, the spill goes through
    plain.push(ids[:1], grads[:1])
    assert len(tiered.disk) > 19_000
    np.testing.assert_array_equal(tiered.pull(ids), plain.pull(ids))


def test_a_slab_outgrowing_its_first_size_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disktier, "_FIRST_SLAB_ROWS", 16)
    plain, tiered = pair(tmp_path, 10)
    for start in range(0, 3000, 500):  # the slab doubles from 16 records past 2,500
        ids = np.arange(start, start + 500, dtype=np.int64)
        plain.push(ids, np.ones((500, DIM), np.float32))
        tiered.push(ids, np.ones((500, DIM), np.float32))
    assert tiered.disk is not None and len(tiered.disk) >= 2500
    ids = np.arange(3000, dtype=np.int64)
    np.testing.assert_array_equal(tiered.pull(ids), plain.pull(ids))


def test_a_grown_slab_keeps_its_pages_mapped(tmp_path: Path) -> None:
    # A fresh map at each growth faulted every page again at its first write: the spills after a growth
    # cost several times their usual CPU (bench.disk_tier). Grown in place, a rewrite of the old records
    # after a growth takes no page fault.
    layout = disktier.RecordLayout.of(SparseTable(TableConfig("emb", 64)).columns())  # 256-byte records
    tier = disktier.DiskTier(tmp_path / "emb.rows", layout)
    n = disktier._FIRST_SLAB_ROWS  # the first slab, 256 pages: full, then doubled
    records = np.ones((n, layout.record_bytes), np.uint8)
    stamps, counts = np.zeros(n), np.zeros(n, np.int32)
    tier.put(np.arange(n, dtype=np.int64), records, stamps, counts)
    tier.put(np.arange(n, 2 * n, dtype=np.int64), records, stamps, counts)  # grows the slab

    def rewrite(old: np.ndarray, new: np.ndarray) -> int:
        """Page faults of a spill of `new` into the slots of `old`, freed for it."""
        tier.drop(tier.slots(old))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tier.put(new, records, stamps, counts)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # The records written since the growth, then those written before it: the same faults (the request's
    # own temporaries), not 256 more.
    control = rewrite(np.arange(n, 2 * n, dtype=np.int64), np.arange(2 * n, 3 * n, dtype=np.int64))
    faults = rewrite(np.arange(n, dtype=np.int64), np.arange(3 * n, 4 * n, dtype=np.int64))
    pages = n * layout.record_bytes // 4096
    assert faults < control + pages // 4, f"{faults} page faults rewriting {pages} mapped pages ({control} " \
                                          "rewriting those written since the growth)"
    assert len(tier) == 2 * n
    np.testing.assert_array_equal(tier.read(tier.slots(np.arange(3 * n, 4 * n, dtype=np.int64)))["values"]
                                  .view(np.uint8).reshape(n, -1), records)


def test_tier_metrics_count_rows_bytes_spills_and_fetches(tmp_path: Path) -> None:
    handlers = TableHandlers(ServerSettings(table_dir=str(tmp_path)))
    config = TableConfig("emb", 4, optimizer="adagrad",
                         memory_mb=budget(TableConfig("emb", 4, optimizer="adagrad"), 50))

    async def scenario() -> None:
        await handlers.declare(config)
        table = handlers._tables["emb"]
        table.push(np.arange(200, dtype=np.int64), np.ones((200, 4), np.float32))
        table.push(np.arange(100, dtype=np.int64), np.ones((100, 4), np.float32))
        table.pull(np.arange(150, 200, dtype=np.int64))
    asyncio.run(scenario())

    stats = handlers.stats("emb")
    record = 4 * 4 * 2  # values and adagrad's sums, float32
    assert stats.rows == 200
    assert stats.ram_bytes == stats.ram_rows * (record + 12) and stats.disk_bytes == stats.disk_rows * record
    # The second push spilled 100..199, the pull fetched 150..199 back and spilled 0..99.
    assert (stats.ram_rows, stats.disk_rows, stats.spilled, stats.fetched) == (50, 150, 200, 50)
    assert [p.name for p in tmp_path.glob("server-0/emb-*.rows")] != []
    # A second server of the host shares the directory: it takes its own part of it.
    other = TableHandlers(ServerSettings(table_dir=str(tmp_path)))
    asyncio.run(other.declare(config))
    assert [p.name for p in tmp_path.glob("server-1/emb-*.rows")] != []
    assert handlers._tables["emb"].pull(np.arange(200, dtype=np.int64)).any()  # its rows untouched
    plain = TableHandlers(ServerSettings())
    asyncio.run(plain.declare(TableConfig("emb", 4)))
    assert (plain.stats("emb").disk_rows, plain.stats("emb").spilled) == (0, 0)


def test_a_restarted_server_finds_its_part_of_the_table_dir_wiped(tmp_path: Path) -> None:
    stale = tmp_path / "server-0" / "gone-0.rows"
    stale.mkdir(parents=True)  # a table of a server that crashed
    handlers = TableHandlers(ServerSettings(table_dir=str(tmp_path)))
    assert not stale.exists() and handlers._table_dir == tmp_path / "server-0"


def test_memory_mb_without_a_table_dir_is_refused_naming_both() -> None:
    handlers = TableHandlers(ServerSettings())
    with pytest.raises(InvalidArgumentError, match=r"'emb': memory_mb 2 needs .*--table-dir"):
        asyncio.run(handlers.declare(TableConfig("emb", 4, memory_mb=2.0)))
    assert handlers.all_stats() == {}


def test_memory_mb_is_checked_and_crosses_the_wire() -> None:
    config = TableConfig("emb", 4, memory_mb=1.5)
    assert spec_from_proto(spec_to_proto(config)) == config
    assert spec_from_proto(spec_to_proto(TableConfig("emb", 4))).memory_mb == 0.0
    with pytest.raises(InvalidArgumentError, match=r"'emb': memory_mb: got -1.0"):
        TableConfig("emb", 4, memory_mb=-1.0)


def test_a_missing_or_unwritable_table_dir_is_named_at_start(tmp_path: Path) -> None:
    def settings_of(path: Path) -> ServerSettings:
        return ps_main._settings(ps_main.build_parser().parse_args(["--table-dir", str(path)]))

    with pytest.raises(ClusterConfigError, match=r"--table-dir: '.*nowhere' is not a directory"):
        settings_of(tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    with pytest.raises(ClusterConfigError, match=r"--table-dir: '.*file' is not a directory"):
        settings_of(tmp_path / "file")
    with pytest.raises(ClusterConfigError, match=r"--table-dir: '/proc' is not writable"):
        settings_of(Path("/proc"))  # refused even to root
    assert settings_of(tmp_path).table_dir == str(tmp_path)
    assert "--table-dir" in ps_main.build_parser().format_help()


def test_servers_sharing_a_table_dir_check_it_at_once(tmp_path: Path) -> None:
    """Servers of one host may share a --table-dir and start together: each one's write probe must not
    trip over another's (a shared probe name failed a server start as "not writable")."""
    start = threading.Barrier(4)
    failures: list[BaseException] = []

    def check() -> None:
        start.wait(timeout=10)
        try:
            for _ in range(300):
                ps_main._check_table_dir(str(tmp_path))
        except ClusterConfigError as err:
            failures.append(err)

    threads = [threading.Thread(target=check) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert list(tmp_path.iterdir()) == []  # no probe left behind


def test_replication_captures_and_copies_spilled_rows_whole(tmp_path: Path) -> None:
    plain, tiered = pair(tmp_path, 30, optimizer="lazy_adam")
    drive((plain, tiered), zipf_stream(9, 10, batch=64), seed=10)
    assert tiered.disk is not None and len(tiered.disk) > 50
    ids = np.sort(table_rows.all_ids(tiered))
    np.testing.assert_array_equal(ids, np.sort(table_rows.all_ids(plain)))
    before = tiered.tiers()
    got, want = table_rows.capture(tiered, ids), table_rows.capture(plain, ids)
    assert tiered.tiers() == before  # read where they are: a capture moves no row
    assert len(got.deleted) == 0
    mine, theirs = np.argsort(got.ids), np.argsort(want.ids)
    np.testing.assert_array_equal(got.ids[mine], want.ids[theirs])
    for name, column in want.columns.items():
        np.testing.assert_array_equal(got.columns[name][mine], column[theirs])
    # A backup installs the batch: its table, all in RAM, holds the primary's rows whichever their tier.
    backup = SparseTable(plain.config)
    table_rows.install(backup, got)
    np.testing.assert_array_equal(backup.pull(ids, clock=50), plain.pull(ids, clock=50))
