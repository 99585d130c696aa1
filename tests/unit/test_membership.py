"""Membership on an injected clock: ranks, generations, fencing, expiry, barriers, layout."""

from __future__ import annotations

import dataclasses
import re

import pytest
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.view import ManualClock, NodeState, ServerIncarnations
from pshard.common.errors import (
    BarrierTimeoutError,
    InvalidArgumentError,
    LayoutConflictError,
    QuotaExceededError,
    StaleGenerationError,
    UnknownNodeError,
)
from pshard.scheduler.membership import Membership, MembershipLimits


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


# ---- limits: refused before any state moves ----

def snapshot(members: Membership) -> tuple[object, ...]:
    """Everything a refused request must leave as it was."""
    return (members.view(), members.layout(), {n: dataclasses.replace(b, arrived=dict(b.arrived))
                                               for n, b in members._barriers.items()})


def test_last_generation_beyond_the_bound_is_refused_naming_field_and_value(members):
    members.register("worker", "w:1", node_id="worker-0")
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError,
                       match=rf"last_generation of node 'worker-0': got {2**64 - 1}, expected at most "
                             rf"{2**62 - 2**40} \(the servers' stamp limit {2**62} less {2**40}"):
        members.register("worker", "w:1", node_id="worker-0", last_generation=2**64 - 1)

    assert snapshot(members) == before


def test_a_jump_that_would_exhaust_the_servers_generations_is_refused(members):
    """Issue 23, item 3: Register(last_generation=2**62 - 2) was accepted, and the next changes
    handed out generations the servers refuse."""
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError, match=rf"got {2**62 - 2}, expected at most {2**62 - 2**40}"):
        members.register("worker", "w:1", node_id="worker-1", last_generation=2**62 - 2)

    assert snapshot(members) == before


def test_a_jump_at_the_ceiling_leaves_the_headroom_below_the_servers_limit(members):
    reg = members.register("worker", "w:1", last_generation=2**62 - 2**40)
    members.leave(reg.node_id, reg.generation)

    assert 2**62 - 2**40 < members.generation <= 2**62 - 2**40 + 2


def test_a_known_node_cannot_jump_the_generation(members):
    """Only a node a restarted scheduler forgot carries a newer generation than the scheduler's: a
    node registered here saw none, so its jump is made up (worker-1's certificate pushing the job
    towards the servers' limit)."""
    members.register("worker", "w:1", node_id="worker-1")
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError,
                       match=r"last_generation of node 'worker-1': got 5000, expected at most 1 "
                             r"\(this scheduler's generation"):
        members.register("worker", "w:1", node_id="worker-1", last_generation=5000)

    assert snapshot(members) == before
    assert members.register("worker", "w:1", node_id="worker-1", last_generation=1).generation == 2


@pytest.mark.parametrize(("field", "kwargs", "limit_name"), [
    ("role", {"role": "w" * 33}, "max_role_chars"),
    ("address", {"address": "a" * 513}, "max_address_chars"),
    ("node_id", {"node_id": "n" * 257}, "max_node_id_chars"),
])
def test_overlong_strings_are_refused_naming_the_field_and_the_limit(members, field, kwargs, limit_name):
    request = {"role": "worker", "address": "w:1", **kwargs}
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError) as info:
        members.register(**request)

    limit = getattr(members.limits, limit_name)
    assert str(info.value).startswith(f"{field}: got {limit + 1} characters")
    assert f"expected at most {limit}" in str(info.value)
    assert snapshot(members) == before


def test_limits_are_settable_and_must_be_positive(clock):
    limits = MembershipLimits(max_node_id_chars=4)
    members = Membership(10, clock, limits)

    with pytest.raises(InvalidArgumentError, match="node_id: got 5 characters"):
        members.register("worker", "w:1", node_id="abcde")
    with pytest.raises(InvalidArgumentError, match="max_members: got 0, expected > 0"):
        MembershipLimits(max_members=0)


def test_members_per_job_are_bounded_but_known_nodes_may_reregister(clock):
    members = Membership(10, clock, MembershipLimits(max_members=2))
    members.register("worker", "w0:1", node_id="worker-0")
    members.register("worker", "w1:1", node_id="worker-1")
    before = snapshot(members)

    with pytest.raises(QuotaExceededError, match=r"members: the job has 2 .* the limit is 2"):
        members.register("worker", "w2:1", node_id="worker-2")

    assert snapshot(members) == before
    assert members.register("worker", "w1:2", node_id="worker-1").rank == 1


def test_registrations_per_minute_are_a_token_bucket_on_the_clock(clock):
    members = Membership(1000, clock, MembershipLimits(registrations_per_minute=60, registration_burst=3))
    for i in range(3):
        members.register("worker", f"w{i}:1")
    before = snapshot(members)

    with pytest.raises(QuotaExceededError, match=r"registrations: more than 60 a minute .* retry in 1 s"):
        members.register("worker", "w3:1")
    assert snapshot(members) == before

    clock.advance(0.5)
    with pytest.raises(QuotaExceededError, match=r"retry in 0.5 s"):
        members.register("worker", "w3:1")
    clock.advance(0.5)
    assert members.register("worker", "w3:1").rank == 3
    clock.advance(3600)  # saving up stops at the burst
    for i in range(3):
        members.register("ps", f"p{i}:1")
    with pytest.raises(QuotaExceededError):
        members.register("ps", "p3:1")


