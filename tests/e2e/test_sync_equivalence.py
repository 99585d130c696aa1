"""The proof of sync mode (docs/architecture.md, 5 Consistency), with real OS processes.

A scheduler, two parameter servers and two workers (`python -m ...`, TF_CONFIG each, all on
127.0.0.1) train for a few sync steps; the model the chief saves must equal what one process
gets training on the union of both workers' batches, from the same seed, init and shards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pshard.worker.data import batches, load_dataset, shard
from pshard.worker.model import build_model
from torch.nn import functional as F

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]  # runs bounded by TIMEOUT_S each

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 100
SEED, STEPS, BATCH, LR, MOMENTUM, MODEL = 3, 5, 32, 0.1, 0.9, "mlp"


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all sockets stay bound until every port is known."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Cluster:
    """Child processes with their output in files; `kill_all` ends every one of them."""

    def __init__(self, log_dir: Path, cluster: dict[str, list[str]]) -> None:
        self.log_dir = log_dir
        self.cluster = cluster
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, task: tuple[str, int], *args: str) -> subprocess.Popen[bytes]:
        tf_config = {"cluster": self.cluster, "task": {"type": task[0], "index": task[1]}}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CONFIG": json.dumps(tf_config)}
        env.pop("PSHARD_DATA_DIR", None)
        out_path, err_path = self.log_dir / f"{name}.out", self.log_dir / f"{name}.err"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=out, stderr=err)
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> tuple[str, str]:
        return ((self.log_dir / f"{name}.out").read_text(), (self.log_dir / f"{name}.err").read_text())

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def replay_on_union_batches(data_dir: Path) -> dict[str, torch.Tensor]:
    """One process, torch.optim.SGD, each step on worker 0's batch + worker 1's batch."""
    data = load_dataset(data_dir)
    torch.manual_seed(SEED)
    model = build_model(MODEL, data.image_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    per_rank = [list(batches(shard(len(data.train_y), rank, 2, 0, SEED), BATCH)) for rank in range(2)]
    for step in range(STEPS):
        union = np.concatenate([per_rank[0][step], per_rank[1][step]])
        optimizer.zero_grad()
        F.cross_entropy(model(torch.from_numpy(data.train_x[union])), torch.from_numpy(data.train_y[union])
                        ).backward()
        optimizer.step()
    return model.state_dict()


def final_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("final:")]
    assert len(lines) == 1, f"expected one final line, got {lines}"
    return lines[0]


@pytest.mark.parametrize("overlap", [(), ("--overlap",), ("--overlap", "--priority")],
                         ids=["one-exchange", "overlap", "priority"])
def test_sync_training_on_two_worker_processes_matches_single_process_on_union_batch(
        tmp_path: Path, overlap: tuple[str, ...]) -> None:
    empty_data_dir = tmp_path / "no-fashion-mnist"  # empty: the workers fall back to sklearn's digits
    empty_data_dir.mkdir()
    model_path = tmp_path / "model.pt"
    ports = free_ports(5)
    address = [f"127.0.0.1:{p}" for p in ports]
    cluster = Cluster(tmp_path, {"scheduler": address[:1], "ps": address[1:3], "worker": address[3:5]})
    try:
        cluster.start("scheduler", ("scheduler", 0), "pshard.scheduler", "--bind", address[0],
                      "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "5000")
        for i in range(2):
            cluster.start(f"ps-{i}", ("ps", i), "pshard.ps_server", "--bind", address[1 + i])
        workers = [cluster.start(
            f"worker-{i}", ("worker", i), "pshard.worker", "--mode", "sync", "--optimizer", "sgd",
            "--lr", str(LR),
            "--momentum", str(MOMENTUM), "--max-steps", str(STEPS), "--batch-size", str(BATCH),
            "--model", MODEL, "--seed", str(SEED), "--device", "cpu", "--data-dir", str(empty_data_dir),
            "--output", str(model_path), "--startup-timeout-s", "60", "--step-timeout-s", "30", *overlap)
            for i in range(2)]
        codes = [w.wait(timeout=TIMEOUT_S) for w in workers]
    finally:
        cluster.kill_all()

    outputs = [cluster.output(f"worker-{i}") for i in range(2)]
    assert codes == [0, 0], "\n\n".join(f"worker-{i} exit {c}:\n{o}\n{e}"
                                        for i, (c, (o, e)) in enumerate(zip(codes, outputs, strict=True)))
    chief, other = (final_line(out) for out, _ in outputs)
    assert chief.startswith("final: role=chief test_accuracy=") and f" steps={STEPS} " in chief, chief
    assert chief.endswith(f" model={model_path}"), chief
    assert other.startswith(f"final: role=worker steps={STEPS} "), other

    saved = torch.load(model_path, weights_only=True)["state_dict"]  # beside the model's description
    want = replay_on_union_batches(empty_data_dir)
    assert list(saved) == list(want)
    for key in want:
        def named(m: str, k: str = key) -> str:  # the default binds this iteration's key
            return f"{k}: {m}"

        torch.testing.assert_close(saved[key], want[key], rtol=1e-5, atol=1e-6, msg=named)
