"""A small sync job on the bed for the failure tests: a scheduler, two parameter servers and two workers, each
on a host of its own (sched, ps0, ps1, w0, w1), started as users do with TF_CONFIG, in clear, each writing
its output to a file of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.hostbed import HostBed
from tests.e2e.harness import ROOT, wait_until

HOSTS = ["sched", "ps0", "ps1", "w0", "w1"]
RUN_TIMEOUT_S = 90.0


class BedJob:
    def __init__(self, bed: HostBed, tmp_path: Path, *, steps: int, heartbeat_timeout_ms: int,
                 server_args: Sequence[str] = ()) -> None:
        self.bed, self.dir = bed, tmp_path
        ip = {h: bed.hosts[h].address for h in HOSTS}
        self.cluster = {"scheduler": [f"{ip['sched']}:7000"],
                        "ps": [f"{ip['ps0']}:7100", f"{ip['ps1']}:7100"],
                        "worker": [f"{ip['w0']}:7200", f"{ip['w1']}:7200"]}
        data = tmp_path / "no-dataset"
        data.mkdir()
        self._logs = {h: tmp_path / f"{h}.log" for h in HOSTS}
        self._files = {h: self._logs[h].open("wb") for h in HOSTS}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._start("sched", "scheduler", 0, [
            "-m", "pshard.scheduler", "--bind", self.cluster["scheduler"][0],
            "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)])
        for i in range(2):
            self._start(f"ps{i}", "ps", i, ["-m", "pshard.ps_server", "--bind", self.cluster["ps"][i],
                                             *server_args])
        worker = ["-m", "pshard.worker", "--mode", "sync", "--max-steps", str(steps), "--batch-size", "32",
                  "--model", "mlp", "--optimizer", "sgd", "--lr", "0.05", "--seed", "0", "--threads", "1",
                  "--data-dir", str(data), "--metrics", "-", "--log-every", "1", "--step-timeout-s", "30",
                  "--startup-timeout-s", "60"]
        for i in range(2):
            self._start(f"w{i}", "worker", i, worker)

    def _start(self, host: str, role: str, index: int, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PSHARD_INSECURE="1",
                   PSHARD_JOB_ID=self.dir.name,
                   TF_CONFIG=json.dumps({"cluster": self.cluster, "task": {"type": role, "index": index}}))
        self.procs[host] = self.bed.spawn(host, [sys.executable, *args], env=env, cwd=self.dir,
                                          stdout=self._files[host].fileno())

    def log(self, host: str) -> str:
        return self._logs[host].read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {h}\n{self.log(h)[-3000:]}" for h in HOSTS)

    def steps(self, host: str) -> int:
        """Steps a worker has logged."""
        return len(re.findall(r'"event": "step"', self.log(host)))

    def wait(self, what: str, condition: Callable[[], object], timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Until `condition()`; AssertionError with every log if a process failed or time ran out."""
        def check() -> object:
            for host, proc in self.procs.items():
                if proc.poll() not in (None, 0):
                    raise AssertionError(f"{host} exited {proc.returncode}")
            return condition()
        try:
            wait_until(check, timeout_s, what)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.logs()}") from None

    def finish(self) -> None:
        """Both workers end with 0 within the run's timeout."""
        for host in ("w0", "w1"):
            try:
                code = self.procs[host].wait(RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"{host} ended with {code}:\n{self.logs()}"

    def max_versions(self) -> list[int]:
        """Each server's newest slice version (its applied clocks), asked from the scheduler's host."""
        probe = ("import sys, grpc\n"
                 "from pshard.api.v1 import parameter_server_pb2 as pb, parameter_server_pb2_grpc as rpc\n"
                 "for address in sys.argv[1:]:\n"
                 "    with grpc.insecure_channel(address) as channel:\n"
                 "        print(rpc.ParameterServerServiceStub(channel).GetStats(pb.GetStatsRequest(), "
                 "timeout=10).max_version)\n")
        proc = self.bed.spawn("sched", [sys.executable, "-c", probe, *self.cluster["ps"]],
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode(errors="replace")
        return [int(line) for line in out.decode().split()]

    def close(self) -> None:
        for proc in self.procs.values():
            self.bed.kill(proc)
        for out in self._files.values():
            out.close()