def test_refused_registrations_spend_no_token(clock):
    members = Membership(10, clock, MembershipLimits(registration_burst=1))
    with pytest.raises(InvalidArgumentError):
        members.register("trainer", "t:1")

    assert members.register("worker", "w:1").rank == 0


def test_a_refused_role_change_does_not_move_the_generation(members):
    members.register("worker", "w:1", node_id="n1")
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError, match="a node id keeps its role"):
        members.register("ps", "w:1", node_id="n1", last_generation=1000)

    assert snapshot(members) == before


def test_heartbeat_clock_and_generations_from_the_wire_are_bounded(members):
    reg = members.register("worker", "w:1")
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError, match=rf"heartbeat clock: got {2**64 - 1}, expected at most"):
        members.heartbeat(reg.node_id, reg.generation, clock=2**64 - 1)
    with pytest.raises(InvalidArgumentError,
                       match=rf"heartbeat generation: got {2**64 - 1}, expected at most {reg.generation}"):
        members.heartbeat(reg.node_id, 2**64 - 1)
    with pytest.raises(InvalidArgumentError, match=rf"leave generation: got {2**63}"):
        members.leave(reg.node_id, 2**63)
    with pytest.raises(InvalidArgumentError, match="node_id: got 257 characters"):
        members.heartbeat("n" * 257, reg.generation)

    assert snapshot(members) == before
    assert members.heartbeat(reg.node_id, reg.generation, clock=2**62).node(reg.node_id).clock == 2**62


def test_barrier_count_name_and_number_of_barriers_are_bounded(clock):
    members = Membership(10, clock, MembershipLimits(max_members=4, max_barriers=1))
    members.register("worker", "w:1", node_id="worker-0")
    members.arrive("start", 2, "worker-0")
    before = snapshot(members)

    with pytest.raises(InvalidArgumentError, match=r"barrier 'x' count: got 5, expected at most 4"):
        members.arrive("x", 5, "worker-0")
    with pytest.raises(InvalidArgumentError, match="barrier name: got 257 characters"):
        members.arrive("b" * 257, 1, "worker-0")
    with pytest.raises(QuotaExceededError, match="barriers: 1 names in use, the limit is 1"):
        members.arrive("second", 1, "worker-0")

    assert snapshot(members) == before


@pytest.mark.parametrize(("params", "servers", "slice_bytes", "message"), [
    ([ParamSpec("k" * 1025, "float32", (1,))], ["p:1"], 1024, "param key: got 1025 characters"),
    ([ParamSpec("w", "float32", (1,) * 33)], ["p:1"], 1024, "param 'w' dims: got 33, expected at most 32"),
    ([ParamSpec("w", "float32", (2**62, 4))], ["p:1"], 2**64 - 1, f"param 'w' elements: got {2**64}"),
    ([ParamSpec("w", "float32", (2**40,))], ["p:1"], 64, "layout slices (slice_bytes 64): got 68719476736"),
    ([ParamSpec("w", "float32", (2**16,))], [f"p:{i}" for i in range(256)], 64,
     "layout slices x servers (4096 x 256): got 1048576"),
    ([ParamSpec("w", "float32", (1,))], [f"p:{i}" for i in range(257)], 64, "layout servers: got 257"),
    ([ParamSpec("w", "float32", (1,))], ["p" * 513], 64, "layout server 0: got 513 characters"),
])
def test_layouts_beyond_the_limits_are_refused_before_planning(clock, params, servers, slice_bytes, message):
    members = Membership(10, clock, MembershipLimits(max_layout_work=2**19))

    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        members.plan(params, servers, slice_bytes)

    assert members.layout() is None and members.generation == 0


def test_layout_params_are_counted_before_they_are_decoded(members):
    with pytest.raises(InvalidArgumentError, match="layout params: got 65537, expected at most 65536"):
        members.check_layout_request(65537, ["p:1"])


def test_a_layout_within_the_limits_is_planned_as_before(members):
    planned = members.plan(PARAMS, ["p0:1", "p1:1"], 64)

    assert planned == plan_layout(PARAMS, ["p0:1", "p1:1"], 64)


def test_server_incarnations_name_a_server_restarted_at_its_address_once(members, clock):
    # What the replicators key their "copy everything to it again" on: a changed generation at one
    # address, seen once; a first sighting, the server itself and workers are not restarts.
    incarnations = ServerIncarnations("ps0:1")
    for node_id, address in (("ps-0", "ps0:1"), ("ps-1", "ps1:1"), ("worker-0", "")):
        members.register(node_id.split("-")[0], address, node_id)
    assert incarnations.restarted(members.view()) == []
    clock.advance(11)  # ps-1 misses its heartbeats and comes back as a new process
    members.register("ps", "ps1:1", "ps-1")
    view = members.view()
    assert incarnations.restarted(view) == ["ps1:1"]
    assert incarnations.restarted(view) == []
    assert incarnations.generations["ps1:1"] == view.node("ps-1").generation
    assert "ps0:1" not in incarnations.generations


