"""examples/train_own_loop.py under `pshard launch --ps 2 --workers 2`, with a worker SIGKILLed halfway.

The user's own script (a BatchNorm convnet, `DataLoader(num_workers=2)` over a `ShardSampler`, `StepLR`
on the servers' SGD) trains under the launcher with `--restart on-failure`; worker-1 is killed at the
end of the second of four epochs, restarted, and rejoins at the job's clock. It must end with the same buffers
on both workers, the schedule's last learning rate, and a saved model as accurate (within 0.5 pp) as
the same script trained in one process with torch.optim on the union of the workers' batches.

Fashion-MNIST's first 3000 training images (4 epochs of 24 union batches of 128) keep it to a couple
of minutes on two busy cores; where the dataset is missing, the example falls back to the digits.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.e2e.harness import ROOT, Proc, Procs, start_launcher, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]  # the run itself is bounded by RUN_TIMEOUT_S

EXAMPLE = ROOT / "examples" / "train_own_loop.py"
ARGS = ("--epochs", "4", "--train-size", "3000", "--batch-size", "64", "--lr", "0.05")
STEPS = 24  # per worker and epoch: 1500 images in batches of 64
RUN_TIMEOUT_S = 360
# 0.5 pp: the two runs differ only in BatchNorm's batch statistics (each worker normalises its own 64
# images, the local run the union's 128).
ACCURACY_TOLERANCE = 0.005
FINAL = re.compile(r"final: rank=(\d) test_accuracy=(\S+) lr=(\S+) buffers=(\w+)$")


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_own_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _saved_accuracy(example: ModuleType, path: Path) -> float:
    from pshard.worker.data import load_dataset

    data = load_dataset(None)
    model = example.build_model()
    model.load_state_dict(torch.load(path, weights_only=True))
    return float(example.accuracy(model, TensorDataset(torch.from_numpy(data.test_x),
                                                       torch.from_numpy(data.test_y))))


def _worker_pid(launcher: Proc, index: int) -> int:
    """The launcher's child running worker `index` (its DataLoader processes share its environment)."""
    marker = f"PSHARD_LAUNCHER_PID={launcher.pid}".encode()
    task = f'"task": {{"type": "worker", "index": {index}}}'.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if marker in environ and parent == launcher.pid and any(task in v for v in environ):
            return int(entry.name)
    raise AssertionError(f"no worker-{index} child of the launcher:\n{launcher.output()}")


def _finals(lines: list[str]) -> dict[int, tuple[float, float, str]]:
    found = {}
    for line in lines:
        if match := FINAL.search(line):
            found[int(match.group(1))] = (float(match.group(2)), float(match.group(3)), match.group(4))
    return found


def test_own_loop_survives_a_killed_worker_and_matches_the_local_run(procs: Procs, tmp_path: Path) -> None:
    local = procs.python("local", str(EXAMPLE), "--local", *ARGS, "--output", str(tmp_path / "local.pt"))
    # A heartbeat timeout longer than a restart takes: worker-1 is back before it is declared dead and
    # rejoins at the clock worker-0 waits at, so the job trains no step without it (a kill noticed by
    # the scheduler is test_launcher's and test_chaos's).
    run = start_launcher(procs, "--ps", "2", "--workers", "2", "--restart", "on-failure",
                         "--scheduler-timeout-ms", "90000", str(EXAMPLE), *ARGS,
                         "--output", str(tmp_path / "model.pt"))

    run.wait_for_line(rf"^\[worker-1\] epoch 2/4: rank=1 steps={STEPS} ", RUN_TIMEOUT_S)
    os.killpg(_worker_pid(run, 1), signal.SIGKILL)
    run.wait_for_line(r"launcher: worker-1 exited \(.*SIGKILL.*\); restarting it", 60)

    assert run.wait(RUN_TIMEOUT_S) == 0, run.output(120)
    assert local.wait(RUN_TIMEOUT_S) == 0, local.output()
    finals = _finals(run.lines)
    assert set(finals) == {0, 1}, run.output(120)
    (_, lr0, buffers0), (_, lr1, buffers1) = finals[0], finals[1]
    assert buffers0 == buffers1, run.output(120)  # BatchNorm's running statistics follow the job
    assert lr0 == lr1 == pytest.approx(0.05 * 0.5 ** 2)  # StepLR(step_size=2, gamma=0.5) after 4 epochs
    # The restarted worker rejoined at the job's clock: it skipped the epochs the job had trained, and
    # trained the rest with worker-0.
    lines = "\n".join(run.lines)
    for epoch, steps in ((1, 0), (2, 0), (4, STEPS)):
        assert f"[worker-1] epoch {epoch}/4: rank=1 steps={steps} " in lines, run.output(120)
    for epoch in range(1, 5):
        assert f"[worker-0] epoch {epoch}/4: rank=0 steps={STEPS} " in lines, run.output(120)

    example = _example()
    wait_until(lambda: (tmp_path / "model.pt").exists(), 10, "the chief's saved model")
    trained, alone = _saved_accuracy(example, tmp_path / "model.pt"), _saved_accuracy(example,
                                                                                     tmp_path / "local.pt")
    assert abs(trained - alone) <= ACCURACY_TOLERANCE, (trained, alone)
    assert trained > 0.7  # it learned (chance is 0.1)
