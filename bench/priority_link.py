"""Layer priority against FIFO order over a shaped link (issue 19 item 5): PSTrainer's step time.

2 parameter servers and 2 workers, each on its own host of the multi-host test bed (bench/hostbed: network
namespaces, tc tbf), every worker's link shaped to `--mbit` both ways (0: not shaped), sync mode, raw TCP.
The model is a deep MLP (`--layers` hidden layers of `--width`, 4 MiB each at the default 1024, so one
bucket per layer); each worker trains it with `PSTrainer(overlap=True)`, FIFO order and then with
`priority=True`, `--rounds` times alternately in the same run, and reports its mean step time after one
warm-up step. One JSON line per run, with the ratio of FIFO's step time to priority's in the same round.
Needs root (`HostBed`'s skip reason says why not).

    python -m bench.priority_link [--mbit 1000] [--steps 4] [--layers 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import emit

PORT = 7100


def worker(servers: list[str], worker_id: str, priority: bool, steps: int, layers: int, width: int,
           batch: int) -> None:
    """One worker's loop, run on its host: prints {"step_s": mean, "transports": [...]}."""
    import torch
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker.torch_api import PSTrainer
    from torch import nn
    from torch.nn import functional as F

    torch.set_num_threads(1)  # two workers and two servers share the machine's cores
    torch.manual_seed(0)
    hidden = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.Sequential(*hidden, nn.Linear(width, 10))
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1e-3))
    client = PSClient(servers, worker_id, transport="tcp", timeout_s=300)
    with PSTrainer(model, client, job, overlap=True, priority=priority) as trainer:
        started = time.perf_counter()
        for step in range(steps + 1):
            if step == 1:  # after the warm-up: the fast path is open, the buffers made
                trainer.synchronize()
                started = time.perf_counter()
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.step()
        trainer.synchronize()
        step_s = (time.perf_counter() - started) / steps
        print(json.dumps({"step_s": step_s, "transports": client.transports}), flush=True)
    client.close()


def one_run(bed: object, args: argparse.Namespace, priority: bool) -> list[dict[str, object]]:
    hosts = bed.hosts  # type: ignore[attr-defined]
    servers = [f"{hosts[h].address}:{PORT}" for h in ("ps0", "ps1")]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    ps = [bed.spawn(h, [sys.executable, "-m", "pshard.ps_server", "--bind", f"{hosts[h].address}:{PORT}",  # type: ignore[attr-defined]
                        "--workers", "w0,w1", "--no-scheduler", "--insecure", "--transport", "tcp"], env=env)
          for h in ("ps0", "ps1")]
    try:
        flags = ["--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width),
                 "--batch", str(args.batch), *(["--priority"] if priority else [])]
        workers = [bed.spawn(w, [sys.executable, "-m", "bench.priority_link", "--worker", w,  # type: ignore[attr-defined]
                                 "--servers", ",".join(servers), *flags], env=env, stderr=subprocess.PIPE)
                   for w in ("w0", "w1")]
        results = []
        for proc in workers:
            out, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"priority={priority}: worker failed ({proc.returncode}): "
                                 f"{err.decode()[-3000:]}")
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
        return results
    finally:
        for proc in ps:
            bed.kill(proc)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.priority_link",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--mbit", type=float, default=1000.0, help="each worker's link, both ways (0: not shaped)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run, after one warm-up")
    p.add_argument("--layers", type=int, default=24, help="hidden layers of the MLP")
    p.add_argument("--width", type=int, default=1024, help="units per hidden layer")
    p.add_argument("--batch", type=int, default=32, help="each worker's batch")
    p.add_argument("--rounds", type=int, default=2, help="FIFO then priority, this many times")
    p.add_argument("--priority", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--servers", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.servers.split(","), args.worker, args.priority, args.steps, args.layers, args.width,
               args.batch)
        return 0
    from bench.hostbed import HostBed, skip_reason

    if (reason := skip_reason()) is not None:
        raise SystemExit(f"no test bed: {reason}")
    model_mb = (args.layers * (args.width + 1) * args.width + (args.width + 1) * 10) * 4 / 1e6
    with HostBed(["ps0", "ps1", "w0", "w1"]) as bed:
        if args.mbit > 0:
            for w in ("w0", "w1"):
                bed.shape(w, rate_mbit=args.mbit)
        for round_ in range(args.rounds):
            fifo = 0.0
            for priority in (False, True):
                results = one_run(bed, args, priority)
                step_s = max(float(r["step_s"]) for r in results)  # type: ignore[arg-type]
                fifo = step_s if not priority else fifo
                emit("priority_link", round=round_, order="priority" if priority else "fifo",
                     mbit=args.mbit, layers=args.layers, model_mb=round(model_mb, 1),
                     step_s=round(step_s, 3), fifo_over_this=round(fifo / step_s, 2),
                     transports=results[0]["transports"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
