"""W1 over a shaped link (issue 19): step time and bytes with and without gradient compression.

2 parameter servers and 2 workers, each on its own host of the multi-host test bed (bench/hostbed: network
namespaces, tc tbf), every worker's link shaped to `--mbit` both ways, sync mode, raw TCP. The model is
25 M float32 (100 MB) in 5 tensors; each worker runs `--steps` fused push-pull steps after one warm-up and
reports its mean step time and the gradient bytes it sent. One JSON line per compressor, with the ratio of
its step time to uncompressed in the same run. Needs root (`HostBed`'s skip reason says why not).

The line rate is the tbf rate, `--mbit` / 8 MB/s, headers included (a TCP payload can move at most about
0.94 of it with 1500-byte frames). A worker's link carries its push up and its pull down each step, at
once, so what a step moved is the busier way's bytes over the step time (100 MB / step_s uncompressed).
Each round first measures the link itself, in the same bed, load and shaping: a plain Python TCP stream
w0 -> ps0 (one way), then w0 -> ps0 and ps1 -> w0 at once (both ways: the slower of the two); every figure
is also given against those (`ratio_to_stream`, `ratio_to_both_ways`), with tc's bytes and drops on w0's
link and each process's CPU and run-queue wait (bench.link_ceiling).

A compressor written NAME@bfloat16 also pulls in bfloat16 (the job's wire_dtype); one written NAME/PULL
compresses pulls too (JobConfig.compression.pull: "topk:0.01/topk:0.01", "sign/sign"): pulls stay full
precision otherwise, and 100 MB pulled at 1 Gbit/s bound a step at 0.8 s whatever the pushes cost.
`--rounds N` runs the whole list N times, alternating, so that the machine's load drifts over all alike.

    python -m bench.compression_link [--mbit 1000] [--steps 4] [--rounds 1] [--compression none sign/sign]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench.common import emit
from bench.link_ceiling import CpuSampler, qdisc_stats, stats_delta, streams

NUMEL = 25_000_000
TENSORS = 5
PORT = 7100


def worker(servers: list[str], worker_id: str, compression: str, steps: int) -> None:
    """One worker's loop, run on its host: prints {"step_s": mean, "sent_bytes": per step}."""
    from pshard.client.ps_client import PSClient
    from pshard.common.compression import Compression
    from pshard.common.job import JobConfig, OptimizerConfig

    rng = np.random.default_rng(int(worker_id[-1]))
    params = {f"w{i}": np.zeros(NUMEL // TENSORS, np.float32) for i in range(TENSORS)}
    grads = {k: rng.standard_normal(v.size, dtype=np.float32) for k, v in params.items()}
    name, _, wire = compression.partition("@")
    name, _, pull = name.partition("/")
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1e-3),
                    compression=Compression(name, pull=pull or "none"), wire_dtype=wire)
    with PSClient(servers, worker_id, transport="tcp", timeout_s=300) as client:
        client.declare(params, job)
        client.push_pull(grads, 0)  # warm-up: the fast path opens, buffers are made, the first pull is whole
        decoder = client.pull_compression
        pulled_before = (decoder.bytes_after, decoder.bytes_before) if decoder else (0, 0)
        print(json.dumps({"timing": True}), flush=True)  # the bench samples every process's CPU from here
        started, cpu = time.perf_counter(), time.process_time()
        for clock in range(1, steps + 1):
            client.push_pull(grads, clock)
        step_s = (time.perf_counter() - started) / steps
        cpu_s = (time.process_time() - cpu) / steps  # all its threads: a worker's CPU a step
        stats = client.compression.stats if client.compression else None
        sent = stats.bytes_after / stats.steps if stats else NUMEL * (2 if wire else 4)
        pulled = ((decoder.bytes_after - pulled_before[0]) / steps if decoder else NUMEL * (2 if wire else 4))
        print(json.dumps({"step_s": step_s, "cpu_s": cpu_s, "sent_bytes": sent, "pulled_bytes": pulled,
                          "transports": client.transports}), flush=True)


def one_run(bed: object, compression: str, steps: int, mbit: float) -> list[dict[str, object]]:
    hosts = bed.hosts  # type: ignore[attr-defined]
    servers = [f"{hosts[h].address}:{PORT}" for h in ("ps0", "ps1")]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    ps = [bed.spawn(h, [sys.executable, "-m", "pshard.ps_server", "--bind", f"{hosts[h].address}:{PORT}",  # type: ignore[attr-defined]
                        "--workers", "w0,w1", "--no-scheduler", "--insecure", "--transport", "tcp"], env=env)
          for h in ("ps0", "ps1")]
    try:
        workers = [bed.spawn(w, [sys.executable, "-m", "bench.compression_link", "--worker", w,  # type: ignore[attr-defined]
                                 "--servers", ",".join(servers), "--compression", compression,
                                 "--steps", str(steps)], env=env, stderr=subprocess.PIPE)
                   for w in ("w0", "w1")]
        assert workers[0].stdout is not None
        while (line := workers[0].stdout.readline()) and b'"timing"' not in line:
            pass
        sampler = CpuSampler({"ps0": ps[0].pid, "ps1": ps[1].pid, "w0": workers[0].pid, "w1": workers[1].pid})
        results = []
        for proc in workers:
            out, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{compression}: worker failed ({proc.returncode}): {err.decode()[-3000:]}")
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
        results[0]["cpu"] = sampler.stop()
        return results
    finally:
        for proc in ps:
            bed.kill(proc)  # type: ignore[attr-defined]


