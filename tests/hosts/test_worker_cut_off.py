"""A worker's host cut off, on the multi-host bed (issue 24, item 3; docs/architecture.md, 9 Failures).

A scheduler, two parameter servers and two sync workers, each on a host of its own, started with TF_CONFIG.
Worker 1's link goes down mid-training (its process lives on): the scheduler declares it dead, and worker 0
trains on without it from the next clock (it left the quorum at a clock boundary). When the link comes
back, worker 1 learns it was declared dead, registers again and rejoins at the job's current clock,
skipping the steps trained without it. The servers take exactly the planned clocks: no clock is applied
twice, and nobody trains alone past the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.hostbed import HostBed
from tests.e2e.harness import ROOT, wait_until

pytestmark = pytest.mark.e2e

Bed = Callable[..., HostBed]
HOSTS = ["sched", "ps0", "ps1", "w0", "w1"]
TIMEOUT_MS = 2000  # the scheduler's heartbeat timeout
STEPS = 40
RUN_TIMEOUT_S = 90.0


def _env(cluster: dict[str, list[str]], role: str, index: int, job: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PSHARD_INSECURE="1", PSHARD_JOB_ID=job,
               TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}))
    return env


def _steps(log: str) -> int:
    return len(re.findall(r'"event": "step"', log))


def _max_versions(bed: HostBed, servers: list[str]) -> list[int]:
    """Each server's newest slice version (its applied clocks), asked from the scheduler's host."""
    probe = ("import sys, grpc\n"
             "from pshard.api.v1 import parameter_server_pb2 as pb, parameter_server_pb2_grpc as rpc\n"
             "for address in sys.argv[1:]:\n"
             "    with grpc.insecure_channel(address) as channel:\n"
             "        print(rpc.ParameterServerServiceStub(channel).GetStats(pb.GetStatsRequest(), "
             "timeout=10).max_version)\n")
    proc = bed.spawn("sched", [sys.executable, "-c", probe, *servers],
                     env={**os.environ, "PYTHONPATH": str(ROOT)})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode(errors="replace")
    return [int(line) for line in out.decode().split()]


@pytest.mark.timeout(180)
def test_a_worker_host_cut_off_leaves_at_a_clock_boundary_and_rejoins_when_back(hostbed: Bed,
                                                                                tmp_path: Path) -> None:
    bed = hostbed(HOSTS)
    ip = {h: bed.hosts[h].address for h in HOSTS}
    cluster = {"scheduler": [f"{ip['sched']}:7000"], "ps": [f"{ip['ps0']}:7100", f"{ip['ps1']}:7100"],
               "worker": [f"{ip['w0']}:7200", f"{ip['w1']}:7200"]}
    data = tmp_path / "no-dataset"
    data.mkdir()
    logs = {h: tmp_path / f"{h}.log" for h in HOSTS}
    files = {h: logs[h].open("wb") for h in HOSTS}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(host: str, role: str, index: int, args: list[str]) -> None:
        procs[host] = bed.spawn(host, [sys.executable, *args], env=_env(cluster, role, index, "cut-worker"),
                                cwd=tmp_path, stdout=files[host].fileno())

    def log(host: str) -> str:
        return logs[host].read_text(errors="replace")

    def all_logs() -> str:
        return "\n".join(f"--- {h}\n{log(h)[-3000:]}" for h in HOSTS)

    def wait(what: str, condition: Callable[[], object], timeout_s: float = RUN_TIMEOUT_S) -> None:
        def check() -> object:
            for host, proc in procs.items():
                if proc.poll() not in (None, 0):
                    raise AssertionError(f"{host} exited {proc.returncode}:\n{all_logs()}")
            return condition()
        try:
            wait_until(check, timeout_s, what)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{all_logs()}") from None

    start("sched", "scheduler", 0, ["-m", "pshard.scheduler", "--bind", cluster["scheduler"][0],
                                    "--heartbeat-interval-ms", "200",
                                    "--heartbeat-timeout-ms", str(TIMEOUT_MS)])
    for i in range(2):
        start(f"ps{i}", "ps", i, ["-m", "pshard.ps_server", "--bind", cluster["ps"][i]])
    worker = ["-m", "pshard.worker", "--mode", "sync", "--max-steps", str(STEPS), "--batch-size", "32",
              "--model", "mlp", "--optimizer", "sgd", "--lr", "0.05", "--seed", "0", "--threads", "1",
              "--data-dir", str(data), "--metrics", "-", "--log-every", "1", "--step-timeout-s", "30",
              "--startup-timeout-s", "60"]
    for i in range(2):
        start(f"w{i}", "worker", i, worker)
    try:
        wait("both workers to train", lambda: min(_steps(log("w0")), _steps(log("w1"))) >= 4)
        bed.link_down("w1")
        cut_at = time.monotonic()
        wait("worker-1 declared dead", lambda: "declared worker-1 dead" in log("sched"), 30)
        detected_s = time.monotonic() - cut_at
        alone_from = _steps(log("w0"))
        wait("worker-0 to train on alone", lambda: _steps(log("w0")) >= alone_from + 5, 30)
        bed.link_up("w1")
        wait("worker-1 to rejoin", lambda: "rejoins at clock" in log("w1"))
        for host in ("w0", "w1"):
            procs[host].wait(RUN_TIMEOUT_S)
            assert procs[host].returncode == 0, f"{host} ended with {procs[host].returncode}:\n{all_logs()}"
        versions = _max_versions(bed, cluster["ps"])
    finally:
        for proc in procs.values():
            bed.kill(proc)
        for out in files.values():
            out.close()
    print(f"worker host cut off: declared dead {detected_s:.1f} s after the cut (timeout {TIMEOUT_MS} ms)")
    assert detected_s <= 2 * TIMEOUT_MS / 1000 + 1.0, detected_s  # + the polling of the scheduler's log
    assert _steps(log("w0")) == STEPS, all_logs()
    summary = re.search(r"steps=(\d+) skipped=(\d+)", log("w1"))
    assert summary is not None, log("w1")
    steps, skipped = (int(n) for n in summary.groups())
    assert steps + skipped == STEPS and skipped >= 5, log("w1")
    assert versions == [STEPS, STEPS], versions  # every planned clock applied once, none past the end
