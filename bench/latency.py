"""Latency of a small fused push+pull: one tensor, one worker, one parameter server process.

The worker is this process; the server is `python -m pshard.ps_server` in sync mode with
this worker as its whole quorum, so every push_pull is applied and answered at once.

    python -m bench.latency [--transport shm|tcp|grpc] [--tls] [--numel 1000] [--iterations 2000]
                            [--warmup 200]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import CpuMeter, emit, start_ps_servers, stop_processes, summarize_latencies
from bench.tls import make_pki, server_args, worker_id, worker_security


def latency(numel: int = 1000, iterations: int = 2000, warmup: int = 200, transport: str = "grpc",
            pki: str | None = None) -> dict[str, object]:
    """`pki`: a directory of bench.tls certificates to run with TLS on (None: in clear)."""
    import numpy as np
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig

    node = worker_id(0)
    [server] = start_ps_servers(1, [node], ["--transport", transport, *server_args(pki)])
    try:
        with PSClient([server.address], node, transport=transport,
                      security=worker_security(pki, node)) as client:  # type: ignore[arg-type]
            params = {"w": np.zeros(numel, np.float32)}
            weights = client.declare(params, JobConfig(mode="sync", optimizer=OptimizerConfig("sgd", lr=0.1)))
            grads = {"w": np.ones(numel, np.float32)}
            samples = []
            meter = CpuMeter([server.proc.pid])
            for clock in range(warmup + iterations):
                if clock == warmup:
                    meter.start()
                t0 = time.perf_counter()
                client.push_pull(grads, clock, out=weights)
                if clock >= warmup:
                    samples.append(time.perf_counter() - t0)
            meter.stop()
            if client.transports != [transport]:
                raise RuntimeError(f"latency: asked for {transport}, the calls went over {client.transports}")
            expected = -0.1 * (warmup + iterations)
            if not np.allclose(weights["w"], expected, rtol=1e-3):
                raise RuntimeError(f"latency: weights are {weights['w'][:3]}, SGD should give {expected}")
    finally:
        stop_processes([server.proc])
    return {"transport": transport, "tls": pki is not None, **summarize_latencies(samples),
            **cpu_per_call(meter, iterations),
            "numel": numel, "payload_bytes": 4 * numel, "iterations": iterations}


def cpu_per_call(meter: CpuMeter, calls: int) -> dict[str, float]:
    cpu = meter.result()
    return {"server_cpu_us_per_call": round(cpu["server_cpu_s"] / calls * 1e6, 1),
            "client_cpu_us_per_call": round(cpu["own_cpu_s"] / calls * 1e6, 1)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--numel", type=int, default=1000, help="float32 elements of the tensor (default 1000)")
    p.add_argument("--iterations", type=int, default=2000, help="timed push_pulls (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="untimed push_pulls first (default 200)")
    p.add_argument("--transport", choices=("shm", "tcp", "grpc"), default="grpc",
                   help="how push/pull bytes travel (default grpc)")
    p.add_argument("--tls", action="store_true", help="mutual TLS on (a throw-away CA made by pshard certs)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    pki = str(make_pki(1)) if args.tls else None
    emit("latency_small_push_pull", **latency(args.numel, args.iterations, args.warmup, args.transport, pki))
    return 0


if __name__ == "__main__":
    sys.exit(main())
