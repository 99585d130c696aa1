"""The chief's end of a replicated job when a server's host is cut off just after the last step (issue 24),
on the multi-host bed: the job of test_partitions.py (scheduler, three servers with --replicas 1, two sync
workers, each on a host of its own, TF_CONFIG), the link of ps1's host taken down for good.

The chief's steps all went through before the cut, so it still routes by the layout that gives ps1 slices.
Its wait for its peers asks the serving servers for their clocks: it asked ps1, which nobody answers, for
its whole step timeout (45 s here, 120 s by default) before its final pull and evaluation. Now a server
silent for twice the dead-peer time counts as gone, and the question goes to the failed-over layout.

To land the cut in that window every time, the scheduler is stopped (SIGSTOP, well under its heartbeat
timeout) before the last steps: the workers' steps do not need it, their Leave waits for it, the cut comes
once the chief's last step is logged, and the scheduler is resumed.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.hosts.test_partitions import HOSTS, STEPS, TIMEOUT_MS, Bed, Job

pytestmark = pytest.mark.e2e

STEP_TIMEOUT_S = 45.0  # Job's --step-timeout-s: what the chief waited for without the fix
# Twice the dead-peer time to give ps1 up, the failover (at most 2x the heartbeat timeout), the final pull,
# evaluation and save, on a loaded machine: well under the step timeout.
BOUND_S = 4 * TIMEOUT_MS / 1000 + 12.0


@pytest.mark.timeout(240)
def test_a_server_cut_off_after_the_last_step_costs_the_chief_no_step_timeout(hostbed: Bed, tmp_path: Path
                                                                            ) -> None:
    assert BOUND_S < STEP_TIMEOUT_S
    bed = hostbed(HOSTS)
    job = Job(bed, tmp_path, "cut-at-the-end")
    ps1 = job.cluster["ps"][1]
    job.wait_line("sched", rf"ROLE: \S+ is an in-sync backup of {re.escape(ps1)}", 120)
    job.wait_line("w0", rf'"event": "step".*"step": {STEPS - 4},', 120)
    scheduler = job.procs["sched"].pid
    os.kill(scheduler, signal.SIGSTOP)
    try:
        job.wait_line("w0", rf'"event": "step".*"step": {STEPS},', TIMEOUT_MS / 1000 / 2)
        bed.link_down("ps1")
    finally:
        os.kill(scheduler, signal.SIGCONT)
    cut_at = time.monotonic()
    job.wait_line("sched", r"FAILOVER: server 1 ", 30)
    job.wait_line("w0", r"^final: role=chief", STEP_TIMEOUT_S + 30)
    took = time.monotonic() - cut_at
    assert job.procs["w0"].wait(60) == 0, job.logs()
    print(f"chief's final line {took:.1f} s after the cut (step timeout {STEP_TIMEOUT_S:g} s)")
    assert took < BOUND_S, f"the chief took {took:.1f} s after the cut:\n{job.logs()}"
    assert re.search(rf"FAILOVER: layout 1 -> 2 .*{re.escape(ps1)}: no answer", job.log("w0")), job.logs()
    assert re.search(r"^final: role=worker", job.log("w1"), re.MULTILINE), job.logs()
