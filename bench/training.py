"""Training steps/s with the parameter servers, as a ratio to the same loop with a local torch.optim.

The demo CNN (pshard.worker.model, 28x28 grey images, batch 64), 1 worker (this process) and 2
parameter server processes in sync mode, SGD on the servers. Three loops over the same batches:

- local: forward, backward, `torch.optim.SGD.step()`; no servers;
- pstrainer: forward, backward, `PSTrainer.step()` (one fused push+pull after backward);
- overlap: `PSTrainer(overlap=True)`: buckets pushed during backward, weights landed per layer at
  the next forward;
- priority: `PSTrainer(overlap=True, priority=True)`: the same, pushes by layer priority and pulls apart,
  first layers first (issue 19).

Each server loop is timed in blocks of `--block` steps alternating with blocks of the local loop (its
own model), `--repeats` times, and its ratio is its steps/s over the local loop's in the same blocks.
On a shared 2-core machine whose load swings from 1 to 6 within a minute, loops run one after the
other measured the load as much as the trainer (the same code gave 0.71x and 0.87x of local); an
overlapped block ends with `synchronize()`, so no step of it is left for the next local block.

The bar of issue 8: >= 0.75x local.

    python -m bench.training [--steps 200] [--repeats 2] [--transport auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

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


def _local_step() -> Callable[..., None]:
    import torch
    from torch.nn import functional as F

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # type: ignore[attr-defined]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # type: ignore[operator]
        optimizer.step()

    return step


def _interleaved(local: Callable[..., None], served: Callable[..., None],
                 settle: Callable[[], None], batches: list[tuple[object, object]], warmup: int,
                 block: int) -> tuple[float, float]:
    """(local, served) seconds over the same timed batches, in alternating blocks of `block` steps."""
    for x, y in batches[:warmup]:
        local(x, y)
        served(x, y)
    settle()
    spent = [0.0, 0.0]
    timed = batches[warmup:]
    for start in range(0, len(timed), block):
        for which, step in enumerate((local, served)):
            began = time.perf_counter()
            for x, y in timed[start:start + block]:
                step(x, y)
            if which:
                settle()
            spent[which] += time.perf_counter() - began
    return spent[0], spent[1]


def with_servers(batches: list[tuple[object, object]], warmup: int, overlap: bool, transport: str,
                 run: int, block: int, priority: bool = False) -> tuple[float, float, list[str]]:
    """(local seconds, PSTrainer seconds, transports) over the timed batches, interleaved."""
    import torch
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker.torch_api import PSTrainer
    from torch.nn import functional as F

    local = _local_step()
    servers = start_ps_servers(2, ["w0"], ["--transport", transport, "--mode", "sync", "--lr", str(LR)])
    try:
        model = _model()
        client = PSClient([s.address for s in servers], "w0", transport=transport)
        job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
        with PSTrainer(model, client, job, overlap=overlap, priority=priority) as trainer:

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                trainer.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[operator]
                trainer.step()

            local_s, served_s = _interleaved(local, step, trainer.synchronize, batches, warmup, block)
            if trainer.clock != len(batches):
                raise RuntimeError(f"training run {run}: clock {trainer.clock}, expected {len(batches)}")
            return local_s, served_s, list(client.transports)
    finally:
        stop_processes([s.proc for s in servers])


def training(steps: int = 200, warmup: int = 20, repeats: int = 2, transport: str = "auto",
             block: int = 25) -> dict[str, object]:
    import torch

    batches = _batches(warmup + steps)
    # Seconds per run, each server loop with the local blocks interleaved with it.
    spent: dict[str, list[tuple[float, float]]] = {"pstrainer": [], "overlap": [], "priority": []}
    transports: list[str] = []
    for run in range(repeats):
        for name in spent:
            local_s, served_s, transports = with_servers(batches, warmup, name != "pstrainer", transport, run,
                                                         block, priority=name == "priority")
            spent[name].append((local_s, served_s))
    rate = {name: steps * len(runs) / sum(s for _, s in runs) for name, runs in spent.items()}
    ratio = {name: sum(local for local, _ in runs) / sum(s for _, s in runs) for name, runs in spent.items()}
    local_runs = [local for runs in spent.values() for local, _ in runs]
    return {"model": "cnn", "batch": BATCH, "servers": 2, "workers": 1, "steps": steps, "block": block,
            "transport": transport, "transports_used": transports, "torch_threads": torch.get_num_threads(),
            "local_steps_per_s": round(steps * len(local_runs) / sum(local_runs), 1),
            **{f"{name}_steps_per_s": round(r, 1) for name, r in rate.items()},
            "samples_steps_per_s": {"local": [round(steps / s, 1) for s in local_runs],
                                    **{name: [round(steps / s, 1) for _, s in runs]
                                       for name, runs in spent.items()}},
            "samples_ratio": {name: [round(local / s, 3) for local, s in runs]
                              for name, runs in spent.items()},
            "ratio_pstrainer_to_local": round(ratio["pstrainer"], 3),
            "ratio_overlap_to_local": round(ratio["overlap"], 3),
            "ratio_priority_to_local": round(ratio["priority"], 3), "bar": BAR}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--steps", type=int, default=200, help="timed steps per loop (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each server loop, in turn (default 2)")
    p.add_argument("--block", type=int, default=25,
                   help="steps per block, local and server loops alternating (default 25)")
    p.add_argument("--transport", choices=("auto", "shm", "tcp", "grpc"), default="auto",
                   help="how push/pull bytes travel (default auto: shared memory on one host)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emit("training_steps", **training(args.steps, args.warmup, args.repeats, args.transport, args.block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
