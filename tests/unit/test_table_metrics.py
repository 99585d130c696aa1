"""What the per-table metrics count: a table's admissions (rows requests created, not restored ones)
and the families the server's /metrics shows for them."""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from pshard.common.metrics import new_registry, table_families
from pshard.common.sparse import TableConfig
from pshard.ps_server.handlers.tables import TableStats
from pshard.ps_server.tables.table import SparseTable


def test_admissions_count_rows_created_by_pushes_not_pulls_or_restores() -> None:
    plain = SparseTable(TableConfig("plain", 2))
    plain.pull(np.arange(5, dtype=np.int64))  # reads create nothing
    assert (len(plain), plain.admitted) == (0, 0)
    plain.push(np.arange(5, dtype=np.int64), np.zeros((5, 2), np.float32))
    plain.push(np.arange(3, 8, dtype=np.int64), np.zeros((5, 2), np.float32))  # 3 new, 2 already rows
    assert (len(plain), plain.admitted) == (8, 8)

    filtered = SparseTable(TableConfig("filtered", 2, admit_after=2, max_rows=3))
    ones = np.ones((3, 2), np.float32)
    filtered.push(np.arange(3, dtype=np.int64), ones)  # first sightings only
    assert filtered.admitted == 0
    filtered.push(np.arange(3, dtype=np.int64), ones)
    assert (len(filtered), filtered.admitted, filtered.evicted) == (3, 3, 0)
    for _ in range(2):  # a fourth row, over the cap: one of the others goes
        filtered.push(np.array([3], np.int64), ones[:1])
    assert (len(filtered), filtered.admitted, filtered.evicted) == (3, 4, 1)

    restored = SparseTable(TableConfig("plain", 2))
    ids = np.arange(8, dtype=np.int64)
    restored.restore_rows(ids, {"values": np.ones((8, 2), np.float32)})
    assert (len(restored), restored.admitted) == (8, 0)


class _Tables(Collector):
    def __init__(self, tables: dict[str, TableStats]) -> None:
        self.tables = tables

    def collect(self):  # type: ignore[no-untyped-def]
        return table_families(self.tables)


def test_each_table_is_one_label_of_the_rows_admissions_and_evictions_families() -> None:
    registry = new_registry()
    registry.register(_Tables({"emb": TableStats(rows=5, evicted=2, steps=9, admitted=7, admission_bytes=4096,
                                                 admission_halvings=3, row_bytes=72),
                               "ids": TableStats(rows=1, evicted=0, steps=1, admitted=1)}))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}

    assert families["pshard_table_rows"].type == "gauge"
    assert families["pshard_table_admissions"].type == "counter"
    assert families["pshard_table_evictions"].type == "counter"
    got = {(s.name, s.labels["table"]): s.value for f in families.values() for s in f.samples
           if not s.name.endswith("_created") and "tier" not in s.labels}
    assert got == {
        ("pshard_table_rows", "emb"): 5, ("pshard_table_rows", "ids"): 1,
        ("pshard_table_admissions_total", "emb"): 7, ("pshard_table_admissions_total", "ids"): 1,
        ("pshard_table_evictions_total", "emb"): 2, ("pshard_table_evictions_total", "ids"): 0,
        ("pshard_table_admission_bytes", "emb"): 4096, ("pshard_table_admission_bytes", "ids"): 0,
        ("pshard_table_admission_halvings_total", "emb"): 3,
        ("pshard_table_admission_halvings_total", "ids"): 0,
        ("pshard_table_row_bytes", "emb"): 72, ("pshard_table_row_bytes", "ids"): 0,
        ("pshard_table_spilled_rows_total", "emb"): 0, ("pshard_table_spilled_rows_total", "ids"): 0,
        ("pshard_table_fetched_rows_total", "emb"): 0, ("pshard_table_fetched_rows_total", "ids"): 0,
    }
