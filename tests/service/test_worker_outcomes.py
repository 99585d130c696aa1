"""What a user sees from a worker: records naming who wrote them, a start-up warning about async
learning rates, and a diverging run that fails saying so (real processes on 127.0.0.1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.e2e.harness import ROOT, TIMEOUTS, LocalCluster, Procs, read_metrics, wait_healthy


def test_sync_records_name_their_worker_and_role(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=1, num_workers=2)
    cluster.start_servers()
    workers = [cluster.start_worker(i, "--mode", "sync", "--lr", "0.05", "--epochs", "1", *TIMEOUTS)
               for i in range(2)]
    for proc in workers:
        assert proc.wait(120) == 0, proc.output()
    for name, role in (("worker-0", "chief"), ("worker-1", "worker")):
        records = read_metrics(cluster.metrics(name))
        assert {"step", "epoch", "final"} <= {r["event"] for r in records}
        assert all(r["worker"] == name and r["role"] == role for r in records), records[:3]
    assert not any("learning rate" in line or "lr / workers" in line for line in workers[0].lines)

    # The saved model describes itself, and `pshard evaluate` needs nothing else to reproduce its accuracy.
    saved = torch.load(cluster.model_path, weights_only=True)  # one file: no MODEL.json beside it
    description = {key: value for key, value in saved.items() if key != "state_dict"}
    assert not Path(f"{cluster.model_path}.json").exists()
    assert description["model"] == {"name": "mlp", "args": {"image_shape": [1, 8, 8], "num_classes": 10}}
    assert description["classes"] == [str(d) for d in range(10)]
    assert description["input"]["dataset"] == "digits" and description["input"]["normalisation"]["std"] > 0
    assert description["job"]["mode"] == "sync" and description["training"]["workers"] == 2
    final = workers[0].final()
    assert final is not None
    assert f"{description['metrics']['test_accuracy']:.4f}" == final["test_accuracy"]
    done = subprocess.run([sys.executable, "-m", "pshard", "evaluate", str(cluster.model_path), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["test_accuracy"] == description["metrics"]["test_accuracy"] > 0.5
    assert result["dataset"] == "digits" and result["architecture"] == "mlp"


def test_an_async_run_warns_about_its_learning_rate_and_fails_when_the_loss_explodes(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=1, num_workers=2)
    cluster.start_servers()
    workers = [cluster.start_worker(i, "--mode", "async", "--lr", "50", "--momentum", "0.9", "--epochs", "5",
                                    *TIMEOUTS) for i in range(2)]
    codes = [proc.wait(120) for proc in workers]
    assert 1 in codes, [proc.output() for proc in workers]
    diverged = workers[codes.index(1)]
    assert any("training diverged at step" in line for line in diverged.lines), diverged.output()
    final = diverged.final()
    assert final is not None and final["failed"] == "diverged"
    for proc in workers:
        assert any("async mode applies every worker's push" in line and "divided by 2" in line
                   for line in proc.lines), proc.output()


def test_servers_and_scheduler_exit_0_once_the_job_is_done(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=2, num_workers=2)
    sched_task = cluster.task("scheduler")
    scheduler = procs.python("scheduler", "-m", "pshard.scheduler", "--bind", sched_task.address,
                             "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1500",
                             "--exit-when-done", "1", tf_config=cluster.plan.tf_config(sched_task))
    servers = [cluster.start_ps(i, "--exit-when-done", "1") for i in range(2)]
    for task, proc in zip(cluster.plan.servers, [scheduler, *servers], strict=True):
        wait_healthy(task.address, proc=proc)
    workers = [cluster.start_worker(i, "--mode", "sync", "--lr", "0.05", "--epochs", "1", *TIMEOUTS)
               for i in range(2)]
    for proc in workers:
        assert proc.wait(120) == 0, proc.output()
    assert workers[0].final() is not None and "test_accuracy" in (workers[0].final() or {})
    for proc in (scheduler, *servers):
        assert proc.wait(60) == 0, proc.output()
