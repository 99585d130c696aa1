"""``pshard plot``: a PNG from metrics files as the worker writes them (pshard.worker.metrics)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pshard.worker.metrics import MetricsLog

from pshard.cli import main as pshard
from pshard.plot import PlotError, read_run


def write_run(path: Path, steps: int, rate: float, *, diverge_at: int | None = None) -> Path:
    """A run as a chief writes it: step records, per-epoch evals, a final record."""
    now = [1_700_000_000.0]

    def clock() -> float:
        now[0] += 0.05
        return now[0]

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
    curves = read_run(write_run(tmp_path / "run.jsonl", 100, 0.03, diverge_at=91))
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
