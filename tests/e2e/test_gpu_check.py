"""The GPU check (bench/gpu_check.py) in CPU mode, as a real process: it must not rot between GPU runs.

Its JSON lines are what comes back from the GPU machine, so they are checked as the lead reads them:
the environment first, every section's figure with plausible values, no section error, the summary
last, and the final stdout line. Quick mode trains the demo CNN only (1 worker with and without
overlap, 2 spawned workers) against 2 real parameter server processes over shared memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240  # about 80 s on 2 idle cores


def test_the_gpu_check_runs_in_cpu_mode_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures" / "gpu_check.jsonl"
    # An empty NUMBA_CACHE_DIR keeps numba's own cache next to the package, which the suite's earlier tests
    # filled: the check loads the kernels instead of compiling them cold (7 of its 28 s). On the GPU
    # machine the script's scratch cache compiles them, as a read-only package would need.
    env = {**os.environ, "NUMBA_CACHE_DIR": ""}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    figures = [r["figure"] for r in lines]
    assert figures[0] == "environment" and figures[-1] == "summary", figures
    assert not [r for r in lines if r["figure"].endswith("_error")], [r for r in lines if "error" in r]
    env_line = lines[0]
    assert env_line["device"] == "cpu" and env_line["quick"] is True and env_line["torch"]

    updates = [r for r in lines if r["figure"] == "server_update"]
    assert [r["optimizer"] for r in updates] == ["sgd_momentum", "adam"], updates
    assert all(r["ms_by_threads"]["1"] > 0 for r in updates), updates
    kernels = next(r for r in lines if r["figure"] == "numba_kernels")
    assert kernels["ok"] is True and kernels["dtypes"] == ["float32"]

    # Without a GPU every CUDA test is collected and skips, saying why; none fails.
    tests = next(r for r in lines if r["figure"] == "cuda_tests")
    assert tests["exit_code"] == 0 and tests["failed"] == 0 and tests["passed"] == 0
    assert tests["skipped"] >= 10, tests
    assert tests["skip_reasons"] and all("CUDA" in reason for reason in tests["skip_reasons"]), tests

    training = [r for r in lines if r["figure"] == "training_cnn"]
    assert [(r["workers"], r["overlap"]) for r in training] == [(1, False), (1, True), (2, True)]
    for r in training:
        assert r["params"] == 206_922 and r["servers"] == 2 and r["batch"] == 64
        assert r["transports_used"] == ["shm", "shm"], r
        assert r["local_steps_per_s"] > 0 and r["pstrainer_steps_per_s"] > 0
        assert 0.01 < r["ratio"] < 20, r  # a same-run ratio: neither loop can be free

    # The diagnostic split of a step, right after the 1-worker runs: each phase took time, and the
    # copy counts are the model's 8 parameters (D2H every step; CPU weights land in place, no H2D).
    assert figures.index("profile_floor") == figures.index("training_cnn") + 2, figures
    floor = next(r for r in lines if r["figure"] == "profile_floor")
    assert floor["model_mb"] == 0.8 and floor["host_memcpy_ms"] > 0, floor
    local = next(r for r in lines if r["figure"] == "profile_local")
    assert local["forward_ms"] > 0 and local["backward_ms"] > 0 and local["optimizer_ms"] > 0, local
    profiles = [r for r in lines if r["figure"] == "profile"]
    assert [(r["overlap"], r["bucket_bytes"]) for r in profiles] == [(False, None), (True, None),
                                                                      (True, 256 * 1024)], profiles
    for r in profiles:
        assert r["transports_used"] == ["shm", "shm"] and r["d2h_copies_per_step"] == 8, r
        for phase in ("forward", "backward", "d2h", "push_pull", "shm_request_copy", "server_and_wakeup",
                      "shm_reply_copy"):
            assert r[f"{phase}_ms"] > 0, (phase, r)
        assert r["step_ms"] > r["push_pull_ms"] / r["push_pull_calls_per_step"], r
        assert r["staging_up_pinned"] is False and r["landing_buffers_pinned"] is False, r  # no CUDA here
    plain, overlapped, small = profiles
    assert plain["buckets"] is None and plain["h2d_copies_per_step"] == 0
    assert plain["push_pull_calls_per_step"] == 1, plain
    # The default 4 MiB buckets hold the 0.8 MB model whole; 256 KiB ones cut it.
    assert overlapped["buckets"] == 1 and overlapped["h2d_copies_per_step"] == 8, overlapped
    assert overlapped["wait_reply_ms"] > 0, overlapped
    assert small["buckets"] == small["push_pull_calls_per_step"] >= 2, small

    ctr = [r for r in lines if r["figure"] == "ctr"]
    assert [r["device"] for r in ctr] == ["cpu"]
    assert ctr[0]["samples_per_s"] > 0 and ctr[0]["last_loss"] < ctr[0]["first_loss"], ctr

    summary = lines[-1]
    assert summary["errors"] == [] and summary["bars"]["cuda_tests_pass"] is False  # nothing ran on a GPU
    final = proc.stdout.strip().splitlines()[-1]
    assert final.startswith("gpu-check DONE WITH MISSES in "), proc.stdout[-500:]
