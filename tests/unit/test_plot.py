"""``pshard plot``: a PNG from metrics files as the worker writes them (pshard.worker.run_report)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pshard.worker.run_report import MetricsLog

from pshard.cli import main as pshard
from pshard.plot import PlotError, read_run, run_labels


def write_run(path: Path, steps: int, rate: float, *, diverge_at: int | None = None) -> Path:
    """A run as a chief writes it: step records, per-epoch evals, a final record."""
    now = [1_700_000_000.0]

    def clock() -> float:
        now[0] += 0.05
        return now[0]

    path.parent.mkdir(parents=True, exist_ok=True)
    with MetricsLog(path, clock=clock, fields={"worker": "worker-0", "role": "chief"}) as log:
        for step in range(1, steps + 1):
            diverged = diverge_at is not None and step >= diverge_at
            loss = float("nan") if diverged else 2.3 * math.exp(-rate * step)
            log.log("step", step=step, clock=step, epoch=step // 50, loss=loss, accuracy=1 - loss / 2.5)
            if step % 50 == 0:
                log.log("eval", epoch=step // 50 - 1, step=step, test_accuracy=0.5 + 0.4 * step / steps,
                        test_loss=loss)
        log.log("final", steps=steps, train_loss=0.3, test_accuracy=0.9, failed=None, model=None)
    return path


def test_plot_draws_several_runs_into_a_png_that_is_not_blank(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from matplotlib import image

    runs = [write_run(tmp_path / f"{mode}.jsonl", 150, rate)
            for mode, rate in (("sync", 0.03), ("async", 0.02), ("ssp", 0.025))]
    out = tmp_path / "out" / "curves.png"
    assert pshard(["plot", *map(str, runs), "-o", str(out), "--title", "demo"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert 10_000 < out.stat().st_size < 200_000
    pixels = image.imread(str(out))
    assert pixels.shape[:2] == (560, 800)  # 10 x 7 inches at 80 dpi
    assert float(np.std(pixels[..., :3])) > 0.05  # lines and text, not one flat colour


def test_a_run_reads_its_curves_and_skips_a_diverged_loss(tmp_path: Path) -> None:
    [curves] = read_run(write_run(tmp_path / "run.jsonl", 100, 0.03, diverge_at=91))
    assert curves.label == "run"
    assert curves.loss_step[0] == [float(s) for s in range(1, 91)]  # NaN ("NaN" in JSON) is left out
    assert curves.test_acc_step[0] == [50.0, 100.0]
    assert curves.loss_time[0][0] == 0.0 and curves.loss_time[0][-1] > 0


def test_a_file_with_nothing_to_plot_is_an_error_naming_it(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "final", "ts": 1.0}\n')
    with pytest.raises(PlotError, match=r"empty\.jsonl: no 'step' or 'eval' records"):
        read_run(empty)
    assert pshard(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert "pshard plot: error:" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def write_shared_run(path: Path, steps: int) -> Path:
    """Two workers appending to one --metrics file, as `make demo` launches them: their records
    interleave, and worker-1 is 200 steps behind worker-0 (a late start)."""
    now = [1_700_000_000.0]

    def clock() -> float:
        now[0] += 0.05
        return now[0]

    path.parent.mkdir(parents=True, exist_ok=True)
    with MetricsLog(path, clock=clock, fields={"worker": "worker-0", "role": "chief"}) as chief, \
            MetricsLog(path, clock=clock, fields={"worker": "worker-1", "role": "worker"}) as other:
        for step in range(1, steps + 1):
            chief.log("step", step=step + 200, clock=step + 200, epoch=1, loss=1.0 / step, accuracy=0.5)
            other.log("step", step=step, clock=step, epoch=1, loss=2.0 / step, accuracy=0.4)
        chief.log("eval", epoch=1, step=steps + 200, test_accuracy=0.85, test_loss=0.4)
    return path


def test_a_file_that_two_workers_wrote_draws_one_line_per_worker(tmp_path: Path) -> None:
    path = write_shared_run(tmp_path / "runs" / "demo" / "metrics.jsonl", 60)

    chief, other = read_run(path, "demo")

    assert (chief.label, other.label) == ("demo worker-0", "demo worker-1")
    assert chief.loss_step[0] == [float(s) for s in range(201, 261)]  # one worker's steps, not a zig-zag
    assert other.loss_step[0] == [float(s) for s in range(1, 61)]
    assert other.loss_step[1][0] == 2.0 and chief.loss_step[1][0] == 1.0
    assert chief.test_acc_step == ([260.0], [0.85]) and other.test_acc_step == ([], [])
    assert (chief.run, other.run) == ("demo", "demo")  # one colour
    assert (chief.worker_index, other.worker_index) == (0, 1)  # two line styles
    assert chief.loss_time[0][0] == 0.0 and other.loss_time[0][0] > 0  # one time axis for the run


def test_runs_are_labelled_by_their_directory_not_their_file_name(tmp_path: Path) -> None:
    chiefs = [tmp_path / "runs" / mode / "worker-0.jsonl" for mode in ("sync", "async", "ssp")]
    assert run_labels(chiefs) == ["sync", "async", "ssp"]
    in_one_dir = [tmp_path / "runs" / f"{mode}.jsonl" for mode in ("sync", "async")]
    assert run_labels(in_one_dir) == ["sync", "async"]
    clashing = [tmp_path / "a" / "x" / "m.jsonl", tmp_path / "b" / "x" / "m.jsonl"]
    assert run_labels(clashing) == [str(p) for p in clashing]


def test_the_command_labels_each_line_by_run_and_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The docs' command on `make demo`-like files: the figure's legend names each run, and each
    worker of a shared file, not `worker-0` three times."""
    from matplotlib import pyplot as plt

    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "runs" / "sync" / "metrics.jsonl", 100, 0.03)
    write_shared_run(tmp_path / "runs" / "async" / "metrics.jsonl", 50)
    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its legend

    assert pshard(["plot", "runs/sync/metrics.jsonl", "runs/async/metrics.jsonl", "-o", "curves.png"]) == 0

    [figure] = figures
    loss_by_step = figure.axes[0]  # type: ignore[attr-defined]
    assert [text.get_text() for text in loss_by_step.get_legend().get_texts()] == [
        "sync", "async worker-0", "async worker-1"]
    styles = [(line.get_color(), line.get_linestyle()) for line in loss_by_step.get_lines()]
    assert styles[1][0] == styles[2][0] != styles[0][0] and styles[1][1] != styles[2][1]
