"""Small push+pull of several checkouts, measured in interleaved blocks: robust to a loaded host.

Each checkout (a tree with its own .venv, e.g. a `git worktree` of an older commit) runs one worker and
one parameter server for the whole run, as bench.latency does (sync, one worker, 1,000 float32). The
checkouts then take turns: a block of `--steps` push+pulls each, in the order given, then reversed, and
so on. Per block: the p50, the CPU of the worker's calling thread and of the server's event loop thread
per step (each thread's own, not the process's, so nothing else running there counts). Each figure is
also given as the median over blocks of its ratio to the first checkout's block of the same round: the
host's load moves the blocks of one round alike, so the ratio holds where the figures themselves swing.

    python -m bench.latency_pairs [--transport tcp|shm] [--blocks 40] [--steps 500] TREE [TREE ...]

A TREE written `PATH:tls` runs with mutual TLS on (a throw-away CA, bench.tls), so one run can pair the
same checkout in clear and over TLS, before and after a change: `. .:tls /old /old:tls`.

A checkout is driven by its own Python, from its own root, with this file's `--drive` mode (which needs
only what every version of bench.common has: start_ps_servers and stop_processes, and bench.tls for TLS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

FIGURES = ("p50_us", "client_us", "server_us")
_WARMUP = 300


Blocks = Mapping[str, Sequence[Mapping[str, float]]]


def paired_summary(blocks: Blocks, base: str) -> dict[str, dict[str, float]]:
    """Per checkout: each figure's median over its blocks, and its median ratio to `base`'s block of the
    same round (`ratio_<figure>`)."""
    out = {}
    for tree, rows in blocks.items():
        if len(rows) != len(blocks[base]):
            raise ValueError(f"{tree}: {len(rows)} blocks, {base} has {len(blocks[base])}")
        summary = {f: statistics.median(r[f] for r in rows) for f in FIGURES}
        pairs = list(zip(rows, blocks[base], strict=True))
        summary |= {f"ratio_{f}": statistics.median(r[f] / b[f] for r, b in pairs) for f in FIGURES}
        out[tree] = summary
    return out


def _thread_cpu_ns(pid: int, tid: int) -> int:
    """CPU time of one thread of another process (schedstat: nanoseconds on a CPU)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])


def split_tree(tree: str) -> tuple[str, bool]:
    """"PATH:tls" -> (PATH, True); a plain PATH runs in clear."""
    path, sep, suffix = tree.rpartition(":")
    return (path, True) if sep and suffix == "tls" else (tree, False)


def drive(transport: str, tls: bool = False) -> int:
    """One checkout's worker and server; blocks asked for on stdin, one JSON line each on stdout."""
    import numpy as np
    sys.path.insert(0, os.getcwd())  # the checkout's own bench and pshard
    from pshard.common.job import JobConfig, OptimizerConfig

    from bench.common import start_ps_servers, stop_processes
    try:
        from pshard.client.ps_client import PSClient
    except ImportError:  # before the move (issue 18)
        from pshard.worker.client import PSClient  # type: ignore[no-redef]

    replies, sys.stdout = sys.stdout, sys.stderr  # stdout carries the blocks only
    security, tls_args = None, []
    if tls:
        from bench.tls import make_pki, server_args, worker_security
        pki = str(make_pki(1))
        security, tls_args = worker_security(pki, "worker-0"), server_args(pki)
    [server] = start_ps_servers(1, ["worker-0"], ["--transport", transport, *tls_args])
    pid = server.proc.pid  # its event loop runs on its main thread: tid == pid
    try:
        with PSClient([server.address], "worker-0", transport=transport,  # type: ignore[arg-type]
                      security=security) as client:
            weights = client.declare({"w": np.zeros(1000, np.float32)},
                                     JobConfig(mode="sync", optimizer=OptimizerConfig("sgd", lr=0.1)))
            grads = {"w": np.ones(1000, np.float32)}
            clock = 0
            for clock in range(_WARMUP):
                client.push_pull(grads, clock, out=weights)
            replies.write("ready\n")
            replies.flush()
            for line in sys.stdin:
                steps = int(line)
                if steps <= 0:
                    break
                server0, own0 = _thread_cpu_ns(pid, pid), time.thread_time_ns()
                samples = []
                for _ in range(steps):
                    clock += 1
                    started = time.perf_counter()
                    client.push_pull(grads, clock, out=weights)
                    samples.append(time.perf_counter() - started)
                own1, server1 = time.thread_time_ns(), _thread_cpu_ns(pid, pid)
                replies.write(json.dumps({
                    "p50_us": statistics.median(samples) * 1e6, "client_us": (own1 - own0) / steps / 1e3,
                    "server_us": (server1 - server0) / steps / 1e3, "load1": os.getloadavg()[0]}) + "\n")
                replies.flush()
            if client.transports != [transport]:
                raise RuntimeError(f"asked for {transport}, the calls went over {client.transports}")
    finally:
        stop_processes([server.proc])
    return 0


def run(trees: Sequence[str], transport: str, blocks: int, steps: int) -> dict[str, list[dict[str, float]]]:
    procs = {}
    try:
        for tree in trees:
            path, tls = split_tree(tree)
            python = Path(path) / ".venv" / "bin" / "python"
            if not python.exists():
                raise SystemExit(f"{path}: no .venv/bin/python there (each checkout runs its own)")
            command = [str(python), str(Path(__file__).resolve()), "--drive", transport]
            procs[tree] = subprocess.Popen(
                command + (["--tls"] if tls else []), cwd=path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True)
        for tree, proc in procs.items():
            if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{tree}: its worker and server did not start (exit {proc.poll()})")
        results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
        for round_ in range(blocks):
            for tree in trees if round_ % 2 == 0 else list(reversed(trees)):
                proc = procs[tree]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{steps}\n")
                proc.stdin.flush()
                results[tree].append(json.loads(proc.stdout.readline()))
        return results
    finally:
        for proc in procs.values():
            if proc.stdin is not None and proc.poll() is None:
                proc.stdin.write("0\n")
                proc.stdin.close()
        for proc in procs.values():
            proc.wait(60)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.latency_pairs", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("trees", nargs="*",
                   help="checkouts, each with its .venv, PATH:tls for TLS on; ratios are to the first")
    p.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="fast path (default tcp)")
    p.add_argument("--blocks", type=int, default=40, help="blocks per checkout (default 40)")
    p.add_argument("--steps", type=int, default=500, help="push+pulls per block (default 500)")
    p.add_argument("--drive", metavar="TRANSPORT", help=argparse.SUPPRESS)
    p.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)  # with --drive
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.drive:
        return drive(args.drive, args.tls)
    if len(args.trees) < 2 or args.blocks < 1 or args.steps < 1:
        build_parser().error("give two checkouts or more, --blocks >= 1 and --steps >= 1")
    results = run(args.trees, args.transport, args.blocks, args.steps)
    loads = [r["load1"] for rows in results.values() for r in rows]
    for tree, summary in paired_summary(results, args.trees[0]).items():
        path, tls = split_tree(tree)
        if tls and path in results:  # the same checkout in clear: TLS's cost, paired round by round
            summary["tls_to_clear_p50"] = paired_summary({tree: results[tree], path: results[path]},
                                                         path)[tree]["ratio_p50_us"]
        print(json.dumps({"figure": "latency_pairs", "tree": tree, "transport": args.transport,
                          "blocks": args.blocks, "steps": args.steps,
                          **{k: round(v, 3) for k, v in summary.items()},
                          "load1": [round(min(loads), 2), round(max(loads), 2)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
