"""What a row costs besides its values (issue 22: int8 rows 3x smaller than float32 ones): the last touch
is kept only by tables that read it (ttl, max_rows, a disk tier), the change stamps only from a table's
first checkpoint capture on; tables without them behave as before (incremental captures, checkpoints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pshard.common.sparse import TableConfig
from pshard.ps_server.checkpoints.images import capture
from pshard.ps_server.tables.files import load_tables, save_tables
from pshard.ps_server.tables.table import SparseTable

DIM = 16


def _bytes_per_row(table: SparseTable) -> dict[str, float]:
    """Bytes of each per-row array over its capacity; 0 for a field the table does not keep (one element)."""
    arrays = {"values": table.values, "touch": table.touch, "count": table.count, "stamp": table.stamp}
    cap = len(table.values)
    return {name: (a.nbytes if a.strides[0] else 0) / cap for name, a in arrays.items()}


def _filled(config: TableConfig, rows: int = 300) -> SparseTable:
    table = SparseTable(config)
    ids = np.arange(rows, dtype=np.int64)
    table.push(ids, np.full((rows, DIM), 0.01, np.float32), clock=1)
    return table


@pytest.mark.parametrize(("extra", "touch"), [({}, 0), ({"ttl": 5.0}, 8), ({"max_rows": 10_000}, 8)])
def test_a_row_keeps_its_last_touch_only_where_the_table_reads_it(extra: dict[str, Any], touch: int) -> None:
    table = _filled(TableConfig("t", DIM, row_dtype="int8", **extra))
    assert _bytes_per_row(table) == {"values": DIM + 4, "touch": touch, "count": 4, "stamp": 0}
    assert ("touch" in table.columns()) == (touch > 0)
    capture(table, None)  # the first capture: stamps from now on
    assert _bytes_per_row(table)["stamp"] == 4


def test_a_ttl_still_evicts_by_the_last_touch() -> None:
    table = _filled(TableConfig("t", DIM, ttl=5.0))
    table.pull(np.arange(100, dtype=np.int64), clock=4)  # read: their touch moves
    table.push(np.array([1000], np.int64), np.zeros((1, DIM), np.float32), clock=8)
    assert len(table) == 101 and table.evicted == 200


def test_an_incremental_capture_after_the_first_holds_the_rows_written_or_read_since() -> None:
    table = _filled(TableConfig("t", DIM, row_dtype="int8"))
    full = capture(table, None)
    assert len(full.ids) == 300 and full.meta["since"] is None
    table.push(np.arange(10, 20, dtype=np.int64), np.ones((10, DIM), np.float32), clock=2)
    table.pull(np.arange(50, 55, dtype=np.int64), clock=2)
    table.pull(np.arange(1000, 1003, dtype=np.int64), clock=2)  # no rows: nothing changes
    changed = capture(table, full.meta)
    assert changed.meta["since"] == full.meta["epoch"]
    np.testing.assert_array_equal(np.sort(changed.ids), np.r_[10:20, 50:55])
    assert len(capture(table, changed.meta).ids) == 0  # nothing since


def test_a_checkpoint_of_a_table_that_keeps_no_touch_loads_back_and_ignores_an_older_touch_column(
        tmp_path: Path) -> None:
    table = _filled(TableConfig("t", DIM, row_dtype="int8", optimizer="adagrad"))
    pointer = save_tables(tmp_path, "shard", [table])
    (sub,) = [p for p in tmp_path.glob("shard.tables-*/t0")]
    assert not (sub / "touch.npy").exists() and pointer.exists()
    np.save(sub / "touch.npy", np.full(300, 7.0))  # what a checkpoint written before this change held
    (loaded,) = load_tables(tmp_path, "shard", SparseTable)
    ids = np.arange(300, dtype=np.int64)
    np.testing.assert_array_equal(loaded.pull(ids, clock=2), table.pull(ids, clock=2))
    np.testing.assert_array_equal(loaded.count[loaded.rows_of(ids)], table.count[table.rows_of(ids)])


def test_rows_sent_without_a_touch_to_a_table_that_keeps_one_count_as_touched_at_the_restore() -> None:
    """A primary that keeps no touch (or a checkpoint of one) installs into a table with a ttl: its rows
    are touched by the restore, at the table's clock, so they expire a ttl after it, not at once."""
    plain = _filled(TableConfig("t", DIM))
    expiring = SparseTable(TableConfig("t", DIM, ttl=5.0))
    expiring.clock = 7.0
    ids = np.arange(300, dtype=np.int64)
    rows = plain.rows_of(ids)
    expiring.restore_rows(ids, {name: a[rows] for name, (a, _) in plain.columns().items()})
    assert (expiring.touch[expiring.rows_of(ids)] == 7.0).all()
    np.testing.assert_array_equal(expiring.pull(ids, clock=11), plain.pull(ids, clock=11))
