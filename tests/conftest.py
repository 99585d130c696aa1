"""The `procs` fixture for every test that starts real processes; the helpers live in tests/e2e/harness.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Procs


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
