"""The scheduler's bounded history of drains, joins and partition moves (scheduler/history.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from pshard.scheduler.history import History
from pshard.scheduler.timed import Timed


@dataclass(frozen=True)
class Record(Timed):
    name: str
    started: float
    ended: float | None = None


def test_records_stay_in_the_order_they_were_added_and_a_restart_goes_last():
    history: History[str, Record] = History(keep_done=4)
    history.add("a", Record("a", 0.0))
    history.add("b", Record("b", 1.0))
    history.add("a", Record("a again", 2.0))
    assert [r.name for r in history.all()] == ["b", "a again"]


def test_a_replaced_record_keeps_its_place():
    history: History[str, Record] = History(keep_done=4)
    history.add("a", Record("a", 0.0))
    history.add("b", Record("b", 1.0))
    history.replace("a", Record("a", 0.0, ended=3.0))
    assert [(r.name, r.done) for r in history.all()] == [("a", True), ("b", False)]
    assert history.in_progress() == (Record("b", 1.0),) and history.done() == (Record("a", 0.0, 3.0),)


def test_only_the_last_done_records_are_kept_and_none_in_progress_is_dropped():
    history: History[int, Record] = History(keep_done=2)
    for i in range(5):
        history.add(i, Record(str(i), float(i)))
    for key, record in history.items():
        if key != 2:
            history.replace(key, replace(record, ended=9.0))
    assert [r.name for r in history.done()] == ["3", "4"]
    assert [r.name for r in history.all()] == ["2", "3", "4"]
    history.add(5, Record("5", 5.0, ended=6.0))  # added done: the oldest done one goes
    assert [r.name for r in history.all()] == ["2", "4", "5"]


def test_current_is_a_record_in_progress_only():
    history: History[str, Record] = History(keep_done=1)
    history.add("a", Record("a", 0.0))
    history.add("b", Record("b", 0.0, ended=1.0))
    assert history.current("a") == Record("a", 0.0)
    assert history.current("b") is None and history.current("c") is None


def test_replacing_or_removing_a_key_it_does_not_hold_raises_and_changes_nothing():
    history: History[str, Record] = History(keep_done=1)
    history.add("a", Record("a", 0.0))
    with pytest.raises(KeyError):
        history.replace("b", Record("b", 0.0))
    with pytest.raises(KeyError):
        history.remove("b")
    assert history.all() == (Record("a", 0.0),)
    assert history.remove("a") == Record("a", 0.0) and history.all() == ()
