"""bench.link_ceiling's per-process CPU figures (what bench.compression_link reports beside each step)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.link_ceiling import CpuSampler, cpu_seconds


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_seconds_counts_what_this_process_ran_and_none_once_a_process_is_gone() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None
    _spin(0.1)
    after = cpu_seconds(os.getpid())
    assert after is not None and after[0] - before[0] >= 0.09 and after[1] >= before[1] >= 0
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True, timeout=30)
    assert cpu_seconds(int(done.stdout)) is None


def test_the_sampler_reports_mean_and_peak_cores_and_the_run_queue_wait_per_process() -> None:
    sampler = CpuSampler({"me": os.getpid()}, every_s=0.05)
    _spin(0.15)
    figures = sampler.stop()
    me = figures["me"]
    assert set(me) == {"mean_cores", "peak_cores", "runqueue_wait"}
    assert 0 < me["mean_cores"] <= me["peak_cores"] and me["runqueue_wait"] >= 0
