"""The device check of issue 25: CUDA tests, PSTrainer against local torch.optim, and CTR, on one GPU.

One command on a bare GPU machine (bench/gpu_check.sh, or `make gpu-check` here). Each figure is a JSON
line appended to --out and flushed at once, so whatever finished comes back even if the run is cut
short. The first line describes the environment; each section is guarded (a failure is recorded as
its line's "error" and the next section still runs) and has a time budget; the last line is a
summary against the issue's bars, also printed as the final line on stdout:

- server_update: one server's optimizer update of ResNet-18's 11.7 M parameters (SGD with momentum,
  Adam), ms per step on one thread and on the server's default pool (bench.server_update);
- cuda_tests: `pytest -m cuda` in a subprocess: passed / failed / skipped, the failing tests' names;
- training: the demo CNN and a ResNet-18 (11.7 M parameters, 224x224, batch 128 on a GPU) on synthetic
  data, 2 parameter servers on the CPU over shared memory; 1 worker (this process, its blocks of steps
  alternating with local torch.optim's on the same GPU) and 2 spawned workers sharing the GPU, with and
  without overlap=True. Bar: the 1-worker ResNet-18 PSTrainer >= 0.7x local;
- profile (within training, right after the first model's 1-worker runs; bench.gpu_profile): a
  diagnostic, not a figure to quote. The copy floor (one flat memcpy, D2H and H2D of the model's
  bytes), local torch.optim's forward/backward/step, and PSTrainer's step split into phases (forward,
  backward, D2H, push_pull and its shared-memory copies and server wait, H2D, waits on replies) as
  mean ms per step, without overlap, with it, and with it in 256 KiB buckets (the default is 4 MiB);
  whether the host buffers are pinned, copy calls per step, bucket count. Its steps are cut by
  torch.cuda.synchronize();
- ctr: the CTR demo's model (a PSEmbedding table and an MLP) for a fixed number of steps on the GPU,
  then on the CPU: samples/s of each. Bar: GPU >= 3x CPU.

--device cpu --quick runs every section small (the demo CNN only) in well under 2 minutes, so the
script is exercised by the test suite (tests/e2e/test_gpu_check.py) and cannot rot.

    python -m bench.gpu_check --out gpu_check.jsonl [--device auto|cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
# The folders the installed package is built from (pyproject.toml's package-dir) and its protos.
PACKAGE_SOURCES = ("pshard", "common", "ps_server", "worker", "scheduler", "launcher", "proto")
TRAINING_BAR = 0.7  # 1-worker ResNet-18 PSTrainer / local torch.optim, shared memory
CTR_BAR = 3.0  # GPU samples/s / CPU samples/s
CUDA_TESTS = ("tests/cuda", "tests/unit/test_model_device.py")
# Seconds per section on a GPU (the whole check must end within the device's 8 minutes, with room).
BUDGET_S = {"cuda_tests": 120.0, "training": 230.0, "ctr": 60.0}
# Of the training budget: the diagnostic split of a step into phases (bench.gpu_profile).
PROFILE_BUDGET_S = 30.0


class Recorder:
    """JSON lines to a file, each flushed as it is written, plus a short progress line on stdout."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def write(self, figure: str, **values: Any) -> dict[str, Any]:
        record = {"figure": figure, "elapsed_s": round(time.monotonic() - self.started, 1), **values}
        self.records.append(record)
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        shown = {k: v for k, v in record.items() if k not in ("traceback", "failed_tests", "skip_reasons")}
        print(f"gpu-check: {json.dumps(shown)}", flush=True)
        return record


def guarded(rec: Recorder, section: str, body: Callable[[], object]) -> None:
    """Run one section; an exception is recorded (with its traceback's tail) and the check goes on."""
    began = time.monotonic()
    try:
        body()
    except Exception as exc:  # a section's failure must not cost the figures of the others
        rec.write(f"{section}_error", error=f"{type(exc).__name__}: {exc}"[:2000],
                  traceback=traceback.format_exc()[-4000:], seconds=round(time.monotonic() - began, 1))


