"""Replica placement and promotion (pshard.common.cluster.replicas) and the scheduler's failover on them."""

from __future__ import annotations

import dataclasses

import pytest
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.replicas import backed_up_by, backups_of, fail_over
from pshard.common.cluster.view import ManualClock
from pshard.common.errors import InvalidArgumentError, LayoutConflictError
from pshard.common.metrics import SchedulerCollector
from pshard.scheduler.membership import Membership

SERVERS = ("a:1", "b:1", "c:1")
PARAMS = [ParamSpec("w", "float32", (4096, 8)), ParamSpec("b", "float32", (8,)),
          ParamSpec("v", "float32", (64,))]


def test_backups_are_the_next_live_servers_in_ring_order():
    assert backups_of(0, 3, 1, {0, 1, 2}) == (1,)
    assert backups_of(2, 3, 1, {0, 1, 2}) == (0,)
    assert backups_of(1, 4, 2, {0, 1, 2, 3}) == (2, 3)
    assert backups_of(0, 3, 1, {0, 2}) == (2,)  # a dead server is skipped
    assert backups_of(0, 3, 0, {0, 1, 2}) == ()
    assert backups_of(0, 2, 3, {0, 1}) == (1,)  # never the primary itself, never twice
    assert backed_up_by(1, 3, 1, {0, 1, 2}) == (0,)
    assert backed_up_by(2, 3, 1, {0, 2}) == (0,)  # 1 is dead: 2 now backs 0 up
    with pytest.raises(InvalidArgumentError):
        backups_of(3, 3, 1, {0})


def test_replicas_must_leave_a_server_for_each_backup():
    assert plan_layout(PARAMS, SERVERS, replicas=2).replicas == 2
    with pytest.raises(InvalidArgumentError, match="replicas"):
        plan_layout(PARAMS, SERVERS, replicas=3)


def test_fail_over_moves_only_the_dead_servers_slices_to_its_first_live_backup():
    layout = plan_layout(PARAMS, SERVERS, slice_bytes=4096, replicas=1)
    on_1 = {s.slice_key for s in layout.slices_on(1)}
    assert on_1
    moved_layout, moved = fail_over(layout, 1, {0, 2})
    assert {s.slice_key for s in moved} == on_1
    assert not moved_layout.slices_on(1)
    on_2 = {s.slice_key for s in layout.slices_on(2)}
    assert {s.slice_key for s in moved_layout.slices_on(2)} == on_1 | on_2
    assert moved_layout.slices_on(0) == layout.slices_on(0)
    # The next server down is skipped too.
    assert {s.server for s in fail_over(layout, 1, {0})[1]} == {1}
    assert not fail_over(layout, 1, {0})[0].slices_on(1)
    assert {s.slice_key for s in fail_over(layout, 1, {0})[0].slices_on(0)} >= on_1
    with pytest.raises(InvalidArgumentError, match="no live server"):
        fail_over(layout, 1, set())


def test_without_replicas_nothing_fails_over():
    layout = plan_layout(PARAMS, SERVERS, slice_bytes=4096)
    assert fail_over(layout, 1, {0, 2}) == (layout, ())


def _job(replicas: int, row_partitions_per_server: int = 1) -> tuple[Membership, ManualClock]:
    clock = ManualClock()
    members = Membership(heartbeat_timeout_s=5, clock=clock,
                         row_partitions_per_server=row_partitions_per_server)
    for address in SERVERS:
        members.register("ps", address)
    members.propose_layout(members.plan(PARAMS, SERVERS, 4096, replicas))
    return members, clock


def _report(members: Membership, primary: str, *backups: str) -> None:
    """`primary` heartbeats, reporting `backups` (node ids) as holding all its slices."""
    layout = members.layout()
    assert layout is not None
    copies = {members.node(b).address: members.node(b).generation for b in backups}
    members.heartbeat(primary, members.node(primary).generation, in_sync=copies,
                      in_sync_layout=layout.version)


