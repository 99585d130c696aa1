"""Across hosts, in one run on the multi-host bed (issue 24, item 5): `make bench-hosts`, as root.

Four hosts (network namespaces on a bridge, bench/hostbed): two parameter servers (ps0, ps1) and two
workers (w0, w1). Each figure is taken between hosts, never over 127.0.0.1:

- a Python TCP stream from a worker's host to a server's host (the ceiling);
- W1, the dense step of bench.dense (25 M float32, 2 servers x 2 workers, sync), over raw TCP, in clear and
  with mutual TLS (per-host certificates from `pshard certs --host <ip>`), as ratios to the stream and to
  clear;
- the small push+pull p50 (bench.latency's: 1,000 float32, one worker, one server), clear and TLS;
- with every host's link shaped to --rate-mbit (tc tbf, both ways): the stream and W1 in clear, as a
  fraction of the line rate. Each link carries, each way, one model's bytes per step (a worker pushes its
  gradient out and pulls the weights in; a server takes half from each worker and sends as much back), so
  the fraction is (W1 MB/s / (2 x workers)) / (rate / 8).

Servers are real `python -m pshard.ps_server` processes on their hosts; workers are spawned processes that
enter their host's network namespace before anything else (grpc's threads are created after). Prints JSON
lines (bench.common.emit) and then a table.

    python -m bench.hosts [--steps 8] [--rate-mbit 1000] [--quick]        (make bench-hosts)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import (
    DEFAULT_SIZES,
    MB,
    WorkerRun,
    emit,
    parse_sizes,
    run_workers,
    span_s,
    summarize_latencies,
)
from bench.dense import _dense_worker
from bench.hostbed import HostBed, skip_reason
from bench.hostbed.forwarder import enter_netns
from bench.tls import worker_id, worker_security

SERVERS = ("ps0", "ps1")
WORKERS = ("w0", "w1")

# Receives `rounds` buffers of `buffer` bytes (after `warm` of them) and answers one byte after each batch.
_STREAM_RECEIVER = """
import socket, sys
buffer, warm, rounds = (int(a) for a in sys.argv[1:4])
listener = socket.create_server((sys.argv[4], 0))
print(listener.getsockname()[1], flush=True)
sock, _ = listener.accept()
view = memoryview(bytearray(buffer))
for want in (warm * buffer, rounds * buffer):
    got = 0
    while got < want:
        n = sock.recv_into(view[:min(buffer, want - got)])
        if n == 0:
            raise SystemExit(f"stream: sender closed after {got} of {want} bytes")
        got += n
    sock.sendall(b"k")
"""


def _first_line(proc: subprocess.Popen[bytes], marker: str, timeout_s: float = 120.0) -> str:
    """The first stdout line holding `marker`; the rest is drained by a thread so the process never
    blocks on a full pipe."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        line = proc.stdout.readline().decode(errors="replace")
        if line and marker in line:
            break
        if not line or time.monotonic() > deadline:
            raise RuntimeError(f"process {proc.args!r} exited ({proc.poll()}) or took over {timeout_s:g}s "
                               f"without printing {marker!r}")
    stdout = proc.stdout
    threading.Thread(target=lambda: [None for _ in stdout], daemon=True).start()
    return line.strip()


def _stream_sender(run: WorkerRun, netns: str, address: str, buffer_bytes: int, warm: int,
                   rounds: int) -> dict[str, float]:
    import socket

    enter_netns(netns)
    host, port = address.rsplit(":", 1)
    payload = memoryview(bytearray(b"\x5a" * buffer_bytes))
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        for _ in range(warm):
            sock.sendall(payload)
        sock.recv(1)
        start = time.monotonic()
        for _ in range(rounds):
            sock.sendall(payload)
        sock.recv(1)
        end = time.monotonic()
    return {"start": start, "end": end}


def stream(bed: HostBed, src: str, dst: str, buffer_mb: int, rounds: int, warm: int = 1
           ) -> dict[str, object]:
    """One TCP stream's MB/s from host `src` to host `dst`."""
    buffer_bytes = buffer_mb * MB
    receiver = bed.spawn(dst, [sys.executable, "-c", _STREAM_RECEIVER, str(buffer_bytes), str(warm),
                               str(rounds), bed.hosts[dst].address])
    try:
        port = _first_line(receiver, "")
        [result] = run_workers(_stream_sender, 1, (bed.hosts[src].netns, f"{bed.hosts[dst].address}:{port}",
                                                   buffer_bytes, warm, rounds))
    finally:
        bed.kill(receiver)
    elapsed = result["end"] - result["start"]
    return {"from": src, "to": dst, "mb_per_s": round(rounds * buffer_bytes / MB / elapsed, 1),
            "bytes": rounds * buffer_bytes, "seconds": round(elapsed, 3)}


