"""Coordinator-driven training (issue 21): a scheduled no-op's overhead, and training steps/s against
today's worker-driven loop in the same run.

A scheduler, 2 parameter servers and 2 serving workers (`pshard worker --serve`) run as processes; this
process is the coordinator (the chief). Figures:

- noop: `schedule(noop).fetch()` one at a time, p50 and p99 (dispatch, the call on its worker's
  Serve stream, the result); and `--noops` no-ops scheduled at once, calls/s over the 2 workers;
- training: the demo's MLP (28x28, batch 64, synthetic batches), `--steps` scheduled steps (forward and
  backward on the weights the worker's last step got back, one fused push+pull) over the 2 workers,
  against the same model and steps trained by 2 worker processes that each run their own loop with
  PSTrainer (one fused push+pull per step) on 2 servers of their own, async mode both. The two loops
  alternate `--repeats` times: on a shared machine whose load swings within a minute, loops run far
  apart would measure the load. Bar: coordinator >= 0.8x worker-driven.

    python -m bench.coordinator [--steps 400] [--repeats 2]        (make bench-coordinator)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as python -m pshard.worker does

from bench.common import (
    REPO,
    WorkerRun,
    cpu_seconds,
    emit,
    percentile,
    run_workers,
    span_s,
    start_ps_servers,
    stop_processes,
)

BATCH = 64
IMAGE = (1, 28, 28)
LR = 0.05
BAR = 0.8
# Per serving worker process: the model, and numpy views of its parameters, where pulled weights land.
_models: dict[str, Any] = {}


def noop() -> None:
    return None


def synthetic_batches(seed: int) -> Iterator[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    pool = [(torch.randn(BATCH, *IMAGE, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(16)]
    while True:
        yield from pool


def train_step(batches: Iterator[tuple[Any, Any]]) -> float:
    """The scheduled step: forward and backward one batch on the weights the worker's last step got back,
    push the gradients and get the next weights in one round trip, landing in the model's parameters (as
    PSTrainer's step: nothing to load)."""
    from pshard.coordinator.context import current
    from pshard.worker.model import build_model
    from torch.nn import functional as F

    ctx = current()
    if "mlp" not in _models:
        _models["mlp"] = model = build_model("mlp", IMAGE, 10)
        _models["views"] = {name: p.detach().numpy() for name, p in model.named_parameters()}
    model, views = _models["mlp"], _models["views"]
    ctx.latest(out=views)  # a copy only on the worker's first step
    x, y = next(batches)
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    ctx.push_pull({name: p.grad.numpy() for name, p in model.named_parameters()}, out=views)
    return loss.item()


# ---- the coordinator's cluster ----

def start_cluster(workers: int) -> tuple[dict[str, subprocess.Popen[str]], dict[str, str], str]:
    """Scheduler, 2 servers and `workers` serving workers as processes; (processes by task name, env, the
    chief's TF_CONFIG)."""
    from pshard.common.rpc.health import probe
    from pshard.launcher.plan import ClusterPlan

    plan = ClusterPlan.allocate(2, workers, chief=True)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    procs: dict[str, subprocess.Popen[str]] = {}

    def start(task: Any, *argv: str) -> None:
        procs[task.name] = subprocess.Popen([sys.executable, *argv, "--log-level", "WARNING"], cwd=REPO,
                                            env={**env, "TF_CONFIG": plan.tf_config(task)}, text=True)

    for task in plan.servers:
        module = "pshard.scheduler" if task.task_type == "scheduler" else "pshard.ps_server"
        start(task, "-m", module, "--bind", task.address)
    deadline = time.monotonic() + 60
    for task in plan.servers:
        while not probe(task.address, timeout_s=1.0)[0]:
            if time.monotonic() > deadline:
                stop_processes(list(procs.values()))
                raise RuntimeError(f"{task.name} did not become healthy")
            time.sleep(0.1)  # polling a health check that has its own timeout
    for task in plan.trainers:
        if task.task_type == "worker":
            start(task, "-m", "pshard.worker", "--serve")
    chief = next(t for t in plan.trainers if t.task_type == "chief")
    return procs, env, plan.tf_config(chief)


def noop_figures(coordinator: Any, calls: int, burst: int) -> dict[str, object]:
    for _ in range(20):
        coordinator.schedule(noop).fetch()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        coordinator.schedule(noop).fetch()
        samples.append(time.perf_counter() - start)
    start = time.perf_counter()
    for r in [coordinator.schedule(noop) for _ in range(burst)]:
        r.fetch()
    took = time.perf_counter() - start
    return {"serial_calls": calls, "p50_ms": round(percentile(samples, 50) * 1e3, 3),
            "p99_ms": round(percentile(samples, 99) * 1e3, 3), "burst_calls": burst,
            "burst_calls_per_s": round(burst / took, 1)}


class CpuTimes:
    """CPU seconds (user + system, every thread, from /proc) of named processes over timed windows, summed
    over the windows: the evidence of what a step costs whatever else the machine runs."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.seconds = dict.fromkeys(pids, 0.0)
        self._at: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {role: time.process_time() if pid == os.getpid() else cpu_seconds(pid)
                for role, pid in self.pids.items()}

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> None:
        for role, now in self._now().items():
            self.seconds[role] += now - self._at[role]


def cpu_ms_per_step(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Per role, and `total` over every process: ms of CPU per training step."""
    table = {role: round(s * 1e3 / steps, 3) for role, s in sorted(seconds.items())}
    table["total"] = round(sum(seconds.values()) * 1e3 / steps, 3)
    return table


