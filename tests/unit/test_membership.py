"""Membership on an injected clock: ranks, generations, fencing, expiry, barriers, layout."""

from __future__ import annotations

import dataclasses

import pytest
from pshard.common.errors import (
    BarrierTimeoutError,
    InvalidArgumentError,
    LayoutConflictError,
    StaleGenerationError,
    UnknownNodeError,
)
from pshard.common.layout import ParamSpec, plan_layout
from pshard.common.view import ManualClock, NodeState
from pshard.scheduler.membership import Membership


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def members(clock: ManualClock) -> Membership:
    return Membership(heartbeat_timeout_s=10, clock=clock)


def test_ranks_are_unique_per_rank_space_and_chief_comes_first(members):
    w0 = members.register("worker", "w0:1", rank_hint=1)
    chief = members.register("chief", "c:1")
    ps0 = members.register("ps", "p0:1")
    w1 = members.register("worker", "w1:1")

    assert (chief.rank, w0.rank, w1.rank) == (0, 1, 2)
    assert ps0.rank == 0
    assert [n.node_id for n in members.view().nodes] == ["ps-0", "chief-0", "worker-1", "worker-2"]
    assert list(members.live_workers()) == ["chief-0", "worker-1", "worker-2"]


def test_rank_hint_is_ignored_when_taken(members):
    members.register("worker", "a:1", node_id="worker-0", rank_hint=0)

    second = members.register("worker", "b:1", node_id="worker-1", rank_hint=0)

    assert second.rank == 1


def test_expires_after_missed_heartbeats(members, clock):
    w = members.register("worker", "127.0.0.1:7200")
    ps = members.register("ps", "127.0.0.1:7100")
    clock.advance(6)
    members.heartbeat(ps.node_id, ps.generation)
    clock.advance(5)

    dead = members.expire()

    assert [(n.node_id, n.state) for n in dead] == [(w.node_id, NodeState.DEAD)]
    assert members.view().live_workers() == {}
    assert members.expire() == []


def test_no_expiry_at_exactly_the_timeout(members, clock):
    members.register("worker", "w:1")
    clock.advance(10)

    assert members.expire() == []


def test_generation_grows_on_every_change(members, clock):
    seen = [members.view().generation]
    a = members.register("worker", "a:1")
    seen.append(members.view().generation)
    b = members.register("worker", "b:1")
    seen.append(members.view().generation)
    members.heartbeat(a.node_id, a.generation)
    assert members.view().generation == seen[-1]  # a heartbeat is not a change
    members.leave(b.node_id, b.generation)
    seen.append(members.view().generation)
    clock.advance(11)
    members.expire()
    seen.append(members.view().generation)
    members.propose_layout(plan_layout([ParamSpec("w", "float32", (4,))], ["p:1"]))
    seen.append(members.view().generation)

    assert seen == sorted(set(seen)) and len(seen) == 6


def test_incarnation_carries_the_generation_of_its_view(members):
    reg = members.register("ps", "p:1")

    assert reg.generation == reg.view.generation == reg.view.node(reg.node_id).generation


def test_reregistering_keeps_the_rank_and_fences_the_old_incarnation(members):
    members.register("worker", "w0:1", node_id="worker-0")
    old = members.register("worker", "w1:1", node_id="worker-1", rank_hint=1)

    new = members.register("worker", "w1:2", node_id="worker-1", rank_hint=5)

    assert new.rank == old.rank == 1
    assert new.generation > old.generation
    assert members.live_workers()["worker-1"] == new.generation
    with pytest.raises(StaleGenerationError) as info:
        members.heartbeat("worker-1", old.generation)
    assert f"generation {old.generation}" in str(info.value)
    assert f"generation {new.generation}" in str(info.value)


def test_dead_node_must_reregister_and_gets_its_rank_back(members, clock):
    members.register("worker", "w0:1", node_id="worker-0")
    reg = members.register("worker", "w1:1", node_id="worker-1")
    clock.advance(11)
    members.heartbeat("worker-0", 1)
    members.expire()

    with pytest.raises(UnknownNodeError, match="declared dead"):
        members.heartbeat("worker-1", reg.generation)
    members.register("worker", "w2:1", node_id="worker-2")  # takes the lowest free rank, not 1
    again = members.register("worker", "w1:1", node_id="worker-1")

    assert again.rank == reg.rank == 1
    assert members.view().node("worker-1").state is NodeState.LIVE


def test_heartbeat_from_unknown_node_says_register_again(members):
    with pytest.raises(UnknownNodeError, match=r"'worker-3': not registered .* register again"):
        members.heartbeat("worker-3", 1)


