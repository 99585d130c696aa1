"""``--tensorboard DIR``: a short real training job (scheduler, server, chief on 127.0.0.1) writes event
files that TensorBoard's own reader reads back with the same numbers as the JSON metrics lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.harness import TIMEOUTS, LocalCluster, Procs, read_metrics


def test_scalars_read_back_from_a_workers_event_file_match_its_metrics(procs: Procs, tmp_path: Path) -> None:
    board = tmp_path / "tb"
    cluster = LocalCluster(procs, num_ps=1, num_workers=1)
    cluster.start_servers()
    chief = cluster.start_worker(0, "--mode", "sync", "--lr", "0.05", "--epochs", "2", "--log-every", "3",
                                 "--tensorboard", str(board), *TIMEOUTS)
    assert chief.wait(120) == 0, chief.output()

    runs = [p.parent for p in board.rglob("events.out.tfevents.*")]
    assert runs == [board / "worker-0"]  # one run per worker, named by its node id
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    records = read_metrics(cluster.metrics("worker-0"))

    def read(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    def logged(event: str, x: str, field: str) -> list[tuple[object, object]]:
        """(x, field) of the `event` lines as JSON gave them; the field compares within rel 1e-6."""
        return [(r[x], pytest.approx(r[field], rel=1e-6)) for r in records if r["event"] == event]

    steps = [r["step"] for r in records if r["event"] == "step"]
    assert len(steps) >= 3 and all(isinstance(step, int) and step % 3 == 0 for step in steps)
    assert read("train/loss") == logged("step", "step", "loss")
    assert read("train/accuracy") == logged("step", "step", "accuracy")
    assert read("train/samples_per_s") == logged("step", "step", "samples_per_s")
    assert all(value > 0 for _, value in read("train/samples_per_s"))
    assert [step for step, _ in read("epoch/loss")] == [1, 2]
    assert read("epoch/accuracy") == logged("epoch", "epoch", "accuracy")
    final = chief.final()
    assert final is not None
    [*_, (last_step, accuracy)] = read("test/accuracy")
    assert last_step == int(final["steps"]) and f"{accuracy:.4f}" == final["test_accuracy"]
