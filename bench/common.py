"""What every benchmark shares: the machine description, JSON lines, server processes, timing.

Every process is started with spawn or subprocess, never a bare fork: grpc's
threads do not survive fork(). Times are time.monotonic(), which on Linux is one
clock for every process, so spans can be taken across workers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MB = 10**6  # figures are in decimal megabytes


def machine() -> dict[str, object]:
    """The description every figure carries, with the load at the time it was taken."""
    import grpc
    import numpy

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # glibc malloc tuning changes the figures a lot (see bench.run_all), so it is part of the description.
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "grpcio": grpc.__version__, "numpy": numpy.__version__, "platform": platform.platform(),
            "malloc_env": malloc}


def load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def emit(figure: str, **values: object) -> dict[str, object]:
    """Print one figure as a JSON line (flushed, so a pipe sees it at once) and return it."""
    record: dict[str, object] = {"figure": figure, **values, "load1": load_average(), "machine": machine()}
    print(json.dumps(record), flush=True)
    return record


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summarize_latencies(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p99/mean in microseconds."""
    return {"p50_us": round(percentile(samples_s, 50) * 1e6, 1),
            "p99_us": round(percentile(samples_s, 99) * 1e6, 1),
            "mean_us": round(statistics.fmean(samples_s) * 1e6, 1)}


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_ps_servers(count: int, workers: Sequence[str], extra: Sequence[str] = (),
                     timeout_s: float = 60.0, profile_dir: str | None = None) -> list[ServerProcess]:
    """`count` parameter servers (python -m pshard.ps_server) on 127.0.0.1, quorum `workers`.

    They are started together (Python start-up is most of their start-up time) and
    each is ready once it prints its port. With `profile_dir` each runs under cProfile
    (its event loop, hence every handler, is on the main thread) and writes serverN.prof
    when stopped.
    """
    args = ["--bind", "127.0.0.1:0", "--no-scheduler", "--workers", ",".join(workers),
            "--log-level", "WARNING", *extra]

    def command(i: int) -> list[str]:
        if profile_dir:
            return [sys.executable, "-m", "cProfile", "-o", str(Path(profile_dir) / f"server{i}.prof"),
                    "-m", "pshard.ps_server", *args]
        return [sys.executable, "-m", "pshard.ps_server", *args]

    cmd = command(0)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TF_CONFIG", None)
    procs = [subprocess.Popen(command(i), cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
             for i in range(count)]
    servers = []
    try:
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            line = ""
            while "listening on port" not in line:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"parameter server did not start (exit code {proc.poll()}); "
                                       f"command: {' '.join(cmd)}")
                line = proc.stdout.readline()  # type: ignore[union-attr]
            servers.append(ServerProcess(proc, int(line.rsplit(" ", 1)[1])))
    except BaseException:
        stop_processes(procs)
        raise
    return servers


def start_task(plan: Any, task: Any, argv: Sequence[str], log: Path | None = None) -> subprocess.Popen[str]:
    """`python -m ARGV` as `task` of the launcher's ClusterPlan `plan` (its TF_CONFIG), warnings only, its
    output dropped; with `log`, its INFO log goes to that file (for `await_log_line`)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TF_CONFIG": plan.tf_config(task)}
    out = subprocess.DEVNULL if log is None else log.open("w")
    level = "WARNING" if log is None else "INFO"
    try:
        return subprocess.Popen([sys.executable, "-m", *argv, "--log-level", level], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]  # the child holds its own copy


def await_log_line(log: Path, text: str, timeout_s: float = 60.0) -> None:
    """Until a line of the file `log` (start_task's) contains `text`; RuntimeError after `timeout_s`. A
    bench that must act once a state is reached waits for the line that reports it, not for a count of
    steps that usually comes after it."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log}: no line with {text!r} within {timeout_s:g} s")
        time.sleep(0.05)


def await_serving(addresses: Sequence[str], what: str, timeout_s: float = 60.0) -> None:
    """Until every one of `addresses` answers gRPC health checks; RuntimeError naming the first that did not
    within `timeout_s`, `what` saying whose it is."""
    from pshard.common.rpc.health import probe

    deadline = time.monotonic() + timeout_s
    for address in addresses:
        while not probe(address, timeout_s=1.0)[0]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {address} did not start")
            time.sleep(0.1)


