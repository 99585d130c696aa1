"""The chief's end of a replicated job when a server's host is cut off just after the last step (issue 24),
on the multi-host bed: the job of test_partitions.py (scheduler, three servers with --replicas 1, two sync
workers, each on a host of its own, TF_CONFIG), the link of ps1's host taken down for good.

The chief's steps all went through before the cut, so it still routes by the layout that gives ps1 slices.
Its wait for its peers asks the serving servers for their clocks: it asked ps1, which nobody answers, for
its whole step timeout (45 s here, 120 s by default) before its final pull and evaluation. Now a server
silent for twice the dead-peer time counts as gone, and the question goes to the failed-over layout.

To land the cut in that window every time, the chief runs with a failpoint (pshard.common.failpoints) that
holds its main thread after its last step, before it asks the servers anything; its heartbeats go on. The
test waits for the pause, takes ps1's link down and resumes it. (Timing the cut by the chief's last step
line lost the race on a loaded machine: the chief had asked ps1 before the line was read.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from pshard.common.failpoints import ENV

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
    job = Job(bed, tmp_path, "cut-at-the-end", env={"w0": {ENV: "worker.before_await_peers=pause"}})
    ps1 = job.cluster["ps"][1]
    job.wait_line("sched", rf"ROLE: \S+ is an in-sync backup of {re.escape(ps1)}", 120)
    job.wait_line("w0", r"^failpoint worker.before_await_peers: paused", 120)
    assert re.search(rf'"event": "step".*"step": {STEPS},', job.log("w0")), job.logs()
    try:
        bed.link_down("ps1")
    finally:
        os.kill(job.procs["w0"].pid, signal.SIGUSR1)  # resumes the chief
    cut_at = time.monotonic()
    job.wait_line("sched", r"FAILOVER: server 1 ", 30)
    job.wait_line("w0", r"^final: role=chief", STEP_TIMEOUT_S + 30)
    took = time.monotonic() - cut_at
    assert job.procs["w0"].wait(60) == 0, job.logs()
    print(f"chief's final line {took:.1f} s after the cut (step timeout {STEP_TIMEOUT_S:g} s)")
    assert took < BOUND_S, f"the chief took {took:.1f} s after the cut:\n{job.logs()}"
    assert re.search(rf"FAILOVER: layout 1 -> 2 .*{re.escape(ps1)}: no answer", job.log("w0")), job.logs()
    assert re.search(r"^final: role=worker", job.log("w1"), re.MULTILINE), job.logs()
