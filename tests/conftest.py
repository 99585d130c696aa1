"""The `procs` fixture for every test that starts real processes; the helpers live in tests/e2e/harness.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Procs


def pytest_configure(config: pytest.Config) -> None:
    # As `pshard worker` and the launcher set it for trainers: torch's OpenMP threads otherwise spin
    # after each parallel region, and in this process they spin against the servers and workers a
    # test starts on the same cores (the digits MLP test took 4x as long on a busy machine). OpenMP
    # reads it once, when torch loads: before any test module imports torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    pool = Procs(tmp_path)
    try:
        yield pool
    finally:
        pool.kill_all()
        # Captured, so pytest shows it only for a failing test: every process's side of the story.
        for proc in pool.started:
            print(f"--- {proc.name} (pid {proc.pid}, exit {proc.popen.returncode}) ---\n{proc.output(80)}")