def coordinator_steps(coordinator: Any, iterator: Any, steps: int, cpu: CpuTimes | None = None) -> float:
    if cpu is not None:
        cpu.start()
    start = time.perf_counter()
    for r in [coordinator.schedule(train_step, args=(iterator,)) for _ in range(steps)]:
        r.fetch()
    took = time.perf_counter() - start
    if cpu is not None:
        cpu.stop()
    return steps / took


# ---- today's worker-driven loop ----

def _own_loop(run: WorkerRun, servers: list[str], steps: int, warmup: int,
              server_pids: list[int]) -> dict[str, Any]:
    import torch
    from pshard.client.ps_client import PSClient
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker.model import build_model
    from pshard.worker.torch_api import PSTrainer
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = build_model("mlp", IMAGE, 10)
    client = PSClient(servers, f"w{run.index}")
    job = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=LR))
    batches = synthetic_batches(run.index)
    with PSTrainer(model, client, job) as trainer:
        def step() -> None:
            x, y = next(batches)
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.step()

        run.sync()
        for _ in range(warmup):
            step()
        run.sync()
        cpu = CpuTimes({"own": os.getpid(), **{f"ps-{i}": pid for i, pid in enumerate(server_pids)}})
        cpu.start()
        start = time.monotonic()
        for _ in range(steps):
            step()
        trainer.synchronize()
        end = time.monotonic()
        cpu.stop()
        return {"start": start, "end": end, "cpu_s": cpu.seconds}


def worker_driven_steps(workers: int, steps: int, cpu_s: dict[str, float]) -> float:
    """Steps/s of `workers` PSTrainer loops on 2 servers of their own; adds each process's CPU seconds over
    the timed steps to `cpu_s` (the servers' as the mean of the workers' windows, nearly the same)."""
    ids = [f"w{i}" for i in range(workers)]
    servers = start_ps_servers(2, ids, ["--mode", "async", "--lr", str(LR)])
    try:
        results = run_workers(_own_loop, workers, ([s.address for s in servers], steps // workers, 20,
                                                   [s.proc.pid for s in servers]))
    finally:
        stop_processes([s.proc for s in servers])
    for i, r in enumerate(results):
        cpu_s[f"worker-{i}"] = cpu_s.get(f"worker-{i}", 0.0) + r["cpu_s"]["own"]
    for i in range(len(servers)):
        role = f"ps-{i}"
        cpu_s[role] = cpu_s.get(role, 0.0) + sum(r["cpu_s"][role] for r in results) / len(results)
    return (steps // workers) * workers / span_s(results)


def coordinator_bench(steps: int, repeats: int, calls: int, burst: int,
                      workers: int = 2) -> dict[str, object]:
    import numpy as np
    import torch
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.coordinator.coordinator import ClusterCoordinator
    from pshard.worker.model import build_model
    from pshard.worker.session import ClusterSession

    procs, _, chief = start_cluster(workers)
    cpu = CpuTimes({"coordinator": os.getpid(), **{name: p.pid for name, p in procs.items()}})
    own_cpu: dict[str, float] = {}
    try:
        session = ClusterSession.from_environment({"TF_CONFIG": chief}, startup_timeout_s=60.0)
        job = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=LR))
        with ClusterCoordinator(job, session=session) as coordinator:
            torch.manual_seed(0)
            coordinator.create_variables(dict(build_model("mlp", IMAGE, 10).state_dict()))
            iterator = iter(coordinator.create_per_worker_dataset(synthetic_batches, 0))
            noops = noop_figures(coordinator, calls, burst)
            coordinator_steps(coordinator, iterator, 20 * workers)  # warm-up: models built, paths negotiated
            runs: list[tuple[float, float]] = []
            for _ in range(repeats):
                coordinated = coordinator_steps(coordinator, iterator, steps, cpu)
                runs.append((coordinated, worker_driven_steps(workers, steps, own_cpu)))
            coord_rate = float(np.mean([c for c, _ in runs]))
            own_rate = float(np.mean([w for _, w in runs]))
            return {"noop": noops, "workers": workers, "servers": 2, "model": "mlp", "batch": BATCH,
                    "steps": steps, "repeats": repeats, "coordinator_steps_per_s": round(coord_rate, 1),
                    "worker_driven_steps_per_s": round(own_rate, 1),
                    "samples": [[round(c, 1), round(w, 1)] for c, w in runs],
                    "ratio": round(coord_rate / own_rate, 3), "bar": BAR,
                    "cpu_ms_per_step": {"coordinator": cpu_ms_per_step(cpu.seconds, steps * repeats),
                                        "worker_driven": cpu_ms_per_step(own_cpu, steps * repeats)},
                    "cpu_ratio": round(sum(own_cpu.values()) / sum(cpu.seconds.values()), 3),
                    "redispatched": coordinator.redispatched}
    finally:
        stop_processes(list(procs.values()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--steps", type=int, default=400, help="timed training steps per loop (default 400)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop, in turn (default 2)")
    p.add_argument("--calls", type=int, default=300, help="serial no-op calls timed (default 300)")
    p.add_argument("--noops", type=int, default=1000, help="no-ops scheduled at once (default 1000)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = emit("coordinator", **coordinator_bench(args.steps, args.repeats, args.calls, args.noops))
    print(f"no-op p50 {record['noop']['p50_ms']} ms, p99 {record['noop']['p99_ms']} ms; "  # type: ignore[index]
          f"training {record['coordinator_steps_per_s']} steps/s vs worker-driven "
          f"{record['worker_driven_steps_per_s']}: {record['ratio']}x (bar {BAR}); CPU ms per step "
          f"{record['cpu_ms_per_step']['coordinator']['total']} vs "  # type: ignore[index]
          f"{record['cpu_ms_per_step']['worker_driven']['total']}: "  # type: ignore[index]
          f"{record['cpu_ratio']}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
