"""Admission in bounded memory (issue 22): RSS growth of a table that sees 20 M ids once each.

A fresh process declares a table with `admit_after=2, max_rows=100_000` (dim 16, SGD) and pushes
20,000,000 distinct ids once each, 65,536 per push: none should become a row (but the few the
count-min sketch admits early, ps_server/tables/admission.py), and the admission counts should
stay within `admit_memory_mb`. Figures: RSS growth, rows made (early admissions), ids/s.

Same-run baseline: a second fresh process counts the same stream in an exact record, an IdIndex
(ps_server/tables/rowhash.py) and an int32 count per id, which is what the table kept before (+415 MiB
for 20 M ids when issue 22 was filed). The ratio is the exact record's growth over the sketch's.

    python -m bench.admission [--ids 20000000] [--admit-memory-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import REPO, emit, rss_mb

BATCH = 1 << 16


def _child(kind: str, ids: int, memory_mb: float) -> None:
    """Runs in a fresh process: count `ids` once-seen ids (`kind`: sketch or exact), print JSON."""
    import numpy as np
    from pshard.common.sparse import TableConfig
    from pshard.ps_server.tables import kernels
    from pshard.ps_server.tables.rowhash import IdIndex
    from pshard.ps_server.tables.table import SparseTable

    kernels.warm(np.dtype(np.float32))
    grads = np.ones((BATCH, 16), np.float32)
    key = np.uint64(0x9E3779B97F4A7C15)
    before = rss_mb(os.getpid())
    start = time.monotonic()
    rows = 0
    if kind == "sketch":
        config = TableConfig("ids", 16, admit_after=2, max_rows=100_000, admit_memory_mb=memory_mb)
        table = SparseTable(config)
        for first in range(0, ids, BATCH):
            # Distinct, scattered ids: a multiplicative hash of a counter (odd key: a bijection).
            chunk = (np.arange(first, min(first + BATCH, ids), dtype=np.uint64) * key).view(np.int64)
            table.push(chunk, grads[: len(chunk)])
        rows = len(table)
    else:
        seen = IdIndex()
        count = np.zeros(seen.row_capacity, np.int32)
        for first in range(0, ids, BATCH):
            chunk = (np.arange(first, min(first + BATCH, ids), dtype=np.uint64) * key).view(np.int64)
            slot = seen.insert(chunk)
            if len(count) < seen.row_capacity:
                grown = np.zeros(seen.row_capacity, np.int32)
                grown[: len(count)] = count
                count = grown
            count[slot] += 1
    elapsed = time.monotonic() - start
    print(json.dumps({"rss_growth_mb": round(rss_mb(os.getpid()) - before, 1), "rows": rows,
                      "ids_per_s": round(ids / elapsed)}))


def _run_child(kind: str, ids: int, memory_mb: float) -> dict[str, object]:
    command = [sys.executable, "-m", "bench.admission", "--child", kind, "--ids", str(ids),
               "--admit-memory-mb", str(memory_mb)]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, timeout=1200)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def admission_memory(ids: int = 20_000_000, memory_mb: float = 4.0) -> dict[str, object]:
    sketch = _run_child("sketch", ids, memory_mb)
    exact = _run_child("exact", ids, memory_mb)
    grown, exact_grown = float(sketch["rss_growth_mb"]), float(exact["rss_growth_mb"])  # type: ignore[arg-type]
    return {"ids": ids, "admit_after": 2, "max_rows": 100_000, "admit_memory_mb": memory_mb,
            "rss_growth_mb": grown, "rows_admitted_early": sketch["rows"], "ids_per_s": sketch["ids_per_s"],
            "exact_rss_growth_mb": exact_grown, "exact_ids_per_s": exact["ids_per_s"],
            "ratio_exact_to_sketch": round(exact_grown / max(grown, 0.1), 1), "bar_rss_growth_mb": 16.8}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ids", type=int, default=20_000_000, help="once-seen ids pushed (default 20,000,000)")
    p.add_argument("--admit-memory-mb", type=float, default=4.0,
                   help="the table's admit_memory_mb (default 4)")
    p.add_argument("--child", choices=("sketch", "exact"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        _child(args.child, args.ids, args.admit_memory_mb)
        return 0
    emit("admission_memory", **admission_memory(args.ids, args.admit_memory_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
