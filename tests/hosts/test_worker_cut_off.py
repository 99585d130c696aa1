"""A worker's host cut off, on the multi-host bed (issue 24, item 3; docs/architecture.md, 9 Failures).

A scheduler, two parameter servers and two sync workers, each on a host of its own, started with TF_CONFIG.
Worker 1's link goes down mid-training (its process lives on): the scheduler declares it dead, and worker 0
trains on without it from the next clock (it left the quorum at a clock boundary). When the link comes
back, worker 1 learns it was declared dead, registers again and rejoins at the job's current clock,
skipping the steps trained without it. The servers take exactly the planned clocks: no clock is applied
twice, and nobody trains alone past the end.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.hostbed import HostBed
from tests.hosts.bedjob import HOSTS, BedJob

pytestmark = pytest.mark.e2e

Bed = Callable[..., HostBed]
TIMEOUT_MS = 2000  # the scheduler's heartbeat timeout
STEPS = 40


@pytest.mark.timeout(180)
def test_a_worker_host_cut_off_leaves_at_a_clock_boundary_and_rejoins_when_back(hostbed: Bed,
                                                                                tmp_path: Path) -> None:
    job = BedJob(hostbed(HOSTS), tmp_path, steps=STEPS, heartbeat_timeout_ms=TIMEOUT_MS)
    try:
        job.wait("both workers to train", lambda: min(job.steps("w0"), job.steps("w1")) >= 4)
        job.bed.link_down("w1")
        cut_at = time.monotonic()
        job.wait("worker-1 declared dead", lambda: "declared worker-1 dead" in job.log("sched"), 30)
        detected_s = time.monotonic() - cut_at
        alone_from = job.steps("w0")
        job.wait("worker-0 to train on alone", lambda: job.steps("w0") >= alone_from + 5, 30)
        job.bed.link_up("w1")
        job.wait("worker-1 to rejoin", lambda: "rejoins at clock" in job.log("w1"))
        job.finish()
        versions = job.max_versions()
    finally:
        job.close()
    print(f"worker host cut off: declared dead {detected_s:.1f} s after the cut (timeout {TIMEOUT_MS} ms)")
    assert detected_s <= 2 * TIMEOUT_MS / 1000 + 1.0, detected_s  # + the polling of the scheduler's log
    assert job.steps("w0") == STEPS, job.logs()
    summary = re.search(r"steps=(\d+) skipped=(\d+)", job.log("w1"))
    assert summary is not None, job.log("w1")
    steps, skipped = (int(n) for n in summary.groups())
    assert steps + skipped == STEPS and skipped >= 5, job.log("w1")
    assert versions == [STEPS, STEPS], versions  # every planned clock applied once, none past the end
