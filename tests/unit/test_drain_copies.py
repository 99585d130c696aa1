"""Drains without replicas (issue 20): the scheduler's rule (scheduler/drain_copies.py). Everything the
drained server serves is copied to the servers `plan_drain` spreads it over and switches under ONE new
layout version once every target caught up; a crash before the switch rolls the whole drain back to the
layout in force, one after it completes: at every layout version each slice and row partition has exactly
one owner.
"""

from __future__ import annotations

import dataclasses

import pytest
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.moves import plan_drain
from pshard.common.errors import InvalidArgumentError
from pshard.ps_server.replication.in_sync import copies_caught_up
from pshard.scheduler.drain_copies import DrainCopies

SERVERS = ("a:1", "b:1", "c:1")
PARAMS = [ParamSpec("w", "float32", (512, 8)), ParamSpec("b", "float32", (8,)),
          ParamSpec("v", "float32", (300,))]
GENERATIONS = {"a:1": 1, "b:1": 2, "c:1": 3}


def _layout() -> Layout:
    return dataclasses.replace(plan_layout(PARAMS, SERVERS, slice_bytes=1024, row_partitions=6), version=4)


def _live(address: str, generation: int) -> bool:
    return GENERATIONS.get(address) == generation


def _owners(layout: Layout) -> dict[object, int]:
    """Each slice's and row partition's one owner (a slice named twice would be two)."""
    owners: dict[object, int] = {}
    for s in layout.slices:
        assert s.slice_key not in owners
        owners[s.slice_key] = s.server
    owners.update(enumerate(layout.owners()))
    return owners


def _started(drains: DrainCopies, layout: Layout) -> tuple[str, list[str]]:
    plan = plan_drain(layout, 1, [100] * layout.partition_count)
    source = layout.servers[1]
    assert drains.start((source, GENERATIONS[source]), plan, _live, GENERATIONS, now=0.0)
    drain = drains.get(source)
    assert drain is not None
    return source, sorted(drain.targets)


def test_a_drain_switches_once_every_target_caught_up_under_one_layout_version():
    layout, drains = _layout(), DrainCopies()
    source, targets = _started(drains, layout)
    assert targets == ["a:1", "c:1"]  # spread over both others, as plan_drain spreads it
    copies = drains.copies_from(source)
    moved = [k for slices, _ in copies.values() for k in slices]
    assert sorted(moved) == sorted(s.slice_key for s in layout.slices_on(1))  # each slice to one target
    assert sorted(p for _, parts in copies.values() for p in parts) == list(layout.partitions_on(1))
    # One target caught up: nothing switches, and the switch is refused with nothing changed.
    assert drains.reported(source, {"a:1": 1}, _live) is None
    with pytest.raises(InvalidArgumentError, match=r"targets \['c:1'\] have not caught up"):
        drains.switch(source, layout, 5)
    ready = drains.reported(source, {"c:1": 3}, _live)
    assert ready is not None
    after = drains.switch(source, layout, 5)
    assert after.version == 5
    before_owners, after_owners = _owners(layout), _owners(after)
    assert before_owners.keys() == after_owners.keys()  # every item has one owner before and after
    assert not after.slices_on(1) and not after.partitions_on(1)  # the drained server serves nothing
    assert {k: o for k, o in before_owners.items() if o != 1} == {
        k: o for k, o in after_owners.items() if before_owners[k] != 1}  # nothing else moved
    assert drains.took("a:1", 5) == []  # done once every target routes by the switched layout
    [done] = drains.took("c:1", 5)
    assert done.switched_at == 5 and drains.copies_from(source) == {}


def test_a_target_reported_as_another_incarnation_does_not_count():
    layout, drains = _layout(), DrainCopies()
    source, _ = _started(drains, layout)
    assert drains.reported(source, {"a:1": 1, "c:1": 99}, _live) is None  # c:1's old process held it


