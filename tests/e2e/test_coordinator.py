"""Coordinator-driven training with real processes: a scheduler, parameter servers and serving workers
(`pshard worker --serve`), the coordinator in this test. 200 scheduled increments of known sizes, one worker
SIGKILLed right after a call's push landed: the call runs again elsewhere, and the variable ends at exactly
the sum (the re-run's push is dropped by its schedule id, nothing is lost). An evaluator sidecar scoring the
weights while the coordinator trains. TensorFlow's sample, and the Fashion-MNIST example to the issue's
accuracy, through `pshard launch --coordinator`.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from pshard.coordinator.coordinator import ClusterCoordinator
from pshard.launcher.plan import ClusterPlan
from pshard.worker.session import ClusterSession

from tests.e2e.harness import Proc, Procs, free_port, start_launcher, wait_healthy, wait_until
from tests.service import coordinator_functions as f

# Its waits add up past pytest's 120 s default under load (WAIT_S each): the mark covers their bound.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WAIT_S = 60.0
INCREMENTS = 200
KILLED_CALL = 60  # the call whose first run is killed after its push


def start_cluster(procs: Procs, plan: ClusterPlan, evaluator: str = "") -> dict[str, Proc]:
    """The plan's scheduler, servers and serving workers; with `evaluator` (its address) an evaluator task
    of the demo's MLP too."""
    started: dict[str, Proc] = {}
    for task in plan.servers:
        if task.task_type == "scheduler":
            argv = ["-m", "pshard.scheduler", "--heartbeat-interval-ms", "200",
                    "--heartbeat-timeout-ms", "1500"]
        else:
            argv = ["-m", "pshard.ps_server"]
        started[task.name] = procs.python(task.name, *argv, "--bind", task.address,
                                          tf_config=plan.tf_config(task))
    for task in plan.servers:
        wait_healthy(task.address, proc=started[task.name])
    for task in plan.trainers:
        if task.task_type == "worker":
            started[task.name] = procs.python(task.name, "-m", "pshard.worker", "--serve",
                                              tf_config=plan.tf_config(task))
    if evaluator:
        config = {"cluster": {**plan.cluster(), "evaluator": [evaluator]},
                  "task": {"type": "evaluator", "index": 0}}
        started["evaluator"] = procs.python("evaluator", "-m", "pshard.worker", "--model", "mlp",
                                            "--eval-interval-s", "0.5", tf_config=json.dumps(config))
    return started


def test_200_increments_count_exactly_once_when_a_worker_is_sigkilled_mid_call(
        procs: Procs, tmp_path: Path) -> None:
    plan = ClusterPlan.allocate(2, 3, chief=True)
    started = start_cluster(procs, plan)
    chief = next(t for t in plan.trainers if t.task_type == "chief")
    spec = ClusterSession.from_environment({"TF_CONFIG": plan.tf_config(chief)}).spec
    session = ClusterSession(spec, startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S)
    marker = str(tmp_path / "killed-call")
    sizes = list(range(1, INCREMENTS + 1))

    with ClusterCoordinator(session=session) as coordinator:
        v = coordinator.create_variable("v", np.zeros(1, np.float32))
        results = [coordinator.schedule(f.add_then_hold, args=(v, float(x), marker)) if x == KILLED_CALL
                   else coordinator.schedule(f.add, args=(v, float(x))) for x in sizes]
        wait_until(lambda: Path(marker).exists() and Path(marker).read_text(), WAIT_S,
                   f"call {KILLED_CALL} to push and hold")
        pid = int(Path(marker).read_text())
        victim = next(p for p in started.values() if p.pid == pid)
        victim.signal_group(signal.SIGKILL)
        coordinator.join(timeout_s=WAIT_S)

        assert [r.fetch() for r in results] == [float(x) for x in sizes]
        assert results[KILLED_CALL - 1].worker != victim.name
        assert coordinator.redispatched >= 1
        assert v.read_value().tolist() == [float(sum(sizes))]  # 20100: nothing twice, nothing lost
    for name, proc in started.items():  # the coordinator left: the serving workers exit by themselves
        if name.startswith("worker") and proc is not victim:
            assert proc.wait(WAIT_S) == 0


def test_tensorflows_sample_through_pshard_launch_prints_the_value_last(procs: Procs) -> None:
    launcher = start_launcher(procs, "--ps", "2", "--workers", "2", "--insecure",
                              "--coordinator", "examples/coordinator_sum.py")
    assert launcher.wait(WAIT_S) == 0, launcher.output()

    children = [line for line in launcher.lines if line.startswith("[chief-0]")]
    assert children[-1] == "[chief-0] final: v = 15"
    assert launcher.lines[-1].startswith("launcher: exit 0: chief-0=0 worker-0=0 worker-1=0")


def test_an_evaluator_sidecar_scores_the_weights_while_the_coordinator_trains(procs: Procs) -> None:
    from pshard.worker.data import load_dataset
    from pshard.worker.model import build_model

    image_shape = load_dataset().image_shape  # what the evaluator will read, Fashion-MNIST or the digits
    plan = ClusterPlan.allocate(1, 2, chief=True)
    started = start_cluster(procs, plan, evaluator=f"127.0.0.1:{free_port()}")
    chief = next(t for t in plan.trainers if t.task_type == "chief")
    spec = ClusterSession.from_environment({"TF_CONFIG": plan.tf_config(chief)}).spec
    evaluator = started["evaluator"]

    with ClusterCoordinator(session=ClusterSession(spec, startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S)) \
            as coordinator:
        coordinator.create_variables(dict(build_model("mlp", image_shape, 10).state_dict()))
        it = iter(coordinator.create_per_worker_dataset(f.synthetic_batches, image_shape, 0))
        steps = 0
        while steps < 40 or not any("eval 2:" in line for line in evaluator.lines):
            assert steps < 5000, evaluator.output()  # it evaluates every 0.5 s: long before this
            coordinator.schedule(f.train_mlp, args=(it,)).fetch(WAIT_S)
            steps += 1

    assert evaluator.wait(WAIT_S) == 0, evaluator.output()  # the training is over: its final evaluation
    final = evaluator.final()
    assert final is not None and final["role"] == "evaluator" and int(final["evals"]) >= 3
    assert 0.0 <= float(final["test_accuracy"]) <= 1.0


MNIST_BAR = 0.85  # the issue's bar; async: 0.847-0.872 at 3000 steps under load, so the example runs 4000
MNIST_TIMEOUT_S = 240.0  # about 40 s of training on 2 busy cores, plus the data and start-ups


@pytest.mark.timeout(300)
def test_the_coordinator_mnist_example_reaches_the_issues_accuracy(procs: Procs) -> None:
    launcher = start_launcher(procs, "--ps", "2", "--workers", "2", "--insecure",
                              "--coordinator", "examples/coordinator_mnist.py")
    assert launcher.wait(MNIST_TIMEOUT_S) == 0, launcher.output()

    finals = [line for line in launcher.lines if line.startswith("[chief-0] final: test_accuracy=")]
    assert len(finals) == 1, launcher.output()
    assert float(finals[0].rsplit("=", 1)[1]) >= MNIST_BAR, finals[0]
