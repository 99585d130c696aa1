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

import numpy as np
import torch
from pshard.client.ps_client import PSClient
from pshard.common.errors import UnknownKeyError
from pshard.worker.config import StageError, Stopped, TrainConfig, stage
from pshard.worker.data import load_dataset
from pshard.worker.device import select_device
from pshard.worker.model import build_model, evaluate
from pshard.worker.run_report import MetricsLog
from pshard.worker.session import ClusterSession

log = logging.getLogger("pshard.evaluator")


def run_evaluator(cfg: TrainConfig, stdout: IO[str] | None = None) -> int:
    """Evaluate until the training is over; print exactly one `final:` line. 0 on success, 1 on failure."""
    stdout = stdout if stdout is not None else sys.stdout
    started = time.monotonic()
    metrics = MetricsLog(None if cfg.metrics in (None, "-") else cfg.metrics,
                         stream=stdout if cfg.metrics == "-" else None)
    session = ClusterSession(cfg.spec, startup_timeout_s=cfg.startup_timeout_s,
                             step_timeout_s=cfg.step_timeout_s, transport=cfg.transport,
                             shm_dir=cfg.shm_dir, security=cfg.security, bind=cfg.bind)
    evals, accuracy, failed = 0, None, None
    try:
        with stage("data", "loading data"):
            data = load_dataset(cfg.data_dir)
        with stage("model", "building the model"):
            device = select_device(cfg.device)
            torch.manual_seed(cfg.seed)
            model = build_model(cfg.model, data.image_shape, data.num_classes).to(device)
        session.register()
        client = session.connect(session.await_layout())
        client.job = cfg.job  # the wire dtype pulled values arrive in
        params = dict(model.named_parameters())
        done = False
        while not done:
            # Wakes early when the training ends; otherwise an interval passed: evaluate as they are now.
            done = session.wait_for_training_over(cfg.eval_interval_s)
            with stage("eval", "pulling and evaluating the weights"):
                values = _pull_once_declared(client, session, list(params), cfg.startup_timeout_s)
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
    except Stopped as stop:
        log.info("got %s: stopping", stop)
        failed, code = "stopped", stop.exit_status
    finally:
        session.close()
    parts = ["final: role=evaluator"] + ([f"failed={failed}"] if failed else [])
    if accuracy is not None:
        parts.append(f"test_accuracy={accuracy:.4f}")
    parts += [f"evals={evals}", f"time_s={time.monotonic() - started:.1f}"]
    metrics.log("final", role="evaluator", test_accuracy=accuracy, evals=evals, failed=failed)
    metrics.close()
    print(" ".join(parts), file=stdout, flush=True)
    return code


_DECLARED_POLL_S = 0.2  # how often a first pull asks again while the trainers have not declared yet


def _pull_once_declared(client: PSClient, session: ClusterSession, keys: list[str], timeout_s: float
                        ) -> dict[str, np.ndarray]:
    """The weights as they are now. The trainers declare the model only after the layout the evaluator
    waited for is agreed, so an early first pull finds servers that hold none of it yet: it asks again,
    until they do, the training is over, or `timeout_s` has passed (then the servers' refusal stands)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.pull(clock=0, keys=keys)
        except UnknownKeyError:
            if time.monotonic() >= deadline:
                raise
            log.info("the servers do not hold the model yet: waiting for the trainers to declare it")
            if session.wait_for_training_over(_DECLARED_POLL_S):
                return client.pull(clock=0, keys=keys)  # over: declared by now, or never will be
