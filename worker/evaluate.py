"""The evaluator task (TF_CONFIG task type "evaluator"): watches the training from outside the quorum.

It registers with the scheduler, takes the shared layout, and every `eval_interval_s` pulls the
latest weights and evaluates them on the test set. Fencing guards writes only, so a node outside the
quorum may read. Once no worker is live any more (every one finished or died), it evaluates
the final weights once more and prints its final line. It never pushes, so it cannot slow down or
change the training; what it reads between steps may mix slices of neighbouring versions.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO

import torch
from pshard.common.errors import PullTimeoutError
from pshard.common.scheduler_client import SchedulerClient
from pshard.common.view import ClusterView, NodeState
from pshard.worker.client import PSClient
from pshard.worker.data import load_dataset
from pshard.worker.device import select_device
from pshard.worker.metrics import MetricsLog
from pshard.worker.model import build_model
from pshard.worker.train import StageError, TrainConfig, evaluate, stage

log = logging.getLogger("pshard.evaluator")

_TRAINERS = ("chief", "worker")


def training_over(view: ClusterView) -> bool:
    """Some worker has joined, and none is live any more."""
    trainers = [n for n in view.nodes if n.role in _TRAINERS]
    return bool(trainers) and all(n.state is not NodeState.LIVE for n in trainers)


def run_evaluator(cfg: TrainConfig, stdout: IO[str] | None = None) -> int:
    """Evaluate until the training is over; print exactly one `final:` line. 0 on success, 1 on failure."""
    stdout = stdout if stdout is not None else sys.stdout
    started = time.monotonic()
    metrics = MetricsLog(None if cfg.metrics in (None, "-") else cfg.metrics,
                         stream=stdout if cfg.metrics == "-" else None)
    sched: SchedulerClient | None = None
    client: PSClient | None = None
    evals, accuracy, failed = 0, None, None
    try:
        with stage("data", "loading data"):
            data = load_dataset(cfg.data_dir)
        with stage("model", "building the model"):
            device = select_device(cfg.device)
            torch.manual_seed(cfg.seed)
            model = build_model(cfg.model, data.image_shape, data.num_classes).to(device)
        with stage("register", f"joining the cluster at {cfg.spec.scheduler_address}"):
            sched = SchedulerClient(cfg.spec.scheduler_address, "evaluator", cfg.spec.own_address or "",
                                    node_id=cfg.spec.node_id, rank_hint=cfg.spec.task_index,
                                    connect_timeout_s=cfg.startup_timeout_s)
            sched.register()
            layout = sched.get_layout(timeout_s=cfg.startup_timeout_s)
            client = PSClient(layout.servers, cfg.spec.node_id, layout=layout,
                              generation=lambda: sched.generation,  # type: ignore[union-attr]
                              timeout_s=cfg.step_timeout_s)
            client.job = cfg.job  # the wire dtype pulled values arrive in
        params = dict(model.named_parameters())
        done = False
        while not done:
            try:
                sched.wait_for_view(training_over, timeout_s=cfg.eval_interval_s)
                done = True
            except PullTimeoutError:
                pass  # an interval passed: evaluate the weights as they are now
            with stage("eval", "pulling and evaluating the weights"):
                values = client.pull(clock=0, keys=list(params))
                with torch.no_grad():
                    for key, param in params.items():
                        param.copy_(torch.from_numpy(values[key]).reshape(param.shape))
                accuracy, loss = evaluate(model, data, device)
                evals += 1
                pulled = client.last_pull
                metrics.log("eval", test_accuracy=accuracy, test_loss=loss, final=done,
                            version=pulled.min_version if pulled else 0)
                log.info("eval %d: test_accuracy=%.4f test_loss=%.4f%s", evals, accuracy, loss,
                         " (final weights)" if done else "")
        code = 0
    except StageError as e:
        print(f"python -m pshard.worker: error: {e}", file=sys.stderr, flush=True)
        failed, code = e.stage, 1
    finally:
        if client is not None:
            client.close()
        if sched is not None:
            sched.close()
    parts = ["final: role=evaluator"] + ([f"failed={failed}"] if failed else [])
    if accuracy is not None:
        parts.append(f"test_accuracy={accuracy:.4f}")
    parts += [f"evals={evals}", f"time_s={time.monotonic() - started:.1f}"]
    metrics.log("final", role="evaluator", test_accuracy=accuracy, evals=evals, failed=failed)
    metrics.close()
    print(" ".join(parts), file=stdout, flush=True)
    return code