def _tls_args(pki: str | None, node: str) -> list[str]:
    if pki is None:
        return []
    return ["--tls-cert", f"{pki}/{node}.pem", "--tls-key", f"{pki}/{node}-key.pem",
            "--tls-ca", f"{pki}/ca.pem"]


def start_servers(bed: HostBed, hosts: Sequence[str], workers: Sequence[str], transport: str,
                  pki: str | None) -> list[tuple[subprocess.Popen[bytes], str]]:
    """A `python -m pshard.ps_server` on each of `hosts`, bound to its address, quorum `workers`."""
    started = []
    for i, host in enumerate(hosts):
        argv = [sys.executable, "-m", "pshard.ps_server", "--bind", f"{bed.hosts[host].address}:0",
                "--no-scheduler", "--workers", ",".join(workers), "--log-level", "WARNING",
                "--transport", transport, *_tls_args(pki, f"ps-{i}")]
        started.append(bed.spawn(host, argv))
    servers = []
    try:
        for host, proc in zip(hosts, started, strict=True):
            port = _first_line(proc, "listening on port").rsplit(" ", 1)[1]
            servers.append((proc, f"{bed.hosts[host].address}:{port}"))
    except BaseException:
        for proc in started:
            bed.kill(proc)
        raise
    return servers


def _dense_in_host(run: WorkerRun, netns: Sequence[str], *args: object) -> dict[str, float | list[float]]:
    enter_netns(netns[run.index])
    return _dense_worker(run, *args)  # type: ignore[arg-type]


def dense(bed: HostBed, sizes: list[int], steps: int, warmup: int, pki: str | None) -> dict[str, object]:
    """W1 between hosts over raw TCP: bench.dense's workers and figures, on the bed."""
    names = [worker_id(i) for i in range(len(WORKERS))]
    servers = start_servers(bed, SERVERS, names, "tcp", pki)
    try:
        results = run_workers(_dense_in_host, len(WORKERS), (
            [bed.hosts[w].netns for w in WORKERS], [a for _, a in servers], sizes, 1e-4, warmup, steps, None,
            [p.pid for p, _ in servers], "tcp", pki))
    finally:
        for proc, _ in servers:
            bed.kill(proc)
    elapsed = span_s(results)
    moved = 2 * 4 * sum(sizes) * len(WORKERS) * steps
    return {"transport": "tcp", "tls": pki is not None, "mb_per_s": round(moved / MB / elapsed, 1),
            "steps_per_s": round(steps / elapsed, 3), "params": sum(sizes), "steps": steps,
            "servers": len(SERVERS), "workers": len(WORKERS)}


def _latency_in_host(run: WorkerRun, netns: str, address: str, pki: str | None, numel: int, iterations: int,
                     warmup: int) -> dict[str, object]:
    enter_netns(netns)
    import numpy as np
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig

    node = worker_id(0)
    with PSClient([address], node, transport="tcp",
                  security=worker_security(pki, node)) as client:  # type: ignore[arg-type]
        weights = client.declare({"w": np.zeros(numel, np.float32)},
                                 JobConfig(mode="sync", optimizer=OptimizerConfig("sgd", lr=0.1)))
        grads = {"w": np.ones(numel, np.float32)}
        samples = []
        start = time.monotonic()
        for clock in range(warmup + iterations):
            t0 = time.perf_counter()
            client.push_pull(grads, clock, out=weights)
            if clock >= warmup:
                samples.append(time.perf_counter() - t0)
        if client.transports != ["tcp"]:
            raise RuntimeError(f"latency: asked for tcp, the calls went over {client.transports}")
    return {"start": start, "end": time.monotonic(), "samples": samples}


def latency(bed: HostBed, pki: str | None, numel: int = 1000, iterations: int = 2000,
            warmup: int = 200) -> dict[str, object]:
    """Small push+pull p50 from w0 to a server on ps0 over raw TCP."""
    [(proc, address)] = start_servers(bed, SERVERS[:1], [worker_id(0)], "tcp", pki)
    try:
        [result] = run_workers(_latency_in_host, 1, (bed.hosts[WORKERS[0]].netns, address, pki, numel,
                                                     iterations, warmup))
    finally:
        bed.kill(proc)
    samples: list[float] = result["samples"]  # type: ignore[assignment]
    return {"transport": "tcp", "tls": pki is not None, **summarize_latencies(samples),
            "numel": numel, "iterations": iterations}


def _ratio(a: object, b: object) -> float:
    return round(float(a) / float(b), 3)  # type: ignore[arg-type]