def _all_in_sync(members: Membership) -> None:
    for i in range(len(SERVERS)):
        _report(members, f"ps-{i}", f"ps-{(i + 1) % len(SERVERS)}")


def test_the_scheduler_promotes_the_backup_of_a_server_declared_dead():
    members, clock = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    assert before is not None
    clock.advance(4)
    for node in ("ps-0", "ps-2"):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == ["ps-1"]
    after = members.layout()
    assert after is not None and after.version == before.version + 1
    assert not after.slices_on(1)
    assert {s.slice_key for s in after.slices_on(2)} >= {s.slice_key for s in before.slices_on(1)}
    assert members.failovers == 1
    assert members.view().layout_version == after.version


def test_a_server_restarted_before_its_death_was_noticed_fails_over_too():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    before = members.layout()
    assert before is not None
    members.register("ps", "b:1", node_id="ps-1")  # a new process under the same id
    after = members.layout()
    assert after is not None and after.version == before.version + 1 and not after.slices_on(1)
    # It comes back holding nothing: a second restart moves nothing more.
    members.register("ps", "b:1", node_id="ps-1")
    assert members.layout() == after and members.failovers == 1


def test_without_replicas_the_layout_stays_when_a_server_dies():
    members, clock = _job(replicas=0)
    before = members.layout()
    clock.advance(6)
    members.expire()
    assert members.layout() == before and members.failovers == 0


def test_a_backup_never_reported_in_sync_is_not_promoted_and_the_loss_is_counted(caplog):
    members, clock = _job(replicas=1)
    _report(members, "ps-0", "ps-1")  # no report names ps-2 as ps-1's copy: it has not caught up
    before = members.layout()
    clock.advance(4)
    for node in ("ps-0", "ps-2"):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == ["ps-1"]
    assert members.layout() == before and members.failovers == 0
    assert members.in_sync.changes["lost"] == 1
    assert "no live server holds an in-sync copy of its" in caplog.text and "b:1" in caplog.text


def test_a_restarted_backup_counts_only_once_its_primary_reports_it_caught_up():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    stale = members.node("ps-2").generation
    members.register("ps", "c:1", node_id="ps-2")  # ps-1's backup is a new, empty process
    assert members.in_sync.of("b:1") == frozenset()
    # A report about its old incarnation (sent before the primary saw the restart) does not count.
    layout = members.layout()
    assert layout is not None
    members.heartbeat("ps-1", members.node("ps-1").generation, in_sync={"c:1": stale},
                      in_sync_layout=layout.version)
    assert members.in_sync.of("b:1") == frozenset()
    members.register("ps", "b:1", node_id="ps-1")  # ps-1 restarts: nothing holds its slices
    after = members.layout()
    assert after is not None and after.slices_on(1) == layout.slices_on(1) and members.failovers == 1
    # Once caught up, a copy counts, and promotion picks it.
    members.register("ps", "c:1", node_id="ps-2")
    _report(members, "ps-0", "ps-1")
    members.register("ps", "a:1", node_id="ps-0")
    moved = members.layout()
    assert moved is not None and not moved.slices_on(0) and members.failovers == 2


def test_copies_stop_counting_when_the_ring_moves_or_the_heir_takes_over_more():
    members, clock = _job(replicas=1)
    _all_in_sync(members)
    clock.advance(4)
    for node in ("ps-0", "ps-1"):
        members.heartbeat(node, members.node(node).generation)
    clock.advance(2)
    members.expire()  # ps-2 dies: ps-0, its backup, is its heir, and ps-1 no longer its backup
    assert members.in_sync.of("a:1") == frozenset()  # ps-1 holds none of ps-0's new slices yet
    assert members.in_sync.of("b:1") == frozenset()  # ps-1's backup was ps-2
    # A report on the layout before the failover does not count.
    layout = members.layout()
    assert layout is not None
    members.heartbeat("ps-0", members.node("ps-0").generation,
                      in_sync={"b:1": members.node("ps-1").generation}, in_sync_layout=layout.version - 1)
    assert members.in_sync.of("a:1") == frozenset()
    _report(members, "ps-0", "ps-1")
    _report(members, "ps-1", "ps-0")  # ps-2 is dead: ps-0 is ps-1's backup now
    assert members.in_sync.of("a:1") == {"b:1"} and members.in_sync.of("b:1") == {"a:1"}
    members.register("ps", "c:1", node_id="ps-2")  # back: ps-1's backup is ps-2 again, ps-0 drops its copy
    assert members.in_sync.of("b:1") == frozenset() and members.in_sync.of("a:1") == {"b:1"}
    _report(members, "ps-1", "ps-0")  # a report naming a server that is not its backup is ignored
    assert members.in_sync.of("b:1") == frozenset()
    assert members.in_sync.changes["in_sync"] == 5 and members.in_sync.changes["promoted"] == 1


