"""The compose file's `monitoring` profile: a Prometheus that scrapes every pshard service."""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.test_compose_files import COMPOSE_FILE, compose, needs_compose, normalised

PROMETHEUS_CONFIG = COMPOSE_FILE.parent / "docker" / "prometheus.yml"
PSHARD_SERVICES = {"scheduler", "ps-0", "ps-1", "worker-0", "worker-1"}


@needs_compose
@pytest.mark.parametrize("profiles", [("monitoring",), ("monitoring", "gpu")], ids=["monitoring", "both"])
def test_compose_file_with_monitoring_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    result = compose(*flags, "config", "-q")
    assert result.returncode == 0, result.stderr


@needs_compose
def test_prometheus_runs_only_in_the_monitoring_profile_with_the_shipped_config() -> None:
    assert "prometheus" not in normalised()["services"]
    prometheus = normalised("monitoring")["services"]["prometheus"]
    mounts = {(v["source"], v["target"]) for v in prometheus["volumes"]}
    assert (str(PROMETHEUS_CONFIG), "/etc/prometheus/prometheus.yml") in mounts


@needs_compose
def test_prometheus_scrapes_the_metrics_port_of_every_service() -> None:
    services = normalised("monitoring")["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {target for job in config["scrape_configs"] for static in job["static_configs"]
               for target in static["targets"]}
    ports = {name: services[name]["environment"]["PSHARD_METRICS_PORT"] for name in PSHARD_SERVICES}
    assert targets == {f"{name}:{port}" for name, port in ports.items()}