def environment(device: Any) -> dict[str, Any]:
    import grpc
    import numpy
    import torch


    env: dict[str, Any] = {
        "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "grpcio": grpc.__version__, "numpy": numpy.__version__, "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), **carry_state(), "platform": platform.platform()}
    try:
        import numba

        env["numba"] = numba.__version__
    except ImportError as exc:
        env["numba"] = f"missing: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                   gpu_count=torch.cuda.device_count(), driver=_driver_version())
    return env


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        lines = out.stdout.strip().splitlines()
        return lines[0] if out.returncode == 0 and lines else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def kernels_check(rec: Recorder, quick: bool) -> None:
    """The sparse tables' numba kernels (an llvm prefetch intrinsic, written for numba 0.68.1's LLVM)
    compiled for every dtype on this machine's numba: if they do not, the CTR figures cannot exist."""
    import numba
    from pshard.ps_server.tables import kernels

    began = time.monotonic()
    # The cache (NUMBA_CACHE_DIR) is shared with the servers started later: they load, not compile.
    dtypes = kernels.DTYPES[:1] if quick else kernels.DTYPES
    for dtype in dtypes:
        kernels.warm(dtype)
    rec.write("numba_kernels", ok=True, numba=numba.__version__, dtypes=[str(d) for d in dtypes],
              seconds=round(time.monotonic() - began, 1))


def server_update_check(rec: Recorder, quick: bool) -> None:
    """A server's dense update of ResNet-18's parameters (bench.server_update) on one thread and on the
    pool a server here gets by default: the host-side part of the training bar, measured alone."""
    from pshard.common.chunks import available_cores, default_threads

    from bench import server_update

    params, steps = (2**20, 2) if quick else (11_689_512, 5)
    for name, config in server_update.OPTIMIZERS.items():
        began = time.monotonic()
        ms = {t: server_update.measure(config, t, params, steps) for t in sorted({1, default_threads()})}
        rec.write("server_update", optimizer=name, params=params, cores=available_cores(),
                  default_threads=default_threads(),
                  ms_by_threads={str(t): round(v, 2) for t, v in ms.items()},
                  seconds=round(time.monotonic() - began, 1))


def source_digest(root: Path = REPO) -> str:
    """sha256 over the package's source files: the carry records the one it was built from, so a run
    on a tree that has changed since says so instead of measuring stale code."""
    digest = hashlib.sha256()
    for folder in PACKAGE_SOURCES:
        for path in sorted((root / folder).rglob("*")):
            generated = "_pb2" in path.name or "__pycache__" in path.parts
            if path.suffix in (".py", ".proto") and not generated:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def carry_state() -> dict[str, Any]:
    """Where pshard comes from, and whether a carried copy matches this tree's sources."""
    import pshard

    carry = REPO / ".gpu-carry"
    state: dict[str, Any] = {"pshard_file": pshard.__file__, "source_digest": source_digest()}
    if Path(pshard.__file__).resolve().is_relative_to(carry.resolve()):
        built = (carry / "DIGEST").read_text().strip() if (carry / "DIGEST").exists() else None
        state.update(carry_digest=built, carry_matches_tree=built == state["source_digest"])
    return state


# ---- a. the CUDA tests ----