def test_a_restarted_scheduler_is_given_back_the_newest_layout():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    members.register("ps", "b:1", node_id="ps-1")
    failed_over = members.layout()
    assert failed_over is not None and failed_over.version == 2
    fresh, _ = _job(replicas=1)  # the scheduler restarted: a fresh plan was proposed (version 1)
    for i in range(len(SERVERS)):  # the servers say which layout they route by
        fresh.heartbeat(f"ps-{i}", fresh.node(f"ps-{i}").generation, in_sync_layout=failed_over.version)
    kept, restored = fresh.restore_layout(failed_over)
    assert restored and kept == failed_over and fresh.layout() == failed_over
    assert fresh.view().layout_version == 2
    original = members.plan(PARAMS, SERVERS, 4096, 1)
    assert fresh.restore_layout(dataclasses.replace(original, version=1)) == (failed_over, False)
    with pytest.raises(LayoutConflictError):
        fresh.restore_layout(dataclasses.replace(plan_layout(PARAMS[:1], SERVERS, 4096, 1), version=3))
    with pytest.raises(InvalidArgumentError):
        fresh.restore_layout(dataclasses.replace(failed_over, version=4, servers=SERVERS[:1]))


def _restarted_scheduler(held: int) -> Membership:
    """A scheduler that restarted: the servers registered again and report routing by version `held`."""
    fresh = Membership(heartbeat_timeout_s=5, clock=ManualClock())
    for address in SERVERS:
        reg = fresh.register("ps", address)
        fresh.heartbeat(reg.node_id, reg.generation, in_sync_layout=held)
    return fresh


def test_a_restore_that_swaps_the_servers_is_refused_and_changes_nothing():
    """Issue 23, item 5: a forged restore (servers swapped) routed the next failover by it."""
    layout = dataclasses.replace(plan_layout(PARAMS, SERVERS, 4096, 1), version=2)
    fresh = _restarted_scheduler(held=2)
    before = fresh.view()
    swapped = dataclasses.replace(layout, servers=(SERVERS[1], SERVERS[0], *SERVERS[2:]))

    says = rf"servers\[0\] is '{SERVERS[1]}', but 'ps-0' registered at '{SERVERS[0]}' with rank 0"
    with pytest.raises(LayoutConflictError, match=says):
        fresh.restore_layout(swapped)

    assert fresh.layout() is None and fresh.view() == before
    assert fresh.restore_layout(layout) == (layout, True)


def test_a_restore_newer_than_the_servers_hold_is_refused_and_changes_nothing():
    layout = dataclasses.replace(plan_layout(PARAMS, SERVERS, 4096, 1), version=2)
    fresh = _restarted_scheduler(held=2)
    before = fresh.view()

    with pytest.raises(LayoutConflictError, match=r"version 12: newer than any live server holds \(newest "
                                                  r"reported: version 2\)"):
        fresh.restore_layout(dataclasses.replace(layout, version=12))

    assert fresh.layout() is None and fresh.view() == before


def _failed_over() -> tuple[Membership, object]:
    """A job whose ps-1 restarted: its slices failed over to ps-2 under layout version 2."""
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    members.register("ps", "b:1", node_id="ps-1")
    layout = members.layout()
    assert layout is not None and layout.version == 2
    return members, layout


