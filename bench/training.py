"""Training steps/s with the parameter servers, as a ratio to the same loop with a local torch.optim.

The demo CNN (pshard.worker.model, 28x28 grey images, batch 64), 1 worker (this process) and 2
parameter server processes in sync mode, SGD on the servers. Three loops over the same batches,
in turn, `--repeats` times (the best of each is used: the least disturbed run on a shared machine):

- local: forward, backward, `torch.optim.SGD.step()`; no servers;
- pstrainer: forward, backward, `PSTrainer.step()` (one fused push+pull after backward);
- overlap: `PSTrainer(overlap=True)`: buckets pushed during backward, weights landed per layer at
  the next forward.

The bar of issue 8: overlap >= 0.75x local.

    python -m bench.training [--steps 200] [--repeats 2] [--transport auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as python -m pshard.worker does (see PSTrainer)

from bench.common import emit, start_ps_servers, stop_processes

BATCH = 64
IMAGE = (1, 28, 28)
CLASSES = 10
LR = 0.05
BAR = 0.75


def _batches(steps: int, seed: int = 0) -> list[tuple[object, object]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, *IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(steps)]


def _model() -> object:
    import torch
    from pshard.worker.model import build_model

    torch.manual_seed(0)
    return build_model("cnn", IMAGE, CLASSES)


def _timed(step: object, batches: list[tuple[object, object]], warmup: int) -> float:
    """Steps/s of `step(x, y)` over `batches` after `warmup` untimed ones."""
    for x, y in batches[:warmup]:
        step(x, y)  # type: ignore[operator]
    started = time.perf_counter()
    for x, y in batches[warmup:]:
        step(x, y)  # type: ignore[operator]
    return (len(batches) - warmup) / (time.perf_counter() - started)


def local(batches: list[tuple[object, object]], warmup: int) -> float:
    import torch
    from torch.nn import functional as F

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # type: ignore[attr-defined]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # type: ignore[operator]
        optimizer.step()

    return _timed(step, batches, warmup)


def with_servers(batches: list[tuple[object, object]], warmup: int, overlap: bool, transport: str,
                 run: int) -> tuple[float, list[str]]:
    import torch
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker.client import PSClient
    from pshard.worker.torch_api import PSTrainer
    from torch.nn import functional as F

    servers = start_ps_servers(2, ["w0"], ["--transport", transport, "--mode", "sync", "--lr", str(LR)])
    try:
        model = _model()
        client = PSClient([s.address for s in servers], "w0", transport=transport)
        job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
        with PSTrainer(model, client, job, overlap=overlap) as trainer:

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                trainer.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[operator]
                trainer.step()

            rate = _timed(step, batches, warmup)
            trainer.synchronize()
            if trainer.clock != len(batches):
                raise RuntimeError(f"training run {run}: clock {trainer.clock}, expected {len(batches)}")
            return rate, list(client.transports)
    finally:
        stop_processes([s.proc for s in servers])


def training(steps: int = 200, warmup: int = 20, repeats: int = 2,
             transport: str = "auto") -> dict[str, object]:
    import torch

    batches = _batches(warmup + steps)
    runs: dict[str, list[float]] = {"local": [], "pstrainer": [], "overlap": []}
    transports: list[str] = []
    for run in range(repeats):
        runs["local"].append(local(batches, warmup))
        rate, _ = with_servers(batches, warmup, False, transport, run)
        runs["pstrainer"].append(rate)
        rate, transports = with_servers(batches, warmup, True, transport, run)
        runs["overlap"].append(rate)
    best = {name: max(rates) for name, rates in runs.items()}
    return {"model": "cnn", "batch": BATCH, "servers": 2, "workers": 1, "steps": steps,
            "transport": transport, "transports_used": transports, "torch_threads": torch.get_num_threads(),
            **{f"{name}_steps_per_s": round(rate, 1) for name, rate in best.items()},
            "samples_steps_per_s": {name: [round(r, 1) for r in rates] for name, rates in runs.items()},
            "ratio_pstrainer_to_local": round(best["pstrainer"] / best["local"], 3),
            "ratio_overlap_to_local": round(best["overlap"] / best["local"], 3), "bar": BAR}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--steps", type=int, default=200, help="timed steps per loop (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop, in turn (default 2)")
    p.add_argument("--transport", choices=("auto", "shm", "tcp", "grpc"), default="auto",
                   help="how push/pull bytes travel (default auto: shared memory on one host)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emit("training_steps", **training(args.steps, args.warmup, args.repeats, args.transport))
    return 0


if __name__ == "__main__":
    sys.exit(main())
