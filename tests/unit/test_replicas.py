"""Replica placement and promotion (pshard.common.replicas) and the scheduler's failover on them."""

from __future__ import annotations

import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.layout import ParamSpec, plan_layout
from pshard.common.replicas import backed_up_by, backups_of, fail_over
from pshard.common.view import ManualClock
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


def _job(replicas: int) -> tuple[Membership, ManualClock]:
    clock = ManualClock()
    members = Membership(heartbeat_timeout_s=5, clock=clock)
    for address in SERVERS:
        members.register("ps", address)
    members.propose_layout(members.plan(PARAMS, SERVERS, 4096, replicas))
    return members, clock


def test_the_scheduler_promotes_the_backup_of_a_server_declared_dead():
    members, clock = _job(replicas=1)
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