def ceilings(bed: object, round_: int, line_mb_per_s: float) -> dict[str, float]:
    """Plain Python TCP streams through w0's shaped link, this round: one way up, then up and down at once
    (to ps0 while from ps1, as a worker pushes to one server while it pulls from the other)."""
    up = streams(bed, [("w0", "ps0")])  # type: ignore[arg-type]
    both = streams(bed, [("w0", "ps0"), ("ps1", "w0")])  # type: ignore[arg-type]
    one_way = float(up[0]["mb_per_s"])  # type: ignore[arg-type]
    both_ways = min(float(s["mb_per_s"]) for s in both)  # type: ignore[arg-type]
    emit("link_stream", round=round_, load=round(os.getloadavg()[0], 1), one_way_mb_per_s=one_way,
         both_ways_mb_per_s=[s["mb_per_s"] for s in both], line_mb_per_s=line_mb_per_s,
         one_way_ratio_to_line=round(one_way / line_mb_per_s, 2),
         both_ways_ratio_to_line=round(both_ways / line_mb_per_s, 2))
    return {"one_way": one_way, "both_ways": both_ways}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compression_link",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--mbit", type=float, default=1000.0)
    p.add_argument("--burst-kb", type=int, default=256,
                   help="tc tbf burst of each shaped link, KB (default 256)")
    p.add_argument("--latency-ms", type=int, default=50,
                   help="tc tbf latency: the longest a packet may wait in the link's queue (default 50)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--compression", nargs="+",
                   default=["none", "topk:0.01", "sign", "topk:0.01/topk:0.01", "sign/sign",
                            "topk:0.01@bfloat16", "sign@bfloat16"])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--servers", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.servers.split(","), args.worker, args.compression[0], args.steps)
        return 0
    from bench.hostbed import HostBed, skip_reason

    if (reason := skip_reason()) is not None:
        raise SystemExit(f"no test bed: {reason}")
    line_mb_per_s = args.mbit / 8  # the tbf rate, headers included: what "line rate" means here
    with HostBed(["ps0", "ps1", "w0", "w1"]) as bed:
        for w in ("w0", "w1"):
            bed.shape(w, rate_mbit=args.mbit, burst_kb=args.burst_kb, latency_ms=args.latency_ms)
        for round_ in range(args.rounds):
            ceiling = ceilings(bed, round_, line_mb_per_s)
            base: float | None = None
            for compression in args.compression:
                before = qdisc_stats(bed, "w0")
                results = one_run(bed, compression, args.steps, args.mbit)
                wire = stats_delta(qdisc_stats(bed, "w0"), before)
                step_s = max(float(r["step_s"]) for r in results)  # type: ignore[arg-type]
                sent = float(results[0]["sent_bytes"])  # type: ignore[arg-type]
                pulled = float(results[0]["pulled_bytes"])  # type: ignore[arg-type]
                base = step_s if base is None else base
                # A worker's link carries its push up and its pull down a step, at once: the busier way's
                # MB/s is what the link moved, against the line rate and the same run's streams.
                moved = max(sent, pulled) / 1e6 / step_s
                emit("compression_link", compression=compression, mbit=args.mbit, round=round_,
                     load=round(os.getloadavg()[0], 1), step_s=round(step_s, 3),
                     worker_cpu_s=round(max(float(r["cpu_s"]) for r in results), 3),  # type: ignore[arg-type]
                     speedup_vs_first=round(base / step_s, 2), sent_mb_per_step=round(sent / 1e6, 2),
                     pulled_mb_per_step=round(pulled / 1e6, 2), mb_per_s=round(moved, 1),
                     ratio_to_line=round(moved / line_mb_per_s, 2),
                     ratio_to_stream=round(moved / ceiling["one_way"], 2),
                     ratio_to_both_ways=round(moved / ceiling["both_ways"], 2),
                     w0_link_mb={way: round(c["bytes"] / 1e6, 1) for way, c in wire.items()},
                     w0_link_drops={way: c["drops"] for way, c in wire.items()},
                     cpu_cores=results[0]["cpu"], transports=results[0]["transports"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
