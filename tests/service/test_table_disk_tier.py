"""A parameter server process with --table-dir: a table with memory_mb a tenth of its rows serves them
as a table all in RAM on the same server does, bit for bit, its /metrics show the rows and bytes of each
tier and the rows moved, and a --table-dir that does not exist stops the server at start, named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common.sparse import TableConfig

from tests.e2e.harness import Procs
from tests.service.test_metrics_endpoints import metrics_port, scrape, value

from .conftest import WAIT_S

ROWS, DIM = 3000, 16


def test_a_table_a_tenth_in_ram_serves_what_the_table_in_ram_serves(procs: Procs, tmp_path: Path) -> None:
    """Two servers: one holds the table with memory_mb, the other the same table all in RAM."""
    tiered_ps = procs.python("ps-tiered", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--metrics-port",
                             "0", "--table-dir", str(tmp_path))
    plain_ps = procs.python("ps-plain", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0")
    addresses = ["127.0.0.1:" + ps.wait_for_line(r"pshard ps: listening on port (\d+)", 60).group(1)
                 for ps in (tiered_ps, plain_ps)]
    port = metrics_port(tiered_ps)
    row_bytes = 2 * 4 * DIM + 27  # values and adagrad's sums, float32, and 27 bytes of stamps and index
    plain = TableConfig("emb", DIM, optimizer="adagrad")
    tiered = dataclasses.replace(plain, memory_mb=ROWS / 10 * row_bytes / 2**20)
    rng = np.random.default_rng(0)
    every = np.arange(ROWS, dtype=np.int64)
    with (PSClient(addresses[:1], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S) as tiered_client,
          PSClient(addresses[1:], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S) as plain_client):
        tiered_client.declare_table(tiered)
        plain_client.declare_table(plain)
        for clock in range(30):
            ids = np.unique(rng.zipf(1.2, 400) % ROWS).astype(np.int64)
            grads = rng.normal(size=(len(ids), DIM)).astype(np.float32)
            for client in (tiered_client, plain_client):
                client.push_rows("emb", ids, grads, clock=clock)
        for chunk in np.array_split(every, 20):  # a request's own rows stay in RAM while it runs
            np.testing.assert_array_equal(tiered_client.pull_rows("emb", chunk, clock=30),
                                          plain_client.pull_rows("emb", chunk, clock=30))
        rows = sum(s.rows for s in plain_client.tables.stats("emb"))
    samples = scrape(port)
    ram = value(samples, "pshard_table_tier_rows", table="emb", tier="ram")
    disk = value(samples, "pshard_table_tier_rows", table="emb", tier="disk")
    assert ram is not None and disk is not None and value(samples, "pshard_table_rows", table="emb") == \
        ram + disk == rows
    assert 0 < ram <= ROWS / 10 + 1 and disk > rows / 2
    assert value(samples, "pshard_table_tier_bytes", table="emb", tier="disk") == disk * 2 * 4 * DIM
    assert (value(samples, "pshard_table_spilled_rows_total", table="emb") or 0) >= disk
    assert (value(samples, "pshard_table_fetched_rows_total", table="emb") or 0) > 0
    assert list(tmp_path.glob("server-0/emb-*.rows/rows.slab")) != []


def test_a_missing_table_dir_stops_the_server_naming_it(procs: Procs, tmp_path: Path) -> None:
    ps = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0",
                      "--table-dir", str(tmp_path / "nowhere"))
    assert ps.wait(60) != 0
    assert "--table-dir" in ps.output() and "nowhere" in ps.output() and "is not a directory" in ps.output()
