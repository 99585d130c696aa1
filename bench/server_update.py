"""A server's dense optimizer update, alone: ResNet-18's 11.7 M parameters in 4 MiB slices.

What one parameter server spends per step applying one worker's gradients, with the update of each
slice split over `--threads` threads (pshard.common.chunks; 1 = the single-threaded update), for SGD
with momentum and Adam. No network, no processes: the store's own Slot.apply on real slices.

    python -m bench.server_update [--threads 1,2,4] [--steps 10] [--params 11689512]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from pshard.common.chunks import ChunkPool, available_cores
from pshard.common.job import OptimizerConfig
from pshard.common.types import SliceKey
from pshard.ps_server.core.optimizers import make_optimizer
from pshard.ps_server.core.policies import Slot

SLICE_ELEMENTS = 2**20  # 4 MiB of float32: the client's default slice size (common.cluster.layout)
OPTIMIZERS = {"sgd_momentum": OptimizerConfig(name="sgd", lr=0.01, momentum=0.9),
              "adam": OptimizerConfig(name="adam", lr=0.001)}


def slices(params: int) -> list[int]:
    full, rest = divmod(params, SLICE_ELEMENTS)
    return [SLICE_ELEMENTS] * full + ([rest] if rest else [])


def measure(config: OptimizerConfig, threads: int, params: int, steps: int) -> float:
    """Milliseconds per step (every slice updated once), the best of `steps`."""
    pool = ChunkPool(threads)
    rng = np.random.default_rng(0)
    optimizer = make_optimizer(config)
    slots = []
    for i, n in enumerate(slices(params)):
        value = rng.standard_normal(n, dtype=np.float32)
        slots.append(Slot(key=SliceKey("w", i), dtype=value.dtype, value=value, optimizer=optimizer,
                          opt_state=optimizer.init_state(value), pool=pool))
    grads = [rng.standard_normal(s.value.size, dtype=np.float32) for s in slots]
    best = float("inf")
    try:
        for _ in range(steps + 1):  # the first step pays the page faults of the state and scratch
            began = time.perf_counter()
            for slot, grad in zip(slots, grads, strict=True):
                slot.apply(grad)
            best = min(best, time.perf_counter() - began)
    finally:
        pool.close()
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2,4", help="comma-separated thread counts (default: 1,2,4)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case; the best is kept")
    parser.add_argument("--params", type=int, default=11_689_512, help="parameters (default: ResNet-18's)")
    args = parser.parse_args(argv)
    for name, config in OPTIMIZERS.items():
        for threads in (int(t) for t in args.threads.split(",")):
            ms = measure(config, threads, args.params, args.steps)
            print(json.dumps({"figure": "server_update", "optimizer": name, "params": args.params,
                              "threads": threads, "cores": available_cores(), "ms_per_step": round(ms, 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
