"""`make demo-ctr`'s training, run for real at a smaller size: the launcher starts a scheduler, 2 servers
and 2 workers, the workers train the CTR model (a sparse table and an MLP) on their shards of the click
log, and the chief's AUC lands near the planted model's on the same test set.

The demo's own flags come from `make demo-ctr-args` (so the two cannot drift); the later size flags
override them: 0.5 M impressions over 100 k ids instead of 3 M over 4 M, about 20 s on 2 busy cores.
At that size the gap to the ceiling measured 0.023 (the full demo's: 0.015).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import Procs, finals, read_metrics, start_launcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(660)]  # the full demo is bounded by FULL_DEMO_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
SMALL = ("--ctr-samples", "524288", "--ctr-ids", "100000", "--ctr-test-samples", "50000")
TIMEOUT_S = 60
GAP_BAR = 0.04  # measured 0.023 at this size; the full demo's bar is 0.02
DEMO_GAP_BAR = 0.02  # the issue's bar; measured 0.015
FULL_DEMO_TIMEOUT_S = 600  # 90 s on 2 cores shared with other jobs; generous for a loaded CI machine


def demo_ctr_args() -> list[str]:
    out = subprocess.run(["make", "--no-print-directory", "-s", "demo-ctr-args"], cwd=REPO,
                         capture_output=True, text=True, timeout=30, check=True)
    return shlex.split(out.stdout)


def test_a_small_ctr_job_trains_near_the_planted_models_auc(procs: Procs, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    run = start_launcher(procs, "--ps", "2", "--workers", "2", "--", *demo_ctr_args(), *SMALL,
                         "--metrics", str(metrics))

    code = run.wait(TIMEOUT_S)

    assert code == 0, run.output()
    results = finals(run)
    chief, worker = results["worker-0"], results["worker-1"]
    assert chief["role"] == "chief" and worker["role"] == "worker", results
    got, ceiling = float(chief["test_auc"]), float(chief["ceiling_auc"])
    assert 0.70 <= ceiling <= 0.85, chief
    assert got > 0.70, chief  # far above a coin's 0.5
    assert ceiling - got < GAP_BAR, chief
    # Both workers trained their own shard (32 chunks of 16,384, 16 each, batches of 1,024).
    assert int(chief["steps"]) == int(worker["steps"]) == 256, results
    evals = [r for r in read_metrics(metrics) if r["event"] == "eval"]
    assert len(evals) == 1 and evals[0]["test_auc"] == pytest.approx(got, abs=1e-4), evals
    rows = evals[0]["table_rows"]  # the rows live on the servers, created on first touch
    assert isinstance(rows, int) and rows > 50_000, evals
    summary = re.compile(rf"\[worker-0\] CTR test AUC {got:.4f}, planted model \(ceiling\) "
                         rf"{ceiling:.4f}, gap 0\.\d{{4}} on 50000 test impressions; "
                         rf"{rows} embedding rows")
    assert any(summary.match(line) for line in run.lines), run.output()


def test_the_full_demo_trains_within_the_issues_bar_of_the_ceiling(procs: Procs, tmp_path: Path) -> None:
    """`make demo-ctr` exactly (3 M impressions over 4 M ids): 90 s on 2 busy cores; the time bar (3 min) is
    the README's measured figure, not asserted on a shared machine, the AUC bar is."""
    run = start_launcher(procs, "--ps", "2", "--workers", "2", "--", *demo_ctr_args())

    code = run.wait(FULL_DEMO_TIMEOUT_S)

    assert code == 0, run.output()
    chief = finals(run)["worker-0"]
    got, ceiling = float(chief["test_auc"]), float(chief["ceiling_auc"])
    assert 0.70 <= ceiling <= 0.85, chief
    assert ceiling - got <= DEMO_GAP_BAR, chief


@pytest.mark.parametrize("command", [[sys.executable, "-m", "pshard.worker"],
                                     [str(Path(sys.executable).with_name("pshard")), "worker"]])
def test_the_worker_help_offers_the_ctr_model(command: list[str]) -> None:
    out = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout

    assert "{mlp,cnn,ctr}" in out
    for flag in ("--ctr-samples", "--ctr-ids", "--ctr-test-samples", "--table-lr", "--table-row-dtype"):
        assert flag in out, flag


def test_ctr_refuses_an_output_path_it_could_not_honour(tmp_path: Path) -> None:
    tf_config = ('{"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, '
                 '"task": {"type": "worker", "index": 0}}')
    done = subprocess.run([sys.executable, "-m", "pshard.worker", "--model", "ctr", "--output",
                           str(tmp_path / "model.pt")], capture_output=True, text=True, timeout=60,
                          env={"TF_CONFIG": tf_config, "PATH": "/usr/bin:/bin"})

    assert done.returncode == 2, done.stderr
    assert "--output: not available with --model ctr" in done.stderr
