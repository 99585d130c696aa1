"""worker.run_report: JSON-lines events and the TTY-aware progress display."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pshard.worker.run_report import MetricsLog, Progress


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- MetricsLog ---


def test_each_event_is_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "metrics.jsonl"  # parent directories are created
    clock = FakeClock()
    with MetricsLog(path, clock=clock) as metrics:
        metrics.log("step", epoch=0, step=1, loss=2.5)
        clock.now += 1.5
        metrics.log("epoch", epoch=0, loss=0.4, seconds=1.5)
        metrics.log("eval", epoch=0, accuracy=0.87)
        metrics.log("final", accuracy=0.88)
    records = read_lines(path)
    assert [r["event"] for r in records] == ["step", "epoch", "eval", "final"]
    assert records[0] == {"event": "step", "ts": 1000.0, "epoch": 0, "step": 1, "loss": 2.5}
    assert records[1]["ts"] == 1001.5


def test_lines_are_on_disk_before_close(tmp_path: Path) -> None:
    # A worker killed mid-run must leave every event it logged.
    path = tmp_path / "m.jsonl"
    metrics = MetricsLog(path)
    metrics.log("step", step=1)
    assert read_lines(path)[0]["step"] == 1
    metrics.close()


def test_writes_to_a_stream_and_a_file_alike(tmp_path: Path) -> None:
    stream = io.StringIO()
    with MetricsLog(tmp_path / "m.jsonl", stream=stream, clock=FakeClock()) as metrics:
        metrics.log("final", accuracy=0.9)
    assert stream.getvalue() == (tmp_path / "m.jsonl").read_text()
    assert json.loads(stream.getvalue()) == {"event": "final", "ts": 1000.0, "accuracy": 0.9}


def test_appends_to_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    for step in (1, 2):
        with MetricsLog(path) as metrics:
            metrics.log("step", step=step)
    assert [r["step"] for r in read_lines(path)] == [1, 2]


def test_numpy_and_torch_scalars_become_plain_numbers() -> None:
    stream = io.StringIO()
    MetricsLog(stream=stream).log(
        "step", loss=torch.tensor(0.25), acc=np.float32(0.5), n=np.int64(3), per_class=[np.float64(1.0)]
    )
    record = json.loads(stream.getvalue())
    del record["ts"]
    assert record == {"event": "step", "loss": 0.25, "acc": 0.5, "n": 3, "per_class": [1.0]}


def test_non_finite_values_stay_strict_json() -> None:
    stream = io.StringIO()
    MetricsLog(stream=stream).log("step", loss=math.nan, grad=math.inf, low=-math.inf)
    line = stream.getvalue()
    # Strict parsers reject bare NaN: parse with constants forbidden.
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line!r}"))
    assert record["loss"] == "NaN" and record["grad"] == "Infinity" and record["low"] == "-Infinity"


def test_unknown_event_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'batch'.*\('step', 'epoch', 'eval', 'final'\)"):
        MetricsLog(stream=io.StringIO()).log("batch")


# --- Progress ---


def test_non_tty_prints_one_plain_line_per_epoch_and_no_bar() -> None:
    stream = io.StringIO()
    clock = FakeClock(0.0)
    progress = Progress(epochs=2, stream=stream, clock=clock)
    assert not progress.tty
    for epoch in range(2):
        progress.start_epoch(epoch, total_steps=3)
        for _ in range(3):
            progress.update(loss=0.5)
        clock.now += 2.0
        progress.end_epoch(loss=0.123456, acc=0.9)
    progress.close()
    assert stream.getvalue().splitlines() == [
        "epoch 1/2: 3 steps in 2.0s, loss=0.1235, acc=0.9",
        "epoch 2/2: 3 steps in 2.0s, loss=0.1235, acc=0.9",
    ]
    assert "\r" not in stream.getvalue()


def test_tty_shows_a_live_bar_then_the_summary_line() -> None:
    stream = TtyStream()
    progress = Progress(epochs=1, stream=stream)
    assert progress.tty
    progress.start_epoch(0, total_steps=4)
    for _ in range(4):
        progress.update(loss=0.5)
    line = progress.end_epoch(loss=0.5)
    out = stream.getvalue()
    # tqdm's bar, drawn in place with carriage returns (later redraws are rate-limited by time).
    assert "\repoch 1/1:   0%|" in out and "0/4" in out
    assert out.endswith(line + "\n") and line.startswith("epoch 1/1: 4 steps in")


def test_tty_can_be_forced_either_way() -> None:
    assert Progress(epochs=1, stream=io.StringIO(), tty=True).tty
    assert not Progress(epochs=1, stream=TtyStream(), tty=False).tty
