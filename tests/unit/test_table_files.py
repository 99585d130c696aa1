"""Sparse tables on disk and the handlers' limits: checkpoints and exports stream chunks of live rows
(holes left by evictions included) and load back the same table; a server takes at most MAX_TABLES."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import QuotaExceededError
from pshard.common.sparse import TableConfig
from pshard.ps_server.handlers import tables as table_handlers
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables import table as table_module
from pshard.ps_server.tables.files import export_table, load_tables, save_tables
from pshard.ps_server.tables.table import SparseTable


def test_checkpoint_and_export_stream_live_rows_across_chunks_and_holes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_module, "CHUNK_ROWS", 7)  # many chunks, most with holes
    config = TableConfig("t", 3, optimizer="adam", max_rows=40, cap_policy="lfu")
    table = SparseTable(config)
    rng = np.random.default_rng(0)
    for clock in range(30):
        ids = rng.choice(100, 10, replace=False).astype(np.int64)
        table.push(ids, rng.normal(size=(10, 3)).astype(np.float32), clock=clock)
    assert table.evicted > 0 and len(table) <= 40
    live = table.index.live_rows()

    save_tables(tmp_path, "shard", [table])
    (loaded,) = load_tables(tmp_path, "shard", SparseTable)
    ids = table.index.ids[live]
    assert loaded.config == config and loaded.step == table.step and len(loaded) == len(table)
    np.testing.assert_array_equal(loaded.pull(ids, clock=30), table.pull(ids, clock=30))
    grads = np.ones((len(ids), 3), np.float32)
    loaded.push(ids, grads, clock=31)
    table.push(ids, grads, clock=31)  # same moments and step: the same update
    np.testing.assert_array_equal(loaded.pull(ids, clock=31), table.pull(ids, clock=31))
    assert save_tables(tmp_path, "shard", [table]).exists()
    assert len(list(tmp_path.glob("shard.tables-*"))) == 1  # the older checkpoint is gone

    ids_path, rows_path, n = export_table(table, tmp_path / "export")
    got_ids, got_rows = np.load(ids_path), np.load(rows_path)
    assert n == len(got_ids) == len(table) and len(np.unique(got_ids)) == n
    np.testing.assert_array_equal(got_rows, table.pull(got_ids, clock=31))


def test_a_server_takes_at_most_max_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_handlers, "MAX_TABLES", 3)
    handlers = TableHandlers(ServerSettings())

    async def declare_all() -> None:
        for i in range(3):
            assert await handlers.declare(TableConfig(f"t{i}", 2))
        assert not await handlers.declare(TableConfig("t0", 2))  # the same again is fine
        with pytest.raises(QuotaExceededError, match="table 't3'"):
            await handlers.declare(TableConfig("t3", 2))

    asyncio.run(declare_all())
