"""A job across hosts, as users run it (issue 24, item 2): every process on a host of its own in the bed,
started with TF_CONFIG and per-host certificates (`pshard certs --host <ip>`), mutual TLS on, no --bind,
training Fashion-MNIST to its accuracy. Each server then listens on its host's address only.

Transports are chosen per peer, and proven by the segment: each host has its own /dev/shm, so shared memory
works only where the server's unix socket and the worker's segment meet. A third server shares worker 1's
host (and its /dev/shm): that pair, and only that one, goes over shared memory; every other worker x server
pair over raw TCP between hosts. `pshard status` shows each pair's transport, asked from the scheduler's host
with an admin certificate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.hostbed import HostBed
from tests.e2e.harness import PYTHON, TIMEOUTS, Procs, read_metrics, wait_until
from tests.hosts.conftest import Bed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]  # two waits of FINISH_TIMEOUT_S

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
# Each host is a fresh network namespace with nothing else listening, so fixed ports cannot collide: the
# ports a user would pick, as in docs/guide/tf-config.md.
PORTS = {"scheduler": 7000, "ps": 7100, "worker": 7200}
# Where each task runs: ps-2 on worker 1's host, the one pair that shares a host.
PLACES = {("scheduler", 0): "sched", ("ps", 0): "ps0", ("ps", 1): "ps1", ("ps", 2): "w1",
          ("worker", 0): "w0", ("worker", 1): "w1"}
# A small MLP on Fashion-MNIST for one epoch: reaches ~0.83 here; the bar leaves room for the seed.
TRAIN = ("--mode", "sync", "--model", "mlp", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
         "--epochs", "1", "--batch-size", "128", "--seed", "0", "--log-every", "1", *TIMEOUTS)
ACCURACY_BAR = 0.78
FINISH_TIMEOUT_S = 180


def cluster(bed: HostBed) -> dict[str, list[str]]:
    spec: dict[str, list[str]] = {}
    for (role, index), host in sorted(PLACES.items()):
        port = PORTS[role] + (index if role == "ps" and host == "w1" else 0)
        spec.setdefault(role, []).append(f"{bed.hosts[host].address}:{port}")
    return spec


def tls(certs: Path, name: str) -> list[str]:
    return ["--tls-cert", str(certs / f"{name}.pem"), "--tls-key", str(certs / f"{name}-key.pem"),
            "--tls-ca", str(certs / "ca.pem")]


def pair_transports(bed: HostBed, certs: Path, scheduler: str) -> dict[str, dict[str, str]]:
    """worker -> server -> transport, from `pshard status --json` run on the scheduler's host."""
    out = bed.run("sched", [PYTHON, "-m", "pshard", "status", "--scheduler", scheduler, "--json",
                            *tls(certs, "admin")], timeout_s=60)
    return {worker: dict(row) for worker, row in json.loads(out)["pairs"].items()}


@pytest.mark.skipif(not (DATA_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason=f"Fashion-MNIST is not in {DATA_DIR} (apt-get install dataset-fashion-mnist)")
def test_a_job_across_hosts_trains_with_tls_and_picks_a_transport_per_pair(
        hostbed: Bed, procs: Procs, tmp_path: Path) -> None:
    bed = hostbed(["sched", "ps0", "ps1", "w0", "w1"])
    certs = tmp_path / "certs"
    nodes: dict[str, list[str]] = {"sched": ["scheduler/scheduler-0", "admin"]}
    for (role, index), host in PLACES.items():
        if role != "scheduler":
            nodes.setdefault(host, []).append(f"{role}/{role}-{index}")
    bed.certs(certs, nodes)
    spec = cluster(bed)
    env = {"PSHARD_JOB_ID": f"across-{bed.names.token}"}

    def start(role: str, index: int, *args: str) -> None:
        tf_config = json.dumps({"cluster": spec, "task": {"type": role, "index": index}})
        # No --bind: each process binds its TF_CONFIG address, which is one of its host's.
        procs.start(f"{role}-{index}", bed.command(PLACES[role, index], [
            PYTHON, "-m", "pshard", role, *tls(certs, f"{role}-{index}"), *args]),
            tf_config=tf_config, env=env)

    start("scheduler", 0)
    for index in range(3):
        start("ps", index)
    metrics = {i: tmp_path / f"worker-{i}.jsonl" for i in range(2)}
    for index in range(2):
        start("worker", index, *TRAIN, "--data-dir", str(DATA_DIR), "--metrics", str(metrics[index]))
    workers = [p for p in procs.started if p.name.startswith("worker-")]

    # Asked while both workers are training: each server's report names each worker's transport.
    def both_pushed_everywhere() -> dict[str, dict[str, str]] | None:
        for proc in workers:
            assert proc.alive() or proc.popen.returncode == 0, proc.output()
        if not all(any(r.get("event") == "step" for r in read_metrics(m)) for m in metrics.values()):
            return None
        seen = pair_transports(bed, certs, spec["scheduler"][0])
        return seen if all(len(seen.get(f"worker-{i}", {})) == 3 for i in range(2)) else None

    seen = wait_until(both_pushed_everywhere, FINISH_TIMEOUT_S, "every worker x server pair to be in use",
                      interval_s=0.5)
    assert seen == {"worker-0": {"ps-0": "tcp", "ps-1": "tcp", "ps-2": "tcp"},
                    "worker-1": {"ps-0": "tcp", "ps-1": "tcp", "ps-2": "shm"}}, seen

    for proc in workers:
        assert proc.wait(FINISH_TIMEOUT_S) == 0, proc.output()
    chief = workers[0].final()
    assert chief is not None and float(chief["test_accuracy"]) >= ACCURACY_BAR, workers[0].output()
    # Every listening socket of the servers (gRPC, fast paths) is on its host's address: nothing on 0.0.0.0
    # or 127.0.0.1. The workers, which have finished, listen on nothing.
    for server in (bed.hosts[PLACES[task]] for task in PLACES if task[0] != "worker"):
        listening = {line.split()[3] for line in bed.run(server.name, ["ss", "-ltnH"]).splitlines()}
        # gRPC listens on an IPv6 socket for an IPv4 address: [::ffff:10.a.b.c]:port.
        hosts = {a.rsplit(":", 1)[0].removeprefix("[::ffff:").strip("[]") for a in listening}
        assert listening and hosts == {server.address}, (server.name, listening)