def test_a_scheduler_at_the_servers_generation_limit_refuses_registrations(clock):
    members = Membership(10, clock, MembershipLimits(max_generation=3, generation_headroom=1))
    for i in range(3):
        members.register("worker", f"w{i}:1")
    before = snapshot(members)

    with pytest.raises(StaleGenerationError, match=r"this scheduler is at 3, the servers' stamp limit 3"):
        members.register("worker", "w3:1")

    assert snapshot(members) == before


def _silent_server_with_a_worker(members, clock, replicas: int):
    ps = members.register("ps", "p0:1", node_id="ps-0")
    backup = members.register("ps", "p1:1", node_id="ps-1")
    worker = members.register("worker", "w:1", node_id="worker-0")
    members.propose_layout(plan_layout([ParamSpec("w", "float32", (64,))], ["p0:1", "p1:1"], 64, replicas))
    if replicas:  # ps-1 holds a copy of every slice of ps-0's: a failover is possible
        members.heartbeat("ps-0", ps.generation, in_sync={"p1:1": backup.generation},
                          in_sync_layout=members.layout().version)
    return ps, backup, worker


def test_a_server_only_the_scheduler_cannot_hear_is_kept_live_while_workers_reach_it(members, clock):
    """Issue 24: cut off from the scheduler alone, a server of a job without replicas is serving and has no
    copy to fail over to; declaring it dead only killed the job. Kept while a worker vouches for it."""
    _, backup, worker = _silent_server_with_a_worker(members, clock, replicas=0)
    generation = members.generation
    for _ in range(4):  # 24 s of silence from ps-0; the worker reaches it all along
        clock.advance(6)
        members.heartbeat("worker-0", worker.generation, reached=["p0:1", "not-a-server:9"])
        members.heartbeat("ps-1", backup.generation)
        assert members.expire() == []
    assert members.node("ps-0").state is NodeState.LIVE and members.generation == generation
    assert members.vouches == 1  # said once, not at every check
    # The worker no longer reaches it either: declared dead at the next check past the timeout.
    clock.advance(6)
    members.heartbeat("worker-0", worker.generation)
    members.heartbeat("ps-1", backup.generation)
    assert members.expire() == []  # the last word from the worker is 6 s old, within the 10 s timeout
    clock.advance(6)
    members.heartbeat("worker-0", worker.generation)
    members.heartbeat("ps-1", backup.generation)
    assert [n.node_id for n in members.expire()] == ["ps-0"]


def test_with_replicas_a_server_silent_to_the_scheduler_is_failed_over_whatever_workers_say(members, clock):
    _, backup, worker = _silent_server_with_a_worker(members, clock, replicas=1)
    version = members.layout().version
    clock.advance(11)
    members.heartbeat("worker-0", worker.generation, reached=["p0:1"])
    members.heartbeat("ps-1", backup.generation)
    assert [n.node_id for n in members.expire()] == ["ps-0"]
    assert members.layout().version == version + 1 and members.failovers == 1 and members.vouches == 0


def test_a_heartbeat_naming_too_many_reached_servers_is_refused_and_changes_nothing(members, clock):
    worker = members.register("worker", "w:1", node_id="worker-0")
    limit = members.limits.max_layout_servers
    clock.advance(1)
    refused = f"reached servers: got {limit + 1}, expected at most {limit}"
    with pytest.raises(InvalidArgumentError, match=refused):
        members.heartbeat("worker-0", worker.generation, reached=["p:1"] * (limit + 1))
    assert members.silent_for("worker-0") == 1


def test_a_scheduler_that_hears_from_no_node_declares_none_dead_and_gives_each_a_timeout_once_one_is_back(
        members, clock):
    """Issue 24: the scheduler's host cut off. Every node silent at once means the scheduler is the one
    cut off: declaring them all dead (a failover with no live heir) killed the job when the link came back."""
    ps = [members.register("ps", f"p{i}:1", node_id=f"ps-{i}") for i in range(2)]
    worker = members.register("worker", "w:1", node_id="worker-0")
    generation = members.generation
    clock.advance(30)
    assert members.expire() == [] and members.generation == generation and members.isolations == 1
    assert members.expire() == [] and members.isolations == 1  # said once
    members.heartbeat("ps-0", ps[0].generation)  # the link is back: ps-0 first
    clock.advance(1)
    assert members.expire() == []  # the others were silent for 31 s, but they get a whole timeout from now
    members.heartbeat("worker-0", worker.generation)
    clock.advance(11)
    members.heartbeat("ps-0", ps[0].generation)
    members.heartbeat("worker-0", worker.generation)
    assert [n.node_id for n in members.expire()] == ["ps-1"]  # one that really stayed silent