@pytest.mark.parametrize("crashed", ["b:1", "a:1", "c:1"])
def test_a_crash_before_the_switch_rolls_the_whole_drain_back(crashed):
    layout, drains = _layout(), DrainCopies()
    source, _ = _started(drains, layout)
    drains.reported(source, {"a:1": 1}, _live)
    [rolled] = drains.gone(crashed)
    assert rolled.source == source and not rolled.switched_at
    assert drains.get(source) is None and drains.copies_from(source) == {}  # the views name no copy
    with pytest.raises(InvalidArgumentError, match="no drain of it is in progress"):
        drains.switch(source, layout, 5)  # the layout in force stays: the source still owns it all


def test_a_crash_after_the_switch_completes():
    layout, drains = _layout(), DrainCopies()
    source, _ = _started(drains, layout)
    drains.reported(source, {"a:1": 1, "c:1": 3}, _live)
    drains.switch(source, layout, 5)
    assert drains.gone("a:1") == []  # a target gone after the switch: the switched layout stands
    assert drains.get(source) is not None and drains.get(source).switched_at == 5
    assert drains.gone(source) == []  # the source leaving is the drain's end
    assert drains.get(source) is None


def test_a_scheduler_restarted_mid_drain_names_no_copy():
    # Soft state: a new scheduler's DrainCopies is empty, so the views name no copy and the sources drop
    # theirs; the layout it gets back from the workers is the one in force, never a half-switched one.
    layout, drains = _layout(), DrainCopies()
    _started(drains, layout)
    restarted = DrainCopies()
    assert restarted.all() == () and restarted.copies_from("b:1") == {}


def test_a_layout_changed_under_a_copying_drain_rolls_it_back():
    layout, drains = _layout(), DrainCopies()
    source, _ = _started(drains, layout)
    assert drains.stale(4) == []
    [rolled] = drains.stale(5)  # a failover or a rebalance installed version 5 meanwhile
    assert rolled.source == source and drains.get(source) is None


def test_a_retried_drain_changes_nothing_and_clashing_drains_are_refused():
    layout, drains = _layout(), DrainCopies()
    source, _ = _started(drains, layout)
    plan = plan_drain(layout, 1, [100] * layout.partition_count)
    assert not drains.start((source, GENERATIONS[source]), plan, _live, GENERATIONS, now=1.0)
    other = plan_drain(layout, 0, [100] * layout.partition_count)  # a:1 takes some of b:1's items
    with pytest.raises(InvalidArgumentError, match=r"'a:1' is in the drain of 'b:1' \(copying\)"):
        drains.start(("a:1", 1), other, _live, GENERATIONS, now=1.0)
    assert drains.get("a:1") is None


def test_a_drain_onto_a_server_that_is_not_live_is_refused():
    layout, drains = _layout(), DrainCopies()
    plan = plan_drain(layout, 1, [100] * layout.partition_count)
    with pytest.raises(InvalidArgumentError, match=r"targets \['c:1'\] are not live"):
        drains.start(("b:1", 2), plan, _live, {"a:1": 1, "c:1": 7}, now=0.0)
    assert drains.all() == ()


def test_a_source_reports_a_target_caught_up_only_once_it_holds_its_rows_and_its_slices():
    generations = {"a:1": 3, "c:1": 5}
    # a:1 takes rows and slices, c:1 slices only; the rows' report carries its own generations.
    assert copies_caught_up({"a:1"}, {}, {"a:1", "c:1"}, {"a:1", "c:1"}, generations) == {"c:1": 5}
    assert copies_caught_up({"a:1"}, {"a:1": 3}, {"a:1", "c:1"}, {"c:1"}, generations) == {"c:1": 5}
    assert copies_caught_up({"a:1"}, {"a:1": 3}, {"a:1", "c:1"}, {"a:1", "c:1"}, generations) == {
        "a:1": 3, "c:1": 5}
    assert copies_caught_up({"b:1"}, {"b:1": 2}, set(), set(), generations) == {"b:1": 2}  # a rebalance's
    assert copies_caught_up(set(), {}, {"d:1"}, {"d:1"}, generations) == {}  # not in the view: no incarnation
