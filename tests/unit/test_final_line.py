"""The trainer's `final:` line: what a user and the launcher read at the end of a run."""

from __future__ import annotations

from pshard.worker.train import Outcome


def test_a_worker_that_trained_steps_shows_its_loss_even_when_it_is_nan() -> None:
    assert "train_loss=0.2500" in Outcome(steps=12, train_loss=0.25).final_line("worker")
    assert "train_loss=nan" in Outcome(steps=12, train_loss=float("nan")).final_line("worker")  # diverged


def test_a_worker_that_rejoined_a_finished_job_shows_no_loss_it_never_had() -> None:
    line = Outcome(steps=0, skipped=90).final_line("worker")
    assert line.startswith("final: role=worker steps=0 skipped=90 time_s=")
    assert "train_loss" not in line


def test_a_run_stopped_before_an_epoch_ended_shows_no_nan_loss_but_the_epochs_loss_so_far() -> None:
    line = Outcome(steps=40, failed="stopped", loss_so_far=0.6125).final_line("worker")
    assert line.startswith("final: role=worker failed=stopped steps=40 epoch_loss_so_far=0.6125 time_s=")
    assert "nan" not in line
    assert "nan" not in Outcome(steps=0, failed="stopped").final_line("worker")
    assert "train_loss=0.3000" in Outcome(steps=90, failed="stopped", train_loss=0.3).final_line("worker")
