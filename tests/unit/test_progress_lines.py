"""Off a terminal, a worker's Progress also prints a live line every few seconds: under the
launcher each worker's line (prefixed with its name) is the job's progress."""

from __future__ import annotations

import io

from pshard.worker.run_report import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_live_line_every_interval_with_step_loss_and_samples_per_second() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress(epochs=2, stream=stream, clock=clock, live_every_s=10.0)
    progress.start_epoch(0, total_steps=100)
    for _ in range(40):
        clock.now += 0.5
        progress.update(samples=64, loss=0.25)
    assert stream.getvalue().splitlines() == [
        "epoch 1/2: step 20/100, loss=0.25, 128 samples/s",
        "epoch 1/2: step 40/100, loss=0.25, 128 samples/s",
    ]


def test_no_live_lines_unless_asked_and_never_on_a_terminal() -> None:
    stream, clock = io.StringIO(), Clock()
    quiet = Progress(epochs=1, stream=stream, clock=clock)
    quiet.start_epoch(0, total_steps=10)
    for _ in range(10):
        clock.now += 5
        quiet.update(samples=1, loss=1.0)
    assert stream.getvalue() == ""
    terminal = io.StringIO()
    bar = Progress(epochs=1, stream=terminal, tty=True, clock=clock, live_every_s=1.0)
    bar.start_epoch(0, total_steps=10)
    for _ in range(10):
        clock.now += 5
        bar.update(samples=1, loss=1.0)
    bar.close()
    assert "epoch 1/1" in terminal.getvalue() and "samples/s" not in terminal.getvalue()  # tqdm's bar only