def run(sizes: list[int], steps: int, warmup: int, rate_mbit: int, iterations: int,
        stream_mb: int, stream_rounds: int) -> list[dict[str, object]]:
    figures: list[dict[str, object]] = []
    with HostBed([*SERVERS, *WORKERS]) as bed, \
            tempfile.TemporaryDirectory(prefix="pshard-bench-hosts-") as pki:
        bed.certs(Path(pki), {**{h: [f"ps/ps-{i}"] for i, h in enumerate(SERVERS)},
                              **{h: [f"worker/{worker_id(i)}"] for i, h in enumerate(WORKERS)}})
        ceiling = emit("hosts_tcp_stream", **stream(bed, WORKERS[0], SERVERS[0], stream_mb, stream_rounds))
        clear = dense(bed, sizes, steps, warmup, None)
        figures.append(emit("hosts_dense", **clear,
                            ratio_to_stream=_ratio(clear["mb_per_s"], ceiling["mb_per_s"])))
        tls = dense(bed, sizes, steps, warmup, pki)
        figures.append(emit("hosts_dense", **tls, ratio_to_clear=_ratio(tls["mb_per_s"], clear["mb_per_s"])))
        small = emit("hosts_latency", **latency(bed, None, iterations=iterations))
        small_tls = latency(bed, pki, iterations=iterations)
        figures += [small, emit("hosts_latency", **small_tls,
                                ratio_to_clear=_ratio(small_tls["p50_us"], small["p50_us"]))]
        for host in bed.hosts:
            bed.shape(host, rate_mbit, burst_kb=max(256, rate_mbit // 4))
        line_mb_per_s = rate_mbit / 8
        shaped_stream = stream(bed, WORKERS[0], SERVERS[0], stream_mb, max(2, stream_rounds // 4))
        figures.append(emit("hosts_tcp_stream", **shaped_stream, rate_mbit=rate_mbit,
                            ratio_to_line=_ratio(shaped_stream["mb_per_s"], line_mb_per_s)))
        shaped = dense(bed, sizes, max(2, steps // 2), 1, None)
        per_link = float(shaped["mb_per_s"]) / (2 * len(WORKERS))  # type: ignore[arg-type]
        figures.append(emit("hosts_dense", **shaped, rate_mbit=rate_mbit,
                            ratio_to_line=_ratio(per_link, line_mb_per_s)))
        figures.insert(0, ceiling)
    return figures


def table(figures: Sequence[dict[str, object]]) -> str:
    ceiling, clear, tls, small, small_tls, shaped_stream, shaped = figures
    rate = shaped["rate_mbit"]
    rows = [("one Python TCP stream w0 -> ps0 (ceiling)", f"{ceiling['mb_per_s']} MB/s", ""),
            ("W1 over raw TCP, clear", f"{clear['mb_per_s']} MB/s",
             f"{clear['ratio_to_stream']}x the stream"),
            ("W1 over raw TCP, mutual TLS", f"{tls['mb_per_s']} MB/s",
             f"{tls['ratio_to_clear']}x clear"),
            ("small push+pull p50, clear", f"{small['p50_us']} us", ""),
            ("small push+pull p50, mutual TLS", f"{small_tls['p50_us']} us",
             f"{small_tls['ratio_to_clear']}x clear"),
            (f"TCP stream, links at {rate} Mbit/s", f"{shaped_stream['mb_per_s']} MB/s",
             f"{shaped_stream['ratio_to_line']}x the line rate"),
            (f"W1 clear, links at {rate} Mbit/s", f"{shaped['mb_per_s']} MB/s",
             f"{shaped['ratio_to_line']}x the line rate (per link, each way)")]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value:>14}  {ratio}" for name, value, ratio in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hosts",
                                description=__doc__.split("\n\n")[0] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"W1's float32 tensor sizes (default {DEFAULT_SIZES})")
    p.add_argument("--steps", type=int, default=8, help="W1's timed steps (default 8; half when shaped)")
    p.add_argument("--warmup", type=int, default=2, help="W1's untimed steps first (default 2)")
    p.add_argument("--rate-mbit", type=int, default=1000, help="the shaped links' rate (default 1000)")
    p.add_argument("--iterations", type=int, default=2000, help="small push+pull calls (default 2000)")
    p.add_argument("--quick", action="store_true", help="a smoke run: a small model and few calls")
    args = p.parse_args(argv)
    if (reason := skip_reason()) is not None:
        print(f"python -m bench.hosts: {reason}", file=sys.stderr)
        return 2
    sizes = parse_sizes("1000000*4" if args.quick else args.sizes)
    figures = run(sizes, 2 if args.quick else args.steps, 1 if args.quick else args.warmup, args.rate_mbit,
                  200 if args.quick else args.iterations, 20 if args.quick else 100, 4 if args.quick else 10)
    print(table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
