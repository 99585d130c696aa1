"""Which numbers of a worker's metrics records become which TensorBoard scalars (`scalars`), and a
`TensorBoardLog` whose records still reach the JSON lines unchanged."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from pshard.worker.run_report import MetricsLog
from pshard.worker.tensorboard_log import Scalar, TensorBoardLog, scalars
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def test_step_epoch_and_eval_records_map_to_their_tags_at_their_step() -> None:
    step = {"event": "step", "ts": 10.5, "worker": "worker-0", "step": 7, "clock": 7, "epoch": 1,
            "loss": 0.5, "accuracy": 0.75, "samples_per_s": 1200.0}
    assert scalars(step) == [Scalar("train/loss", 0.5, 7, 10.5), Scalar("train/accuracy", 0.75, 7, 10.5),
                             Scalar("train/samples_per_s", 1200.0, 7, 10.5)]
    epoch = {"event": "epoch", "ts": 11.0, "epoch": 2, "steps": 30, "loss": 0.25, "accuracy": 0.5,
             "time_s": 1.0, "samples_per_s": 900}
    assert [(s.tag, s.step) for s in scalars(epoch)] == [("epoch/loss", 2), ("epoch/accuracy", 2),
                                                         ("epoch/samples_per_s", 2)]
    evaluation = {"event": "eval", "ts": 12.0, "epoch": 2, "step": 60, "test_accuracy": 0.9, "test_loss": 0.3}
    assert scalars(evaluation) == [Scalar("test/accuracy", 0.9, 60, 12.0), Scalar("test/loss", 0.3, 60, 12.0)]


def test_a_diverged_loss_stays_visible_and_what_is_not_a_number_is_skipped() -> None:
    [loss, accuracy] = scalars({"event": "step", "ts": 1.0, "step": 3, "loss": "NaN", "accuracy": 0.1})
    assert loss.tag == "train/loss" and math.isnan(loss.value)
    assert accuracy.value == 0.1  # no samples_per_s field: none written
    assert scalars({"event": "step", "ts": 1.0, "step": 3, "loss": "Infinity"})[0].value == math.inf
    assert scalars({"event": "final", "ts": 1.0, "steps": 9, "train_loss": 0.2, "failed": None}) == []
    assert scalars({"event": "eval", "ts": 1.0, "test_accuracy": 0.5}) == []  # no step to put it at
    assert scalars({"event": "step", "ts": 1.0, "step": 1, "loss": True, "accuracy": None}) == []


def test_records_go_to_the_json_lines_unchanged_and_to_the_event_file(tmp_path: Path) -> None:
    stream = io.StringIO()
    with TensorBoardLog(MetricsLog(stream=stream, clock=lambda: 100.0, fields={"worker": "w"}),
                        tmp_path / "w") as log:
        record = log.log("step", step=1, clock=1, epoch=1, loss=2.0, accuracy=0.5, samples_per_s=64.0)
        log.log("final", steps=1)
    assert [json.loads(line) for line in stream.getvalue().splitlines()] == [
        record, {"event": "final", "ts": 100.0, "worker": "w", "steps": 1}]
    events = EventAccumulator(str(tmp_path / "w"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/accuracy", "train/loss", "train/samples_per_s"]
    [loss] = events.Scalars("train/loss")
    assert (loss.step, loss.value, loss.wall_time) == (1, 2.0, 100.0)