def cuda_tests(rec: Recorder, budget_s: float) -> None:
    """pytest -m cuda in a subprocess; pshard is imported before pytest puts the repository first on
    sys.path, so the tests use the installed package (on the GPU machine: the carried one)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code = ("import sys, pshard, pytest; print('pshard from', pshard.__file__, flush=True); "
                "sys.exit(pytest.main(sys.argv[1:]))")
        argv = [sys.executable, "-P", "-c", code, "-m", "cuda", "-q", "-p", "no:cacheprovider",
                f"--rootdir={REPO}", f"--junitxml={junit}", *CUDA_TESTS]
        began = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=budget_s)
            output, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            partial_out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
            output, rc = f"{partial_out or ''}\n... timed out after {budget_s:.0f}s", -1
        counts = _junit_counts(junit) if junit.exists() else {}
    imported = next((line.split(" ", 2)[2] for line in output.splitlines()
                     if line.startswith("pshard from ")), None)
    rec.write("cuda_tests", exit_code=rc, **counts, pshard_file=imported,
              seconds=round(time.monotonic() - began, 1),
              output_tail=output[-3000:] if rc not in (0, 5) else "")


def _junit_counts(path: Path) -> dict[str, Any]:
    failed: list[str] = []
    skips: set[str] = set()
    passed = skipped = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped += 1
            skips.add(skip.get("message", ""))
        else:
            passed += 1
    return {"passed": passed, "failed": len(failed), "skipped": skipped, "failed_tests": failed,
            "skip_reasons": sorted(skips)}


# ---- b. training ----

def training(rec: Recorder, device: Any, quick: bool, budget_s: float) -> None:
    from bench import gpu_runs

    deadline = time.monotonic() + budget_s
    runs = [(1, False), (1, True), (2, True)] if quick else [(1, False), (1, True), (2, False), (2, True)]
    for index, shape in enumerate(gpu_runs.training_shapes(device.type == "cuda", quick)):
        local_rates: list[float] = []  # this model's local loop, from its 1-worker runs
        for run, (workers, overlap) in enumerate(runs):
            if index == 0 and run == 2:  # right after the first model's 1-worker runs
                left = deadline - time.monotonic()
                if left < PROFILE_BUDGET_S + 40:
                    rec.write("profile", skipped=f"training budget spent ({budget_s:.0f}s)")
                else:
                    guarded(rec, "profile", partial(profile, rec, shape, device, PROFILE_BUDGET_S))
            left = deadline - time.monotonic()
            name = f"training_{shape.model}"
            if left < (15 if workers == 1 else 40):  # spawned workers start torch (and CUDA) first
                rec.write(name, workers=workers, overlap=overlap,
                          skipped=f"section budget spent ({budget_s:.0f}s)")
                continue
            guarded(rec, f"{name}_w{workers}{'_overlap' if overlap else ''}",
                    partial(_training_run, rec, shape, device, workers, overlap, left, local_rates))


def _training_run(rec: Recorder, shape: Any, device: Any, workers: int, overlap: bool, left: float,
                  local_rates: list[float]) -> None:
    from bench import gpu_runs

    began = time.monotonic()
    if workers == 1:
        got = gpu_runs.one_worker(shape, device, overlap)
        local_rates.append(got["local_steps_per_s"])
    else:
        got = gpu_runs.several_workers(shape, device, overlap, workers, timeout_s=left)
        if local_rates:  # same model, batch and device, measured in this run of the check
            local = sum(local_rates) / len(local_rates)
            got["local_steps_per_s"] = round(local, 2)
            got["ratio"] = round(got["samples_per_s"] / (local * shape.batch), 3)
    rec.write(f"training_{shape.model}", **gpu_runs.describe(shape), workers=workers, overlap=overlap, **got,
              seconds=round(time.monotonic() - began, 1))


def profile(rec: Recorder, shape: Any, device: Any, budget_s: float) -> None:
    """Where a 1-worker step's time goes (bench.gpu_profile): the copy floor, local torch.optim's
    phases, then PSTrainer's without overlap, with it, and with it in DDP-sized buckets."""
    from bench import gpu_profile, gpu_runs
    from bench.common import stop_processes
    from bench.gpu_models import build, parameter_count

    deadline = time.monotonic() + budget_s
    began = time.monotonic()
    nbytes = 4 * parameter_count(build(shape.model, shape.image, shape.classes))
    rec.write("profile_floor", model=shape.model, **gpu_profile.bandwidth(nbytes, device),
              seconds=round(time.monotonic() - began, 1))
    began = time.monotonic()
    local = gpu_profile.local_phases(shape, device)
    rec.write("profile_local", model=shape.model, batch=shape.batch, **local,
              seconds=round(time.monotonic() - began, 1))
    variants = [(False, None), (True, None), (True, gpu_profile.SMALL_BUCKET_BYTES)]
    procs, addresses = gpu_runs.start_servers(["w0"])  # one pair for all variants: each start costs seconds
    try:
        for overlap, bucket_bytes in variants:
            if time.monotonic() > deadline:
                rec.write("profile", model=shape.model, overlap=overlap, bucket_bytes=bucket_bytes,
                          skipped=f"profile budget spent ({budget_s:.0f}s)")
                continue
            guarded(rec, f"profile_{'overlap' if overlap else 'plain'}",
                    partial(_profile_run, rec, shape, device, addresses, overlap, bucket_bytes))
    finally:
        stop_processes(procs)


def _profile_run(rec: Recorder, shape: Any, device: Any, addresses: list[str], overlap: bool,
                 bucket_bytes: int | None) -> None:
    from bench import gpu_profile

    began = time.monotonic()
    got = gpu_profile.profile_run(shape, device, addresses, overlap, bucket_bytes)
    rec.write("profile", model=shape.model, batch=shape.batch, **got,
              seconds=round(time.monotonic() - began, 1))


# ---- c. CTR ----

def ctr(rec: Recorder, device: Any, quick: bool) -> None:
    import torch

    from bench import gpu_runs

    shape = gpu_runs.ctr_shape(device.type == "cuda", quick)
    results = {}
    places = (device, torch.device("cpu")) if device.type == "cuda" else (device,)
    for where in places:
        began = time.monotonic()
        results[where.type] = got = gpu_runs.ctr_run(shape, where)
        rec.write("ctr", batch=shape.batch, warmup=shape.warmup, steps=shape.steps, num_ids=shape.num_ids,
                  **got, seconds=round(time.monotonic() - began, 1))
    if "cuda" in results:
        ratio = results["cuda"]["samples_per_s"] / results["cpu"]["samples_per_s"]
        rec.write("ctr_ratio", gpu_to_cpu=round(ratio, 3), bar=CTR_BAR, meets_bar=ratio >= CTR_BAR)