def stop_processes(procs: Sequence[subprocess.Popen[str]], grace_s: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the dense model ----

# 25M float32 parameters in 16 tensors: one of 8M, eight of 2M, seven small ones (1M together).
DEFAULT_SIZES = "8000000,2000000*8,400000,300000,200000,50000,30000,15000,5000"


def parse_sizes(text: str) -> list[int]:
    """"8000000,2000000*8,5000" -> [8000000, 2000000, ... (8 times), 5000]."""
    sizes: list[int] = []
    for item in text.split(","):
        count = 1
        if "*" in item:
            item, times = item.split("*", 1)
            count = int(times)
        sizes.extend([int(item)] * count)
    if not sizes or any(n <= 0 for n in sizes):
        raise ValueError(f"sizes: got {text!r}, expected positive element counts like 8000000,2000000*8")
    return sizes


# ---- worker processes ----

@dataclass(frozen=True)
class WorkerRun:
    """What a benchmark's worker function gets: its index and the shared start barrier."""

    index: int
    barrier: object  # multiprocessing Barrier: wait() before warm-up and before the timed steps

    def sync(self) -> None:
        self.barrier.wait(timeout=300)  # type: ignore[attr-defined]


def _worker_entry(target: object, run: WorkerRun, args: tuple, results: object) -> None:
    import traceback

    try:
        out = target(run, *args)  # type: ignore[operator]
        results.put((run.index, out, None))  # type: ignore[attr-defined]
    except BaseException:
        results.put((run.index, None, traceback.format_exc()))  # type: ignore[attr-defined]
        run.barrier.abort()  # type: ignore[attr-defined]


def run_workers(target: object, count: int, args: tuple, timeout_s: float = 600.0) -> list[dict]:
    """Run target(WorkerRun, *args) in `count` spawned processes; their returned dicts, by index.

    A worker's dict must hold `start` and `end` (time.monotonic() around its timed steps).
    """
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(count)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker_entry, args=(target, WorkerRun(i, barrier), args, results),
                         daemon=True) for i in range(count)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) + len(errors) < count:
            try:
                index, value, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"workers did not finish within {timeout_s:.0f}s") from None
            if error:
                errors.append(f"worker {index}:\n{error}")
            else:
                out[index] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[i] for i in range(count)]


def span_s(results: Sequence[dict]) -> float:
    """Wall time of the timed steps of all workers together."""
    return max(r["end"] for r in results) - min(r["start"] for r in results)


def rss_mb(pid: int) -> float:
    """Resident set size of a process (decimal MB), from /proc; 0.0 elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process (all its threads) so far, or of one of its threads (`thread`:
    its id; the process id: the main thread, a server's event loop), from /proc; 0.0 elsewhere."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds used by some server processes and by this process between start() and stop()."""

    def __init__(self, server_pids: Sequence[int]) -> None:
        self._pids = list(server_pids)
        self._servers = 0.0
        self._loops = 0.0  # the servers' main threads: their event loops, each a serial bound of its own
        self._own = 0.0

    def start(self) -> None:
        self._servers = -sum(cpu_seconds(p) for p in self._pids)
        self._loops = -sum(cpu_seconds(p, p) for p in self._pids)
        self._own = -time.process_time()

    def stop(self) -> None:
        self._servers += sum(cpu_seconds(p) for p in self._pids)
        self._loops += sum(cpu_seconds(p, p) for p in self._pids)
        self._own += time.process_time()

    def result(self) -> dict[str, float]:
        return {"server_cpu_s": self._servers, "server_loop_cpu_s": self._loops, "own_cpu_s": self._own}


def cpu_figures(results: Sequence[dict], steps: int, elapsed_s: float) -> dict[str, object]:
    """CPU seconds per step of the servers (and of their event-loop threads) and the workers, and how
    busy that kept the machine.

    Every worker measured the servers over its own window; the windows are nearly the same,
    so their mean is used.
    """
    servers = statistics.fmean(r["server_cpu_s"] for r in results)
    loops = statistics.fmean(r.get("server_loop_cpu_s", 0.0) for r in results)
    workers = sum(r["own_cpu_s"] for r in results)
    cores = os.cpu_count() or 1
    return {"server_cpu_s_per_step": round(servers / steps, 4),
            "server_loop_cpu_s_per_step": round(loops / steps, 4),
            "worker_cpu_s_per_step": round(workers / steps, 4),
            "cpu_busy_fraction": round((servers + workers) / (elapsed_s * cores), 3)}


def dense_job(run: WorkerRun, sched: Any, servers: Sequence[str], sizes: Sequence[int], replicas: int
              ) -> tuple[dict[str, Any], dict[str, Any], Any, Any]:
    """A sync SGD job of float32 tensors of `sizes` on `servers` with `replicas`, seeded by the worker's
    index: (params, grads, the layout the scheduler `sched` planned, the JobConfig)."""
    import numpy as np
    from pshard.common.cluster.layout import ParamSpec
    from pshard.common.job import JobConfig, OptimizerConfig

    rng = np.random.default_rng(run.index)
    params = {f"t{i:02d}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    grads = {k: rng.standard_normal(v.size, dtype=np.float32) for k, v in params.items()}
    layout = sched.propose_layout([ParamSpec(k, "float32", v.shape) for k, v in params.items()],
                                  servers=list(servers), replicas=replicas)
    return params, grads, layout, JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1e-4))


def timed_steps(client: Any, grads: dict[str, Any], weights: dict[str, Any], run: WorkerRun, warmup: int,
                steps: int, around: AbstractContextManager[object] | None = None
                ) -> tuple[int, list[float], float, float]:
    """`warmup` fused steps, every worker lined up, then `steps` timed ones, inside `around` when given
    (what a bench measures over the timed steps only): (the next clock, each timed step's seconds, when
    they started, when they ended)."""
    run.sync()
    clock = 0
    for _ in range(warmup):
        client.push_pull(grads, clock, out=weights)
        clock += 1
    run.sync()
    steps_s: list[float] = []
    with around or nullcontext():
        start = time.monotonic()
        for _ in range(steps):
            began = time.monotonic()
            client.push_pull(grads, clock, out=weights)
            clock += 1
            steps_s.append(time.monotonic() - began)
        end = time.monotonic()
    return clock, steps_s, start, end

