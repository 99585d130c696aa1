"""Sparse tables: rows/s of pulls and pushes, and the memory overhead of the row store (issue 9).

rows/s: a 1,000,000 x 64 float32 table (SGD) on 2 parameter server processes, 2 worker processes,
async, over the fast-path sessions the dense steps use (`--transport`: auto is shared memory on one
host; tcp the raw TCP path; grpc the SparseTablesService). The table is filled
first (untimed); then each step a worker pulls 4,096 distinct random ids
and pushes one gradient for each: rows/s = steps x workers x 4,096 / seconds. The zipf variant
draws 4,096 ids from a Zipf(1.1) distribution over the table, with repeats (the client de-duplicates
and sums them; the rate still counts 4,096 per step). `--fused` sends the push of step t with the
pull of step t+1 in one round trip (push_pull_rows).

memory: RSS growth of a fresh process that fills a table of 10,000,000 rows of dim 16 (Adagrad),
over the bytes of its rows and optimizer state: the overhead of the hash index and per-row metadata.
The table's compiled loops are loaded before the first reading: numba's code and its compiler's
heap (about 50 MB of anonymous memory, the same for any table) are not the row store's overhead.

    python -m bench.sparse [--steps 200] [--fused] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import (
    REPO,
    CpuMeter,
    WorkerRun,
    cpu_figures,
    emit,
    rss_mb,
    run_workers,
    span_s,
    start_ps_servers,
    stop_processes,
)

ROWS, DIM, BATCH = 1_000_000, 64, 4096


def _batches(rng: object, steps: int, zipf: bool) -> list[object]:
    import numpy as np

    assert isinstance(rng, np.random.Generator)
    out: list[object] = []
    for _ in range(steps):
        if zipf:
            out.append(((rng.zipf(1.1, BATCH) - 1) % ROWS).astype(np.int64))
        else:
            ids = np.unique(rng.integers(0, ROWS, 2 * BATCH))
            out.append(rng.permutation(ids)[:BATCH].astype(np.int64))
    return out


def _sparse_worker(run: WorkerRun, addresses: list[str], steps: int, warmup: int, zipf: bool,
                   fused: bool, server_pids: list[int], transport: str) -> dict[str, float]:
    import numpy as np
    from pshard.client.ps_client import PSClient
    from pshard.common.sparse import TableConfig

    rng = np.random.default_rng(run.index)
    config = TableConfig("bench", DIM, optimizer="sgd", lr=0.01)
    batches = _batches(rng, warmup + steps, zipf)
    grads = rng.standard_normal((BATCH, DIM), dtype=np.float32)
    with PSClient(addresses, f"w{run.index}", transport=transport) as client:
        client.declare_table(config)
        if run.index == 0:  # fill the table, so that the timed steps find a table of 1M rows
            # By pushes of zero gradients: reads create no rows (issue 23), so a fill by pulls left the
            # table empty and timed the misses' initial values (0.3 M rows/s instead of 2 M) instead.
            for chunk in np.array_split(np.arange(ROWS, dtype=np.int64), 64):
                client.push_rows("bench", chunk, np.zeros((len(chunk), DIM), np.float32))
        run.sync()

        def step(i: int) -> None:
            ids = batches[i]
            if fused:
                if i == 0:
                    client.pull_rows("bench", ids, clock=i)
                nxt = batches[i + 1] if i + 1 < len(batches) else ids
                client.push_pull_rows("bench", ids, grads, nxt, clock=i)
            else:
                client.pull_rows("bench", ids, clock=i)
                client.push_rows("bench", ids, grads, clock=i)

        for i in range(warmup):
            step(i)
        run.sync()
        meter = CpuMeter(server_pids)
        meter.start()
        start = time.monotonic()
        for i in range(warmup, warmup + steps):
            step(i)
        end = time.monotonic()
        meter.stop()
        stats = client.tables.stats("bench")
        used = "shm" if transport == "auto" else transport
        if client.tables.transports != [used] * len(addresses):
            raise RuntimeError(f"sparse: asked for {transport}, the steps used {client.tables.transports}")
    return {"start": start, "end": end, "rows": sum(s.rows for s in stats), **meter.result()}


def throughput(steps: int = 200, warmup: int = 10, zipf: bool = False, fused: bool = False,
               servers: int = 2, workers: int = 2, profile_dir: str | None = None,
               transport: str = "auto") -> dict[str, object]:
    names = [f"w{i}" for i in range(workers)]
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    procs = start_ps_servers(servers, names, ["--transport", transport], profile_dir=profile_dir)
    try:
        pids = [p.proc.pid for p in procs]
        args = ([p.address for p in procs], steps, warmup, zipf, fused, pids, transport)
        results = run_workers(_sparse_worker, workers, args)
        server_rss = [round(rss_mb(p.proc.pid), 1) for p in procs]
    finally:
        stop_processes([p.proc for p in procs])
    elapsed = span_s(results)
    return {"variant": "zipf" if zipf else "uniform", "transport": transport, "fused": fused,
            "rows_per_s": round(steps * workers * BATCH / elapsed), "steps": steps, "workers": workers,
            "servers": servers, "table_rows": results[0]["rows"], "dim": DIM, "batch": BATCH,
            "server_rss_mb": server_rss, "bar_rows_per_s": 2_000_000, **cpu_figures(results, steps, elapsed)}


def _memory_child(rows: int, dim: int) -> None:
    """Runs in a fresh process: fill a table and print the RSS figures as JSON."""
    import numpy as np
    from pshard.common.sparse import TableConfig
    from pshard.ps_server.tables import kernels
    from pshard.ps_server.tables.table import SparseTable

    kernels.warm(np.dtype(np.float32))
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**62), 2**62, rows + rows // 50)
    ids = np.unique(ids)[:rows]
    rng.shuffle(ids)
    before = rss_mb(os.getpid())
    table = SparseTable(TableConfig("mem", dim, optimizer="adagrad", initializer="zeros"))
    start = time.monotonic()
    for chunk in np.array_split(ids, max(1, rows // 200_000)):
        table.push(chunk, np.ones((len(chunk), dim), np.float32))
    fill_s = time.monotonic() - start
    after = rss_mb(os.getpid())
    raw = rows * dim * 4 * 2 / 1e6  # values + adagrad's sum
    del ids
    grown = after - before
    print(json.dumps({"rows": len(table), "dim": dim, "optimizer": "adagrad", "raw_mb": round(raw, 1),
                      "rss_growth_mb": round(grown, 1), "overhead": round((grown - raw) / raw, 3),
                      "fill_rows_per_s": round(rows / fill_s), "bar_overhead": 0.3}))


def memory(rows: int = 10_000_000, dim: int = 16) -> dict[str, object]:
    command = [sys.executable, "-m", "bench.sparse", "--memory-child", str(rows), str(dim)]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, timeout=1200)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sparse", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--steps", type=int, default=200, help="timed steps per worker (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--fused", action="store_true", help="push step t and pull step t+1 in one round trip")
    p.add_argument("--skip-memory", action="store_true", help="only the rows/s figures")
    p.add_argument("--only", choices=("uniform", "zipf"), help="one variant of the rows/s figure")
    p.add_argument("--profile", metavar="DIR", help="write cProfile stats of the servers to DIR")
    p.add_argument("--transport", choices=("auto", "shm", "tcp", "grpc"), default="auto",
                   help="how table requests travel: the fast-path session (auto: shm on one host, the "
                   "default; shm; tcp) or gRPC")
    p.add_argument("--memory-child", nargs=2, type=int, metavar=("ROWS", "DIM"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child:
        _memory_child(*args.memory_child)
        return 0
    for zipf in (False, True):
        if args.only in (None, "zipf" if zipf else "uniform"):
            figure = throughput(args.steps, args.warmup, zipf, args.fused, profile_dir=args.profile,
                                transport=args.transport)
            emit("sparse_rows", **figure)
    if not args.skip_memory:
        emit("sparse_memory", **memory())
    return 0


if __name__ == "__main__":
    sys.exit(main())
