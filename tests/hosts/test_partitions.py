"""Partitions lose nothing, on the multi-host bed (issue 24, item 3; docs/architecture.md, 9 Failures).

Each role on a host of its own (network namespaces, bench/hostbed), started as users do with TF_CONFIG:
a scheduler, three parameter servers with --replicas 1, two sync workers. A server's host is cut off
mid-training (its link down, its process alive) until the scheduler has failed it over, then brought
back: the job must finish with weights bit for bit those of an undisturbed run of the same seed, the
old primary having taken no write after the failover and rejoined as a backup. Between hosts the
workers use the raw TCP path: a call they sent to the cut-off server is delivered when its link comes
back, and only the server's fencing makes it re-route (without it, when the cut catches such a call,
the old primary keeps the worker's gradient and both workers stall to their step timeout: the issue's
fourth trial; a race, so tests/service/test_partition_fence.py is the deterministic proof).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from bench.hostbed import HostBed
from tests.e2e.harness import ROOT, wait_until

pytestmark = pytest.mark.e2e

Bed = Callable[..., HostBed]
HOSTS = ["sched", "ps0", "ps1", "ps2", "w0", "w1"]
TIMEOUT_MS = 3000  # a 2-core machine shared by many: start-ups under load must not look like deaths
STEPS = 24
RUN_TIMEOUT_S = 120.0


class Job:
    """One job's processes on the bed, each writing its output to a file of its own."""

    def __init__(self, bed: HostBed, tmp_path: Path, name: str,
                 env: Mapping[str, Mapping[str, str]] | None = None) -> None:
        """`env`: more environment for some hosts' processes, by host (a failpoint, say)."""
        self.bed, self.dir = bed, tmp_path / name
        self._env = env or {}
        self.dir.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[BinaryIO] = []
        ip = {h: bed.hosts[h].address for h in HOSTS}
        self.cluster = {"scheduler": [f"{ip['sched']}:7000"],
                        "ps": [f"{ip[f'ps{i}']}:7100" for i in range(3)],
                        "worker": [f"{ip[f'w{i}']}:7200" for i in range(2)]}
        self.model = self.dir / "model.pt"
        data = self.dir / "no-dataset"
        data.mkdir()
        worker = ["-m", "pshard.worker", "--mode", "sync", "--max-steps", str(STEPS), "--batch-size", "32",
                  "--model", "mlp", "--optimizer", "sgd", "--lr", "0.05", "--seed", "0", "--threads", "1",
                  "--data-dir", str(data), "--metrics", "-", "--log-every", "1",
                  "--step-timeout-s", "45", "--startup-timeout-s", "60"]
        scheduler = ["-m", "pshard.scheduler", "--bind", self.cluster["scheduler"][0],
                     "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", str(TIMEOUT_MS)]
        self._start("sched", "scheduler", 0, scheduler)
        for i in range(3):
            self._start(f"ps{i}", "ps", i, ["-m", "pshard.ps_server", "--bind", self.cluster["ps"][i],
                                             "--replicas", "1"])
        for i in range(2):
            self._start(f"w{i}", "worker", i, [*worker, *(["--output", str(self.model)] if i == 0 else [])])

    def _start(self, host: str, role: str, index: int, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        tf_config = json.dumps({"cluster": self.cluster, "task": {"type": role, "index": index}})
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PSHARD_INSECURE="1",
                   PSHARD_JOB_ID=self.dir.name, PSHARD_REPLICAS="1", TF_CONFIG=tf_config)
        env.update(self._env.get(host, {}))
        out = (self.dir / f"{host}.log").open("wb")
        self._files.append(out)  # open for the process's life
        self.procs[host] = self.bed.spawn(host, [sys.executable, *args], env=env, cwd=self.dir,
                                          stdout=out.fileno())

    def log(self, host: str) -> str:
        return (self.dir / f"{host}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {h}\n{self.log(h)[-3000:]}" for h in self.procs)

    def wait_line(self, host: str, pattern: str, timeout_s: float) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            if self.procs[host].poll() not in (None, 0):
                raise AssertionError(f"{host} exited {self.procs[host].returncode}:\n{self.logs()}")
            return re.search(pattern, self.log(host), re.MULTILINE)
        try:
            match = wait_until(found, timeout_s, f"{pattern!r} from {host}")
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.logs()}") from None
        assert match is not None
        return match

    def finish(self) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for host in ("w0", "w1"):
            try:
                code = self.procs[host].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"{host} ended with {code}:\n{self.logs()}"
        for host, proc in self.procs.items():
            if host not in ("w0", "w1"):
                self.bed.kill(proc)
        for out in self._files:
            out.close()
        return torch.load(self.model, weights_only=True)["state_dict"]


@pytest.mark.timeout(360)  # two jobs of six processes each; under load their start-ups alone take a while
def test_a_server_host_cut_off_mid_training_is_fenced_rejoins_and_loses_nothing(hostbed: Bed, tmp_path: Path
                                                                               ) -> None:
    bed = hostbed(HOSTS)
    expected = Job(bed, tmp_path, "undisturbed").finish()

    job = Job(bed, tmp_path, "partitioned")
    ps1 = job.cluster["ps"][1]
    job.wait_line("sched", rf"ROLE: \S+ is an in-sync backup of {re.escape(ps1)}", RUN_TIMEOUT_S)
    for host in ("w0", "w1"):
        job.wait_line(host, r'"event": "step".*"step": 6,', RUN_TIMEOUT_S)
    cut_at = time.monotonic()
    bed.link_down("ps1")
    job.wait_line("sched", r"FAILOVER: server 1 ", 30)
    detected_s = time.monotonic() - cut_at
    job.wait_line("ps1", r"FENCE: no heartbeat answered", 30)
    bed.link_up("ps1")
    # Back: told it was declared dead, it registers again and follows the new layout before it takes writes.
    job.wait_line("ps1", r"FENCE: the scheduler answers again", 60)
    got = job.finish()
    print(f"server host cut off: failed over {detected_s:.1f} s after the cut (timeout {TIMEOUT_MS} ms)")
    assert detected_s <= 2 * TIMEOUT_MS / 1000 + 1.0, detected_s  # + the polling of the scheduler's log
    assert re.search(r"FAILOVER: layout version \d+ moved \d+ slices held here", job.log("ps1")), job.logs()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key}: the partitioned run differs from the undisturbed one"
