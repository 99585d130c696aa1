"""The docs' by-hand TF_CONFIG example, read from docs/guide/tf-config.md itself and run as written.

A scheduler, two parameter servers and two workers, each with its own TF_CONFIG, started by the
page's own bash block. The only changes are what one test run needs: the block's fixed ports
become free ones, and the workers get a few steps, on scikit-learn's digits (an empty
PSHARD_DATA_DIR), with bounded waits. The block must then train, save the model, stop the servers
(with their final checkpoints) and exit 0.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.e2e.harness import PYTHON, ROOT, TIMEOUTS, Procs, free_ports, parse_final

pytestmark = pytest.mark.e2e

PAGE = ROOT / "docs" / "guide" / "tf-config.md"
PORTS = ("7000", "7100", "7101", "7200", "7201")
STEPS = ("--max-steps", "5")
FINISH_TIMEOUT_S = 120


def readme_block() -> str:
    """The page's bash block, exactly as the docs show it."""
    return PAGE.read_text(encoding="utf-8").split("```bash\n", 1)[1].split("```", 1)[0]


def for_this_run(block: str, ports: list[int]) -> str:
    for fixed, free in zip(PORTS, ports, strict=True):
        assert f"127.0.0.1:{fixed}" in block, fixed
        block = block.replace(f"127.0.0.1:{fixed}", f"127.0.0.1:{free}")
    workers = block.count("pshard worker ")
    assert workers == 2, block
    block = block.replace("pshard worker ", f"pshard worker {' '.join((*STEPS, *TIMEOUTS))} ")
    return "set -euo pipefail\n" + block


def test_the_block_is_plain_runnable_bash():
    block = readme_block()

    assert "…" not in block and "..." not in block
    assert all(f"127.0.0.1:{port}" in block for port in PORTS)
    assert {"pshard scheduler", "pshard ps", "pshard worker"} <= {m.group(0) for m in
                                                                re.finditer(r"pshard \w+", block)}


def test_the_readme_tf_config_block_trains_to_completion(procs: Procs, tmp_path: Path) -> None:
    script = for_this_run(readme_block(), free_ports(len(PORTS)))
    data_dir = tmp_path / "no-dataset"
    data_dir.mkdir()
    # `pshard` from this test run's environment, as after `. .venv/bin/activate`.
    path = os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", "")])
    assert shutil.which("pshard", path=path), "the pshard command is not installed beside this python"

    block = procs.start("readme", ["bash", "-c", script], cwd=tmp_path,
                        env={"PATH": path, "PSHARD_DATA_DIR": str(data_dir)})

    assert block.wait(FINISH_TIMEOUT_S) == 0, block.output()
    finals = [fields for line in block.lines if (fields := parse_final(line)) is not None]
    assert len(finals) == 2, block.output()
    assert (tmp_path / "runs" / "model.pt").stat().st_size > 0
    for ps in ("ps-0", "ps-1"):  # the final checkpoints of the SIGTERM the block sends
        assert (tmp_path / "runs" / "ckpt" / ps / "shard.json").is_file(), block.output()
