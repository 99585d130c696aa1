"""Under the launcher (no terminal) every worker shows its progress while it trains: one line per
worker, prefixed with its name, with epoch, step, loss and samples/s."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.harness import FINISH_TIMEOUT_S, TIMEOUTS, Procs, start_launcher

LINE = re.compile(r"^\[(worker-\d)\] epoch (\d)/3: step (\d+)/(\d+), loss=[0-9.e+-]+, (\d+) samples/s$")


def test_the_launcher_shows_live_progress_for_every_worker(procs: Procs, tmp_path: Path) -> None:
    empty = tmp_path / "no-data"  # digits
    empty.mkdir()
    launcher = start_launcher(procs, "--ps", "1", "--workers", "2", "--", "--data-dir", str(empty),
                              "--model", "mlp", "--epochs", "3", "--batch-size", "16",
                              # digits train an epoch in ~0.1 s here: a line every few steps
                              "--progress-every-s", "0.005", *TIMEOUTS)
    assert launcher.wait(FINISH_TIMEOUT_S * 2) == 0, launcher.output()
    progress = [m for line in launcher.lines if (m := LINE.match(line))]
    assert {m.group(1) for m in progress} == {"worker-0", "worker-1"}, launcher.output()
    for m in progress:
        assert 0 < int(m.group(3)) <= int(m.group(4)) and int(m.group(5)) > 0, m.group(0)
