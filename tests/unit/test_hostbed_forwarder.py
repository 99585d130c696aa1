"""The delay/loss forwarder's queueing (bench/hostbed/forwarder.py), driven with a pipe and a given clock."""

from __future__ import annotations

import os
import random

import pytest

from bench.hostbed.forwarder import Direction, Impairment


def test_frames_are_held_for_the_delay_and_leave_in_order() -> None:
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(read_end, False)
        way = Direction(src=-1, dst=write_end)
        slow = Impairment(delay_ms=50)
        for i, now in enumerate((0.0, 0.01, 0.02)):
            way.take(bytes([i]), now, slow, random.Random(0))
        way.flush(0.049)
        with pytest.raises(BlockingIOError):
            os.read(read_end, 16)
        way.flush(0.061)
        assert os.read(read_end, 16) == bytes([0, 1])
        assert way.next_due() == pytest.approx(0.07)
        way.flush(0.07)
        assert os.read(read_end, 16) == bytes([2])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_loss_drops_that_share_of_frames() -> None:
    way = Direction(src=-1, dst=-1)
    lossy, rng = Impairment(loss=0.25), random.Random(7)
    for _ in range(4000):
        way.take(b"x", 0.0, lossy, rng)
    assert 800 < way.dropped < 1200 and len(way.queue) == 4000 - way.dropped


@pytest.mark.parametrize("line", ['{"loss": 1.5}', '{"delay_ms": -1}'])
def test_bad_settings_are_refused_with_their_values_and_change_nothing(line: str) -> None:
    impairment = Impairment(delay_ms=10, loss=0.1)
    with pytest.raises(ValueError, match="got delay_ms="):
        impairment.update(line)
    assert (impairment.delay_ms, impairment.loss) == (10, 0.1)
