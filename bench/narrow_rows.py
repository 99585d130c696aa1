"""8- and 16-bit rows (issue 22): RSS per row and rows/s of a table by row_dtype, in one run.

For each row_dtype (float32 first: the same-run baseline) a fresh process makes a table (SGD) of `--rows`
rows by pushing distinct ids, 65,536 per push, and reports its RSS growth per row two ways: the whole
growth over the rows (`rss_bytes_per_row`, what the table costs, fixed parts included), and the slope
between the table at half its rows and at all of them (`rss_slope_bytes_per_row`, what one more row
costs: the fixed parts, the same at both sizes, cancel). The fixed parts are the index's memory of its
last four lookups (4 MB at 65,536 ids a push) and the heap's odds and ends. RSS is read after the
heap's free pages go back (malloc_trim, what a server's ps_server.heap.HeapTrimmer does once a burst
of large requests ends). It then times pulls and pushes of 2,048 random existing ids (rows/s; pushes
best of 3, and for narrow rows also through the numpy path that the compiled pass replaced,
push_rows_per_s_numpy_path, alternating with it).

A row's RSS is its values as stored (4 x dim float32, 2 x dim float16/bfloat16, dim + 4 int8: a float16
scale and offset) plus what every row keeps whatever its dtype: its id (8 bytes), update count (4) and
the index's slots (4 to 10; a slope taken across one of the index's doublings counts that doubling), so
the ratio to float32 grows with dim (the last touch, 8, is kept only with ttl, max_rows or memory_mb,
and the change stamp, 4, from a table's first checkpoint on: this bench's table has neither); `fields`
gives each array's bytes over the rows (capacity included: the arrays grow by doubling).

The child sets glibc's malloc as `pshard ps` does at start (ps_server.heap.bound_heap: buffers of 1 MiB
and more are mappings of their own, given back when freed), so the RSS is what a server holds: with
glibc's defaults the pushes' freed temporaries stay in the heap, 40 to 60 bytes a row of this bench.

    python -m bench.narrow_rows [--rows 1000000] [--dim 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import REPO, emit, rss_mb

BATCH = 1 << 16
REQUEST = 2048
ROUNDS = 3
ROW_DTYPES = ("float32", "float16", "bfloat16", "int8")


def _child(row_dtype: str, rows: int, dim: int) -> None:
    """Runs in a fresh process: fill a table of `row_dtype`, print JSON."""
    from pshard.ps_server.heap import bound_heap

    bound_heap()  # before any allocation, as the server's main does
    import numpy as np
    from pshard.common.sparse import TableConfig
    from pshard.ps_server.tables.table import SparseTable

    table = SparseTable(TableConfig("emb", dim, row_dtype=row_dtype))  # warms the kernels
    grads = np.full((BATCH, dim), 0.01, np.float32)
    before = _settled_rss_mb()
    half = max(BATCH, rows // 2 // BATCH * BATCH)  # a push's worth of rows: the slope's first point
    at_half = before
    for first in range(0, rows, BATCH):
        chunk = np.arange(first, min(first + BATCH, rows), dtype=np.int64)
        table.push(chunk, grads[: len(chunk)])
        if first + len(chunk) == half:
            at_half = _settled_rss_mb()
    grown = _settled_rss_mb() - before
    slope = (before + grown - at_half) * 2**20 / (rows - half) if rows > half else 0.0
    rng = np.random.default_rng(0)
    requests = [np.sort(rng.choice(rows, REQUEST, replace=False)).astype(np.int64) for _ in range(50)]
    small = grads[:REQUEST]
    start = time.monotonic()
    for ids in requests:
        table.pull(ids)
    pull_s = time.monotonic() - start
    push_s, numpy_s = _time_pushes(table, requests, small)
    moved = REQUEST * len(requests)
    arrays = {"values": table.values, "touch": table.touch, "count": table.count, "stamp": table.stamp,
              "index_ids": table.index.ids, **{f"state_{name}": a for name, a in table.state.items()}}
    # A field the table does not keep is a sink of one element (ps_server.tables.table._sink): 0 bytes.
    fields = {name: round((a.nbytes if a.strides[0] else a.itemsize) / rows, 1) for name, a in arrays.items()}
    fields["index_slots"] = round(table.index.slot_bytes / rows, 1)
    print(json.dumps({"rss_bytes_per_row": round(grown * 2**20 / rows, 1),
                      "rss_slope_bytes_per_row": round(slope, 1), "slope_from_rows": half,
                      "stored_bytes_per_row": table.config.row_bytes, "fields": fields,
                      "pull_rows_per_s": round(moved / pull_s), "push_rows_per_s": round(moved / push_s),
                      **({"push_rows_per_s_numpy_path": round(moved / numpy_s)} if numpy_s else {})}))


def _settled_rss_mb() -> float:
    """RSS (MiB) once glibc's free pages went back to the kernel (malloc_trim, as a server does after a
    burst of large requests: ps_server.heap.HeapTrimmer); as it is where there is no glibc."""
    from pshard.common.malloc import libc

    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
    return rss_mb(os.getpid())


def _time_pushes(table: Any, requests: list[Any], grads: Any) -> tuple[float, float]:
    """Seconds for the pushes of `requests`, best of ROUNDS, and for narrow rows the same pushes through
    the numpy path the compiled pass replaced (SparseTable._push_gathered), rounds alternating so that the
    shared machine's load weighs on both alike (0.0 for float32, which has no such path)."""
    best, numpy_best = float("inf"), float("inf")
    for _ in range(ROUNDS):
        start = time.monotonic()
        for ids in requests:
            table.push(ids, grads)
        best = min(best, time.monotonic() - start)
        if not table.config.narrow:
            continue
        start = time.monotonic()
        for ids in requests:  # what push does around its update: the lookup, the step, the update
            rows = table.index.lookup(ids)
            table.step += 1
            table._push_gathered(rows, grads, time.monotonic())
        numpy_best = min(numpy_best, time.monotonic() - start)
    return best, numpy_best if table.config.narrow else 0.0


def _run_child(row_dtype: str, rows: int, dim: int) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.narrow_rows", "--child", row_dtype, "--rows", str(rows),
               "--dim", str(dim)]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, timeout=1200)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def narrow_rows(rows: int = 1_000_000, dim: int = 64) -> dict[str, object]:
    results = {rd: _run_child(rd, rows, dim) for rd in ROW_DTYPES}
    base = results["float32"]
    out: dict[str, object] = {"rows": rows, "dim": dim}
    for rd, r in results.items():
        out[rd] = {**r, **{f"{key}_ratio_float32_to_this": round(base[f"{key}_bytes_per_row"]
                                                                  / max(r[f"{key}_bytes_per_row"], 0.1), 2)
                           for key in ("rss", "rss_slope")}}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.narrow_rows", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows in each table (default 1,000,000)")
    p.add_argument("--dim", type=int, default=64, help="numbers per row (default 64)")
    p.add_argument("--child", choices=ROW_DTYPES, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        _child(args.child, args.rows, args.dim)
        return 0
    emit("narrow_rows", **narrow_rows(args.rows, args.dim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
