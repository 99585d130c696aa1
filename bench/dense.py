"""Dense bandwidth: fused push_pull of a whole model, 2 parameter servers x 2 workers.

Parameter servers are `python -m pshard.ps_server` processes, workers spawned processes with
a PSClient each, all on 127.0.0.1, sync mode, server-side SGD. Every step each worker
pushes every gradient and gets every updated weight back in one push_pull. MB/s
counts the bytes pushed plus the bytes pulled by all workers (decimal MB).

`--transport` picks how the bytes travel (shm, tcp or grpc: both ends are told, so the figure is
that transport's, and a worker that ends up on another one fails the run).

    python -m bench.dense [--transport shm|tcp|grpc] [--tls] [--sizes 8000000,2000000*8,...] [--steps 8]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
from pathlib import Path

from bench.common import (
    DEFAULT_SIZES,
    MB,
    CpuMeter,
    WorkerRun,
    cpu_figures,
    emit,
    parse_sizes,
    rss_mb,
    run_workers,
    span_s,
    start_ps_servers,
    stop_processes,
    timed_steps,
)
from bench.tls import make_pki, server_args, worker_id, worker_security


class _Watched:
    """Over the timed steps: the CPU seconds of this worker and of the servers (bench.common.CpuMeter), how
    much each one's RSS grew, and this worker's profile when it is given a profiler."""

    def __init__(self, server_pids: list[int], profiler: cProfile.Profile | None) -> None:
        self._pids = (os.getpid(), *server_pids)
        self._profiler = profiler
        self.meter = CpuMeter(server_pids)
        self._rss_before: list[float] = []
        self.rss_growth_mb: list[float] = []

    def __enter__(self) -> None:
        if self._profiler is not None:
            self._profiler.enable()
        # Steady state allocates no model-sized buffer per step: RSS must stay flat over the steps.
        self._rss_before = [rss_mb(pid) for pid in self._pids]
        self.meter.start()

    def __exit__(self, *exc: object) -> None:
        self.meter.stop()
        self.rss_growth_mb = [rss_mb(pid) - before for pid, before in zip(self._pids, self._rss_before,
                                                                          strict=True)]
        if self._profiler is not None:
            self._profiler.disable()


def _dense_worker(run: WorkerRun, addresses: list[str], sizes: list[int], lr: float, warmup: int,
                  steps: int, profile_dir: str | None, server_pids: list[int], transport: str,
                  pki: str | None) -> dict[str, float | list[float]]:
    import numpy as np
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig

    rng = np.random.default_rng(run.index)
    params = {f"t{i:02d}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    grads = {k: rng.standard_normal(v.size, dtype=np.float32) for k, v in params.items()}
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=lr))
    node = worker_id(run.index)
    profiler = cProfile.Profile() if profile_dir else None
    watched = _Watched(server_pids, profiler)
    with PSClient(addresses, node, transport=transport,
                  security=worker_security(pki, node)) as client:  # type: ignore[arg-type]
        weights = client.declare(params, job)
        first = weights["t00"][:4].copy()
        _, _, start, end = timed_steps(client, grads, weights, run, warmup, steps, around=watched)
        if client.transports != [transport] * len(addresses):
            raise RuntimeError(f"dense: asked for {transport}, the steps went over {client.transports}")
        if profiler is not None and profile_dir:
            profiler.dump_stats(str(Path(profile_dir) / f"worker{run.index}.prof"))
    # Sanity: every step moved the weights (sum of both workers' gradients, times lr).
    if np.array_equal(first, weights["t00"][:4]) or not np.isfinite(weights["t00"]).all():
        raise RuntimeError("dense: the weights did not change as SGD should have changed them")
    return {"start": start, "end": end, "rss_growth_mb": watched.rss_growth_mb, **watched.meter.result()}


def dense(sizes: list[int], servers: int = 2, workers: int = 2, warmup: int = 2, steps: int = 8,
          lr: float = 1e-4, profile_dir: str | None = None, transport: str = "grpc",
          pki: str | None = None) -> dict[str, object]:
    """`pki`: a directory of bench.tls certificates to run with TLS on (None: in clear)."""
    names = [worker_id(i) for i in range(workers)]
    extra: list[str] = ["--transport", transport, *server_args(pki)]
    if profile_dir:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
    procs = start_ps_servers(servers, names, extra, profile_dir=profile_dir)
    try:
        results = run_workers(_dense_worker, workers, ([p.address for p in procs], sizes, lr, warmup, steps,
                                                        profile_dir, [p.proc.pid for p in procs], transport,
                                                        pki))
    finally:
        stop_processes([p.proc for p in procs])
    elapsed = span_s(results)
    model_bytes = 4 * sum(sizes)
    moved = 2 * model_bytes * workers * steps  # every worker pushes and pulls the whole model
    # Over the timed steps: each worker's own, and the servers' (as seen by worker 0, after its last step).
    rss = {"rss_growth_mb_workers": [round(r["rss_growth_mb"][0], 1) for r in results],
           "rss_growth_mb_servers": [round(g, 1) for g in results[0]["rss_growth_mb"][1:]]}
    return {"transport": transport, "tls": pki is not None, "mb_per_s": round(moved / MB / elapsed, 1),
            "steps_per_s": round(steps / elapsed, 3),
            "bytes_per_step": moved // steps, "params": sum(sizes), "tensors": len(sizes),
            "servers": servers, "workers": workers, "steps": steps, **rss,
            **cpu_figures(results, steps, elapsed)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dense", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"float32 tensor sizes, N*K = K tensors of N (default {DEFAULT_SIZES}: 25M in 16)")
    p.add_argument("--servers", type=int, default=2, help="parameter server processes (default 2)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--lr", type=float, default=1e-4, help="server SGD learning rate (default 1e-4)")
    p.add_argument("--transport", choices=("shm", "tcp", "grpc"), default="grpc",
                   help="how push/pull bytes travel (default grpc)")
    p.add_argument("--tls", action="store_true", help="mutual TLS on (a throw-away CA made by pshard certs)")
    p.add_argument("--profile", metavar="DIR",
                   help="write cProfile stats of the workers' timed steps and of the servers to DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    pki = str(make_pki(args.workers)) if args.tls else None
    emit("dense_push_pull", **dense(parse_sizes(args.sizes), args.servers, args.workers, args.warmup,
                                    args.steps, args.lr, args.profile, args.transport, pki))
    return 0


if __name__ == "__main__":
    sys.exit(main())