def test_a_restarted_scheduler_adopts_the_newest_layout_its_servers_offer_and_plans_none_afresh():
    """The chaos failure (issue hlay): the chief restarted just before the scheduler, so no member gave the
    layout back; the new chief's proposal was planned afresh (version 1) over servers at version 2+."""
    members, failed_over = _failed_over()
    stale = dataclasses.replace(members.plan(PARAMS, SERVERS, 4096, 1), version=1)
    fresh = Membership(heartbeat_timeout_s=5, clock=ManualClock())
    # ps-0 was cut off before the failover and still routes by version 1: it registers first.
    offers = {"a:1": stale, "b:1": failed_over, "c:1": failed_over}
    for rank, address in enumerate(SERVERS):
        fresh.register("ps", address, node_id=f"ps-{rank}", rank_hint=rank, layout=offers[address])

    assert fresh.layout() == failed_over and fresh.view().layout_version == 2
    assert fresh.held_layout() is None
    # The new chief's proposal gets the servers' layout, failovers included, as a joining worker does.
    assert fresh.propose_layout(fresh.plan(PARAMS, SERVERS, 4096, 1)) == (failed_over, False)
    # A later offer of an older layout (a server back from a partition) changes nothing.
    fresh.register("ps", "a:1", node_id="ps-0", layout=stale)
    assert fresh.layout() is not None and fresh.layout().version >= 2


def test_servers_reporting_a_layout_stop_a_restarted_scheduler_from_planning_a_fresh_one():
    _, failed_over = _failed_over()
    fresh = _restarted_scheduler(held=2)  # they report version 2 and offered none (an older release)
    before = fresh.view()

    with pytest.raises(LayoutConflictError, match="routes by layout version 2, and this scheduler"):
        fresh.propose_layout(fresh.plan(PARAMS, SERVERS, 4096, 1))

    assert fresh.layout() is None and fresh.view() == before
    assert fresh.restore_layout(failed_over) == (failed_over, True)  # the chief's restore still lands
    assert fresh.propose_layout(fresh.plan(PARAMS, SERVERS, 4096, 1)) == (failed_over, False)


def test_an_offer_that_disagrees_with_the_servers_is_not_adopted_and_the_server_still_registers():
    _, failed_over = _failed_over()
    swapped = dataclasses.replace(failed_over, servers=(SERVERS[1], SERVERS[0], SERVERS[2]))
    fresh = Membership(heartbeat_timeout_s=5, clock=ManualClock())
    fresh.register("ps", "a:1", node_id="ps-0", rank_hint=0)
    reg = fresh.register("ps", "b:1", node_id="ps-1", rank_hint=1, layout=swapped)

    assert fresh.layout() is None and fresh.node(reg.node_id).address == "b:1"
    with pytest.raises(LayoutConflictError):  # it still holds a layout: nothing is planned over it
        fresh.propose_layout(fresh.plan(PARAMS, SERVERS, 4096, 1))


def test_only_a_server_offers_its_layout_when_it_registers():
    _, failed_over = _failed_over()
    fresh = Membership(heartbeat_timeout_s=5, clock=ManualClock())
    before = fresh.view()
    with pytest.raises(InvalidArgumentError, match=r"layout: offered by role 'worker' \(version 2\)"):
        fresh.register("worker", "w:1", node_id="worker-1", layout=failed_over)
    assert fresh.view() == before and fresh.layout() is None


def test_role_changes_are_exported_as_scheduler_metrics():
    members, _ = _job(replicas=1)
    _all_in_sync(members)
    members.register("ps", "b:1", node_id="ps-1")  # promoted: ps-2; out of sync: ps-1's and ps-0's copies
    collector = SchedulerCollector(members.view, role_changes=lambda: dict(members.in_sync.changes))
    [family] = [f for f in collector.collect() if f.name == "pshard_scheduler_role_changes"]
    counts = {s.labels["change"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert counts == {"in_sync": 3, "out_of_sync": 3, "promoted": 1}
