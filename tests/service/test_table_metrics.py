"""/metrics of a live parameter server process holding sparse tables: rows, admissions and evictions
per table, and the checkpoint age, read with prometheus_client's parser between pushes and pulls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig

from tests.e2e.harness import Procs
from tests.service.test_metrics_endpoints import metrics_port, scrape, value

from .conftest import WAIT_S


def table_values(port: int, table: str) -> tuple[float | None, float | None, float | None]:
    """(rows, admissions, evictions) of `table` as the server's /metrics shows them."""
    samples = scrape(port)
    return (value(samples, "pshard_table_rows", table=table),
            value(samples, "pshard_table_admissions_total", table=table),
            value(samples, "pshard_table_evictions_total", table=table))


def test_table_rows_admissions_and_evictions_move_with_pushes_and_pulls(procs: Procs, tmp_path: Path) -> None:
    ps = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--metrics-port", "0",
                      "--checkpoint-dir", str(tmp_path / "ckpt"))
    address = "127.0.0.1:" + ps.wait_for_line(r"pshard ps: listening on port (\d+)", 60).group(1)
    port = metrics_port(ps)
    assert table_values(port, "emb") == (None, None, None)  # no table declared yet

    grad = np.ones((40, 4), np.float32)
    first, second = np.arange(40, dtype=np.int64), np.arange(40, 80, dtype=np.int64)
    with PSClient([address], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S) as client:
        # An id becomes a row at its second sighting; at most 50 rows, the least recently touched go.
        client.declare_table(TableConfig("emb", 4, lr=1.0, admit_after=2, max_rows=50, admit_memory_mb=0.5))
        client.declare_table(TableConfig("other", 2))
        assert table_values(port, "emb") == (0, 0, 0)
        # The admission counts' fixed size, as declared (none without admit_after).
        samples = scrape(port)
        assert value(samples, "pshard_table_admission_bytes", table="emb") == 1 << 19
        assert value(samples, "pshard_table_admission_bytes", table="other") == 0

        assert client.push_rows("emb", first, grad, clock=0) == 0  # first sightings: only counted
        assert table_values(port, "emb") == (0, 0, 0)
        assert client.push_rows("emb", first, grad, clock=1) == 40
        assert table_values(port, "emb") == (40, 40, 0)

        client.pull_rows("emb", first[:10], clock=2)  # pulls of rows: no admission, no eviction
        client.push_rows("emb", second, grad, clock=2)
        assert table_values(port, "emb") == (40, 40, 0)  # new ids seen once
        client.push_rows("emb", second, grad, clock=3)
        assert table_values(port, "emb") == (50, 80, 30)

        client.pull_rows("other", np.arange(7, dtype=np.int64))  # reads create nothing
        assert table_values(port, "other") == (0, 0, 0)
        client.push_rows("other", np.arange(7, dtype=np.int64), np.ones((7, 2), np.float32), clock=0)
        assert table_values(port, "other") == (7, 7, 0)  # no admission filter: pushes create rows
        assert table_values(port, "emb") == (50, 80, 30)

        # The checkpoint age appears with the server's first checkpoint: here of its tables alone, which
        # a server without dense parameters writes (and then of the dense shard too).
        assert value(scrape(port), "pshard_ps_checkpoint_age_seconds") is None
        client.tables.checkpoint()
        age = value(scrape(port), "pshard_ps_checkpoint_age_seconds")
        assert age is not None and 0 <= age < 60
        client.declare({"w": np.zeros(3, np.float32)}, JobConfig(mode="async"))
        client.push_pull({"w": np.ones(3, np.float32)}, 0)
        client.checkpoint()
    assert (tmp_path / "ckpt" / "shard.json").exists()
    age = value(scrape(port), "pshard_ps_checkpoint_age_seconds")
    assert age is not None and 0 <= age < 60