# ---- the summary ----

def summary(rec: Recorder) -> str:
    by = rec.records
    tests = next((r for r in by if r["figure"] == "cuda_tests"), None)
    resnet = {r["overlap"]: r.get("ratio") for r in by
              if r["figure"] == "training_resnet18" and r.get("workers") == 1 and "ratio" in r}
    ctr_ratio = next((r["gpu_to_cpu"] for r in by if r["figure"] == "ctr_ratio"), None)
    errors = [r["figure"] for r in by if r["figure"].endswith("_error")]
    best = max((v for v in resnet.values() if v is not None), default=None)
    bars = {"cuda_tests_pass": bool(tests and tests.get("failed") == 0 and tests.get("passed", 0) > 0
                                    and tests.get("exit_code") == 0),
            "resnet18_pstrainer_ge_0.7": best is not None and best >= TRAINING_BAR,
            "ctr_gpu_ge_3x_cpu": ctr_ratio is not None and ctr_ratio >= CTR_BAR}
    rec.write("summary", bars=bars,
              resnet18_ratio={"no_overlap": resnet.get(False), "overlap": resnet.get(True)},
              ctr_gpu_to_cpu=ctr_ratio, errors=errors, total_s=round(time.monotonic() - rec.started, 1))
    tests_text = (f"{tests.get('passed')} passed {tests.get('failed')} failed {tests.get('skipped')} skipped"
                  if tests else "not run")
    return (f"gpu-check {'OK' if all(bars.values()) and not errors else 'DONE WITH MISSES'} in "
            f"{time.monotonic() - rec.started:.0f}s: cuda tests {tests_text}; resnet18 PSTrainer/local "
            f"{resnet.get(False)} (overlap {resnet.get(True)}; bar {TRAINING_BAR}); ctr gpu/cpu {ctr_ratio} "
            f"(bar {CTR_BAR}); errors {errors or 'none'}")


def _watchdog(rec: Recorder, limit_s: float) -> None:
    """A hard stop: a hung section must not eat the device's time; what is written stays written."""
    def fire() -> None:
        rec.write("watchdog", error=f"the check ran past {limit_s:.0f}s and was stopped")
        print(f"gpu-check STOPPED after {limit_s:.0f}s (watchdog); figures so far are in the output",
              flush=True)
        os._exit(3)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="file the JSON lines are appended to (created if missing)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:0 when torch sees a GPU, else the CPU (default auto)")
    p.add_argument("--quick", action="store_true", help="small sizes and the demo CNN only (the CPU test)")
    p.add_argument("--sections", default="cuda_tests,training,ctr",
                   help="comma-separated subset of cuda_tests,training,ctr (default all)")
    p.add_argument("--limit-s", type=float, default=420.0,
                   help="hard stop of the whole check, seconds (default 420)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(BUDGET_S))
    if unknown:
        raise SystemExit(f"--sections: got {unknown}, expected some of {sorted(BUDGET_S)}")
    # numba caches compiled kernels next to the package, which may be read-only: a scratch dir instead.
    os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="pshard-numba-"))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as python -m pshard.worker sets (PSTrainer)
    import torch
    from pshard.worker.device import select_device

    device = select_device("cuda:0" if args.device == "cuda" else args.device)
    if device.type == "cuda":
        device = torch.device("cuda:0")
    scale = 1.0 if device.type == "cuda" else 0.5
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a", encoding="utf-8") as out:
        rec = Recorder(out)
        _watchdog(rec, args.limit_s)
        env = rec.write("environment", **environment(device), quick=args.quick, sections=sections)
        if env.get("carry_matches_tree") is False:
            print("gpu-check: WARNING: .gpu-carry was built from other sources than this tree's (run "
                  "`make gpu-carry` again): the figures below measure the carried code", flush=True)
        guarded(rec, "numba_kernels", lambda: kernels_check(rec, args.quick))
        guarded(rec, "server_update", lambda: server_update_check(rec, args.quick))
        if "cuda_tests" in sections:
            guarded(rec, "cuda_tests", lambda: cuda_tests(rec, BUDGET_S["cuda_tests"] * scale))
        if "training" in sections:
            guarded(rec, "training", lambda: training(rec, device, args.quick, BUDGET_S["training"] * scale))
        if "ctr" in sections:
            guarded(rec, "ctr", lambda: ctr(rec, device, args.quick))
        line = summary(rec)
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
