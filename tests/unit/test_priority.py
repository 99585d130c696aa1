"""Layer priority's order (pshard.worker.priority): of the queued buckets, the oldest step's first, and
within a step the one nearest the model's input (the highest depth; 0 is the last layer)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pshard.worker.priority import PushQueue, take_one


def test_the_bucket_nearest_the_input_goes_first_whatever_order_backward_queued_them() -> None:
    queue: PushQueue[str] = PushQueue()
    for depth in (0, 1, 2, 3):  # backward's order: the last layer's bucket is ready first
        queue.put(7, depth, f"bucket {depth}")
    assert [queue.take() for _ in range(4)] == ["bucket 3", "bucket 2", "bucket 1", "bucket 0"]
    assert len(queue) == 0


def test_an_older_steps_bucket_goes_before_a_newer_steps_first_layer() -> None:
    queue: PushQueue[str] = PushQueue()
    queue.put(8, 5, "clock 8, first layer")
    queue.put(7, 0, "clock 7, last layer")
    assert queue.take() == "clock 7, last layer"


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20)), min_size=1, max_size=30))
def test_takes_come_out_by_clock_then_depth_descending(items: list[tuple[int, int]]) -> None:
    queue: PushQueue[tuple[int, int]] = PushQueue()
    for clock, depth in items:
        queue.put(clock, depth, (clock, depth))
    taken = [queue.take() for _ in items]
    assert taken == sorted(items, key=lambda item: (item[0], -item[1]))


def test_take_one_runs_the_most_urgent_send_and_an_empty_queue_says_so() -> None:
    ran: list[int] = []
    queue: PushQueue = PushQueue()
    queue.put(0, 0, lambda: ran.append(0))
    queue.put(0, 1, lambda: ran.append(1))
    take_one(queue)
    assert ran == [1]
    take_one(queue)
    assert ran == [1, 0]
    with pytest.raises(IndexError):
        queue.take()


def test_pshard_worker_takes_priority_with_overlap_and_refuses_it_alone(tmp_path, capsys) -> None:
    from pshard.worker.__main__ import config_from_args

    base = ["--data-dir", str(tmp_path), "--insecure"]
    env = {"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, '
                        '"task": {"type": "worker", "index": 0}}'}
    cfg = config_from_args([*base, "--overlap", "--priority"], env)
    assert cfg.overlap and cfg.priority
    assert not config_from_args([*base, "--overlap"], env).priority
    with pytest.raises(SystemExit) as info:
        config_from_args([*base, "--priority"], env)
    assert info.value.code == 2
    assert "--priority: given without --overlap" in capsys.readouterr().err
