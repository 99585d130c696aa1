"""bench.coordinator's CPU accounting: each named process's user + system CPU from /proc over the timed
windows only (a real busy child, this process), and the per-step table with its total."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.coordinator import CpuTimes, cpu_ms_per_step

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")

SPIN = "import sys, time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n" \
       "sys.stdin.read()"


def _spin_until(deadline_s: float, cpu_s: float) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end and time.monotonic() < deadline_s:
        pass


def test_a_window_counts_the_cpu_each_process_spent_inside_it_and_none_outside() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, text=True)
    try:
        cpu = CpuTimes({"child": child.pid, "own": os.getpid()})
        cpu.start()
        _spin_until(time.monotonic() + 10.0, 0.2)  # this process: 0.2 s of CPU in the window
        # The child's 0.3 s of spinning (after its start-up), waited for by its CPU time, not by a sleep.
        deadline = time.monotonic() + 30.0
        while cpu._now()["child"] - cpu._at["child"] < 0.25 and time.monotonic() < deadline:
            time.sleep(0.02)
        cpu.stop()
        inside = dict(cpu.seconds)
        _spin_until(time.monotonic() + 10.0, 0.2)  # outside any window: not counted
        assert inside["own"] >= 0.19 and inside["child"] >= 0.25
        assert cpu.seconds == inside
        cpu.start()
        cpu.stop()  # a second window adds what it saw (next to nothing) to the first
        assert cpu.seconds["own"] == pytest.approx(inside["own"], abs=0.05)
    finally:
        child.communicate("", timeout=30)


def test_the_table_is_ms_per_step_per_role_and_a_total_of_every_process() -> None:
    table = cpu_ms_per_step({"worker-1": 1.0, "coordinator": 0.2, "ps-0": 0.6}, steps=400)
    assert table == {"coordinator": 0.5, "ps-0": 1.5, "worker-1": 2.5, "total": 4.5}
