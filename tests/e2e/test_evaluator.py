"""An evaluator task (TF_CONFIG type "evaluator") watches a real training job from outside the quorum."""

from __future__ import annotations

import json

import pytest
from pshard.launcher.plan import Task

from tests.e2e.harness import (
    SYNC,
    TIMEOUTS,
    LocalCluster,
    Procs,
    assert_trained,
    chief_accuracy,
    read_metrics,
)

pytestmark = pytest.mark.e2e

# digits, 2 workers, 6 epochs of batch 32: the chief measures 0.95-0.98; the evaluator reads the
# same final weights. Chance is 0.10.
ACCURACY_BAR = 0.90


def test_an_evaluator_follows_training_and_scores_the_final_weights(procs: Procs) -> None:
    cluster = LocalCluster(procs)
    cluster.start_servers()
    workers = [cluster.start_worker(i, *SYNC, "--epochs", "6", "--batch-size", "32", *TIMEOUTS)
               for i in (0, 1)]
    # TFJob lists the evaluator in the cluster; it listens nowhere, so any free address will do.
    tf_config = json.loads(cluster.plan.tf_config(Task("worker", 0, "")))
    tf_config["cluster"]["evaluator"] = [cluster.plan.ps[0]]
    tf_config["task"] = {"type": "evaluator", "index": 0}
    metrics = cluster.dir / "metrics-evaluator.jsonl"
    evaluator = procs.python("evaluator", "-m", "pshard.worker", "--data-dir", str(cluster.data_dir),
                             "--model", "mlp", "--seed", "0", "--metrics", str(metrics),
                             "--eval-interval-s", "0.5", *SYNC, *TIMEOUTS, tf_config=json.dumps(tf_config))

    finals = [assert_trained(w) for w in workers]
    verdict = assert_trained(evaluator)

    assert verdict["role"] == "evaluator", verdict
    assert float(verdict["test_accuracy"]) > ACCURACY_BAR, verdict
    # It scores the very weights the chief saved: the same test set, the same final model.
    assert float(verdict["test_accuracy"]) == pytest.approx(chief_accuracy(*finals), abs=1e-4)
    evals = [r for r in read_metrics(metrics) if r.get("event") == "eval"]
    assert evals and evals[-1]["final"] is True, evals
