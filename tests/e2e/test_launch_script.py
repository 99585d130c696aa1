"""`pshard launch ... script.py` runs a user's own script as every worker, as torchrun does.

The script (written here, a few lines) builds a model and wraps it in `PSTrainer(model, job=...)` with
no client: it joins through TF_CONFIG, gets its rank, trains its `ShardSampler` shard in sync mode and
leaves. While it waits at a file, `pshard status` (with no flags, and with the printed command) sees it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.e2e.harness import PYTHON, Procs, start_launcher, wait_until

pytestmark = pytest.mark.e2e

RUN_TIMEOUT_S = 120

SCRIPT = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from pshard.common.job import JobConfig, OptimizerConfig
    from pshard.worker import PSTrainer, ShardSampler

    gate = Path(sys.argv[1])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    model = nn.Linear(4, 1)
    trainer = PSTrainer(model, job=JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1)))
    sampler = ShardSampler(data, trainer)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    print(f"joined rank={trainer.rank} world={trainer.world_size} chief={trainer.is_chief}", flush=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            trainer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            trainer.step()
        if epoch == 0:
            deadline = time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    clock = trainer.clock
    trainer.close()
    weight = model.weight.detach().sum().item()
    print(f"done rank={trainer.rank} clock={clock} weight={weight:.6f}", flush=True)
''')


def _status(procs: Procs, *args: str) -> subprocess.CompletedProcess[str]:
    """`pshard status` as a user types it, with the launcher's certificates' folder as its default."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("PSHARD_TLS")}
    env["PSHARD_CERTS_DIR"] = str(procs.certs_dir)
    return subprocess.run([PYTHON, "-m", "pshard", "status", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_script_joins_through_tf_config_trains_its_shard_and_pshard_status_sees_it(
        procs: Procs, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    gate = tmp_path / "gate"
    run = start_launcher(procs, "--ps", "2", "--workers", "2", str(script), str(gate))

    command = run.wait_for_line(r"see it with: (pshard status .*)$", RUN_TIMEOUT_S).group(1)
    for rank in (0, 1):
        run.wait_for_line(rf"^\[worker-{rank}\] joined rank={rank} world=2 chief={rank == 0}$", RUN_TIMEOUT_S)
    # Both wait at the gate after epoch 0 (6 clocks: 48 samples each in batches of 8).
    printed = shlex.split(command)[2:]
    plain = _status(procs)
    assert plain.returncode == 0, plain.stderr
    assert re.search(r"^worker-0\s+worker\s+live", plain.stdout, re.M), plain.stdout
    assert re.search(r"^worker-1\s+worker\s+live", plain.stdout, re.M), plain.stdout
    as_printed = _status(procs, *printed)
    assert as_printed.returncode == 0, as_printed.stderr
    assert "worker-1" in as_printed.stdout
    gate.write_text("")

    code = run.wait(RUN_TIMEOUT_S)
    assert code == 0, run.output()
    done = {m.group(1): (int(m.group(2)), m.group(3)) for line in run.lines
            if (m := re.match(r"^\[(worker-\d)\] done rank=\d clock=(\d+) weight=(\S+)$", line))}
    assert set(done) == {"worker-0", "worker-1"}, run.output()
    assert done["worker-0"] == done["worker-1"] == (12, done["worker-0"][1]), run.output()
    # The launch record is gone with the launcher: a plain status has no job to show.
    records = procs.certs_dir.parent / "launches"
    wait_until(lambda: not list(records.glob("*.json")), 10, "the launch record removed")