def test_restart_with_last_generation_keeps_generations_monotonic(clock):
    before = Membership(10, clock)
    for i in range(5):
        last = before.register("worker", f"w{i}:1", node_id=f"worker-{i}", rank_hint=i)

    # The scheduler restarts: a fresh, empty table.
    after = Membership(10, clock)
    again = after.register("worker", "w3:1", node_id="worker-3", rank_hint=3, last_generation=last.generation)

    assert again.generation > last.generation
    assert again.rank == 3
    assert after.view().generation == again.generation


def test_leave_marks_left_and_is_idempotent(members):
    reg = members.register("worker", "w:1")

    first = members.leave(reg.node_id, reg.generation)
    second = members.leave(reg.node_id, reg.generation)

    assert first.node(reg.node_id).state is NodeState.LEFT
    assert second.generation == first.generation
    with pytest.raises(UnknownNodeError, match="left"):
        members.heartbeat(reg.node_id, reg.generation)


def test_unknown_role_is_refused(members):
    with pytest.raises(InvalidArgumentError, match="role: got 'trainer'"):
        members.register("trainer", "t:1")


def test_node_id_keeps_its_role(members):
    members.register("worker", "w:1", node_id="n1")

    with pytest.raises(InvalidArgumentError, match="registered as 'worker', now as 'ps'"):
        members.register("ps", "w:1", node_id="n1")


def test_view_is_frozen(members):
    view = members.register("worker", "w:1").view

    with pytest.raises(dataclasses.FrozenInstanceError):
        view.generation = 0  # type: ignore[misc]


# ---- barriers ----

def test_barrier_releases_on_the_last_arrival_and_starts_a_new_round(members):
    for i in range(2):
        members.register("worker", f"w{i}:1", node_id=f"worker-{i}")

    a = members.arrive("start", 2, "worker-0")
    assert not a.released and not members.barrier_released("start", a.round)
    assert members.arrive("start", 2, "worker-0") == a  # a retried arrival counts once
    b = members.arrive("start", 2, "worker-1")

    assert b.released and b.round == a.round
    assert members.barrier_released("start", a.round)
    next_round = members.arrive("start", 2, "worker-1")
    assert next_round.round == a.round + 1 and not next_round.released


def test_barrier_timeout_names_who_is_missing_and_withdraws(members, clock):
    for i in range(3):
        members.register("worker", f"w{i}:1", node_id=f"worker-{i}")
    members.register("ps", "p:1")
    clock.advance(11)
    members.heartbeat("worker-0", 1)
    members.heartbeat("worker-1", 2)
    members.expire()
    arrival = members.arrive("ckpt", 3, "worker-0")

    err = members.barrier_timeout("ckpt", arrival.round, "worker-0", waited_s=2.0)

    assert isinstance(err, BarrierTimeoutError)
    assert str(err) == ("barrier 'ckpt' round 1: 1 of 3 arrived within 2 s (worker-0); "
                        "not arrived: worker-1 (live), worker-2 (dead)")
    members.arrive("ckpt", 3, "worker-1")
    assert not members.arrive("ckpt", 3, "worker-2").released  # worker-0 no longer counts


def test_barrier_count_must_agree_within_a_round(members):
    members.register("worker", "w0:1", node_id="worker-0")
    members.register("worker", "w1:1", node_id="worker-1")
    members.arrive("start", 2, "worker-0")

    with pytest.raises(InvalidArgumentError, match="expects count 3, but 'worker-0' opened it with count 2"):
        members.arrive("start", 3, "worker-1")


def test_barrier_needs_a_registered_node(members):
    with pytest.raises(UnknownNodeError):
        members.arrive("start", 1, "worker-9")


# ---- layout ----

PARAMS = [ParamSpec("fc1.weight", "float32", (10, 4)), ParamSpec("fc1.bias", "float32", (10,))]


def test_first_layout_wins_and_gets_version_one(members):
    first, created = members.propose_layout(plan_layout(PARAMS, ["p0:1"]))
    again, created_again = members.propose_layout(plan_layout(list(reversed(PARAMS)), ["p0:1", "p1:1"]))

    assert (first.version, created) == (1, True)
    assert again is first and not created_again
    assert members.layout() is first
    assert members.view().layout_version == 1


def test_conflicting_layout_names_the_key_and_both_values(members):
    members.propose_layout(plan_layout(PARAMS, ["p0:1"]))
    other = [ParamSpec("fc1.weight", "float32", (10, 5)), PARAMS[1]]

    with pytest.raises(LayoutConflictError) as info:
        members.propose_layout(plan_layout(other, ["p0:1"]))

    message = str(info.value)
    assert "'fc1.weight'" in message and "(10, 4)" in message and "(10, 5)" in message


def test_replaced_layout_gets_the_next_version(members):
    members.propose_layout(plan_layout(PARAMS, ["p0:1"]))

    replaced = members.replace_layout(plan_layout(PARAMS, ["p0:1", "p1:1"]))

    assert replaced.version == 2 and members.view().layout_version == 2
