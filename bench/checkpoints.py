"""Global checkpoints that do not stop training and do not rewrite what did not change (issue 22).

One parameter server process (`--global-checkpoint-dir`), this process as its one worker (sync, SGD):
`--dense` float32 parameters (default 25 M, one tensor) and a table of `--rows` rows (default 10 M, dim
`--dim` 8, SGD), filled first (untimed). A step is one dense push_pull and one table pull + push of
4,096 random ids, the rows a recommendation model's step touches.

- stall: the mean step time while the server writes a full checkpoint in the background
  (save_in_background: from its call until its manifest is committed, the capture's pause included),
  over the mean step time of the steps just before and after it; the same with medians (the capture's
  pause left out: a step another job on the host slowed moves a mean more than the write does); and
  the server's CPU per step (every thread: the writer's share of a shared host) around and during the
  write. The blocking checkpoint's time (the server captures and writes before answering) is given for
  comparison.
- incremental size: after pushes to 1 % of the rows (the dense parameters untouched), the bytes of an
  incremental checkpoint over that full one, over the full one's bytes; and the table's bytes alone.

    python -m bench.checkpoints [--dense 25000000] [--rows 10000000] [--steps 15]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common import checkpoint_store as ckpt
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig
from pshard.worker import checkpoint_coordinator as checkpoints

from bench.common import emit, rss_mb, start_ps_servers, stop_processes

BATCH = 4096
FILL = 1 << 19  # rows per filling push
SLICE_BYTES = 4 << 20


def _step(client: PSClient, grads: dict[str, np.ndarray], clock: int, rng: np.random.Generator,
          rows: int, dim: int) -> float:
    started = time.perf_counter()
    client.push_pull(grads, clock)
    ids = np.unique(rng.integers(0, rows, BATCH)).astype(np.int64)
    client.pull_rows("emb", ids, clock)
    client.push_rows("emb", ids, np.full((len(ids), dim), 1e-3, np.float32), clock)
    return time.perf_counter() - started


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) process `pid` used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bytes(checkpoint: ckpt.Checkpoint, tables_only: bool = False) -> int:
    return sum(f.size for f in checkpoint.files if not tables_only or ".tables" in f.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dense", type=int, default=25_000_000, help="dense float32 parameters")
    p.add_argument("--rows", type=int, default=10_000_000, help="table rows")
    p.add_argument("--dim", type=int, default=8, help="table row width")
    p.add_argument("--steps", type=int, default=15, help="steps timed before and after the checkpoint")
    p.add_argument("--dir", help="checkpoint root (default: a temporary directory, removed after)")
    p.add_argument("--write-mb-s", type=float, default=32.0,
                   help="the server's --checkpoint-write-mb-s (0: unpaced)")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="pshard-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    servers = start_ps_servers(1, ["w0"], ["--global-checkpoint-dir", str(root),
                                           "--checkpoint-write-mb-s", str(args.write_mb_s)])
    try:
        _run(args, root, servers[0].address, servers[0].proc.pid)
    finally:
        stop_processes([s.proc for s in servers])
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path, address: str, pid: int) -> None:
    params = {"dense": np.zeros(args.dense, np.float32)}
    layout = plan_layout([ParamSpec("dense", "float32", (args.dense,))], [address], SLICE_BYTES)
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1e-3), job_id="bench-ckpt")
    rng = np.random.default_rng(0)
    with PSClient([address], "w0", layout=layout, timeout_s=600) as client:
        client.declare(params, job)
        client.declare_table(TableConfig("emb", args.dim, optimizer="sgd", lr=0.01, seed=1))
        for start in range(0, args.rows, FILL):  # fill: zero gradients create the rows
            ids = np.arange(start, min(start + FILL, args.rows), dtype=np.int64)
            client.push_rows("emb", ids, np.zeros((len(ids), args.dim), np.float32), 0)
        grads = {"dense": np.full(args.dense, 1e-6, np.float32)}
        clock = 0
        for _ in range(3):  # warm-up: fast path, buffers
            _step(client, grads, clock, rng, args.rows, args.dim)
            clock += 1
        before = []
        cpu = _cpu_s(pid)
        for _ in range(args.steps):
            before.append(_step(client, grads, clock, rng, args.rows, args.dim))
            clock += 1
        cpu_before = _cpu_s(pid) - cpu

        started = time.perf_counter()
        cpu = _cpu_s(pid)
        pending = checkpoints.save_in_background(client, root, clock)
        capture_s = time.perf_counter() - started
        during = []
        while not pending.done():
            during.append(_step(client, grads, clock, rng, args.rows, args.dim))
            clock += 1
        full = pending.result()
        window_s = time.perf_counter() - started
        cpu_during = _cpu_s(pid) - cpu

        after = []
        cpu = _cpu_s(pid)
        for _ in range(args.steps):
            after.append(_step(client, grads, clock, rng, args.rows, args.dim))
            clock += 1
        cpu_around = cpu_before + _cpu_s(pid) - cpu
        started = time.perf_counter()
        blocking = checkpoints.save(client, root, clock)
        blocking_s = time.perf_counter() - started

        around = statistics.mean(before + after)
        emit("checkpoint_stall", dense_params=args.dense, table_rows=args.rows, dim=args.dim,
             write_mb_s=args.write_mb_s,
             step_ms=round(around * 1e3, 1), steps_during=len(during),
             during_step_ms=round(window_s / max(1, len(during)) * 1e3, 1),
             ratio=round(window_s / max(1, len(during)) / around, 3),
             # Medians: a step that another job on the host slowed moves a mean more than the write does.
             median_ratio=round(statistics.median(during or [0.0]) / statistics.median(before + after), 3),
             # The server's CPU a step, the writer's included: what the write takes from a shared host.
             server_cpu_ms_per_step=round(cpu_around / len(before + after) * 1e3, 1),
             server_cpu_ms_per_step_during=round(cpu_during / max(1, len(during)) * 1e3, 1),
             first_step_ms_during=round((during or [0.0])[0] * 1e3, 1),
             longest_step_ms_during=round(max(during or [0.0]) * 1e3, 1),
             longest_step_ms_around=round(max(before + after) * 1e3, 1),
             capture_ms=round(capture_s * 1e3, 1), background_write_s=round(window_s, 2),
             blocking_checkpoint_s=round(blocking_s, 2), checkpoint_mb=round(_bytes(full) / 2**20, 1),
             server_rss_mb=round(rss_mb(pid), 1))

        touched = rng.choice(args.rows, args.rows // 100, replace=False).astype(np.int64)
        for start in range(0, len(touched), FILL):
            chunk = np.sort(touched[start:start + FILL])
            client.push_rows("emb", chunk, np.full((len(chunk), args.dim), 1e-3, np.float32), clock)
        incremental = checkpoints.save(client, root, clock, parent=blocking)
        emit("checkpoint_incremental", dense_params=args.dense, table_rows=args.rows, dim=args.dim,
             touched_rows=len(touched), full_mb=round(_bytes(blocking) / 2**20, 1),
             incremental_mb=round(_bytes(incremental) / 2**20, 2),
             ratio=round(_bytes(incremental) / _bytes(blocking), 4),
             table_ratio=round(_bytes(incremental, True) / _bytes(blocking, True), 4))


if __name__ == "__main__":
    main()
