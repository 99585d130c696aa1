"""A refused failover is visible to workers (docs/architecture.md, 9 Failures): the scheduler's views name
the lost server (Membership), the view carries it across the wire (codec), and a worker whose layout
routes to it gets a SlicesLostError naming what was lost and what to do (pshard.common.cluster.losses)."""

from __future__ import annotations

import dataclasses

from pshard.common.cluster.layout import plan_layout
from pshard.common.cluster.losses import lost_in, slices_lost_error
from pshard.common.cluster.view import ClusterView, ManualClock, ServerLoss
from pshard.common.errors import PSError, SlicesLostError, UnavailableError, facts_json, rebuild
from pshard.common.wire import codec
from pshard.scheduler.membership import Membership

from pshard.api.v1 import scheduler_pb2 as sched_pb
from tests.unit.test_replicas import PARAMS, SERVERS, _job


def _report(members: Membership, primary: str, backup: str) -> None:
    layout = members.layout()
    assert layout is not None
    members.heartbeat(primary, members.node(primary).generation,
                      in_sync={members.node(backup).address: members.node(backup).generation},
                      in_sync_layout=layout.version)


def _kill(members: Membership, clock: ManualClock, victim: str) -> None:
    """Every server but `victim` heartbeats; past the timeout, `victim` is declared dead."""
    clock.advance(4)
    for i in range(len(SERVERS)):
        if f"ps-{i}" != victim:
            members.heartbeat(f"ps-{i}", members.node(f"ps-{i}").generation)
    clock.advance(2)
    assert [n.node_id for n in members.expire()] == [victim]


def test_a_refused_failover_names_the_lost_server_in_every_later_view():
    members, clock = _job(1)
    _report(members, "ps-0", "ps-1")  # ps-1's backup (ps-2) never reported in sync
    layout = members.layout()
    assert layout is not None

    _kill(members, clock, "ps-1")
    view = members.view()

    assert members.layout() == layout  # nothing promoted
    assert [(loss.address, loss.layout_version) for loss in view.lost] == [("b:1", layout.version)]
    assert "no live server holds an in-sync copy" in view.lost[0].reason
    clock.advance(1)
    members.heartbeat("ps-0", members.node("ps-0").generation)
    assert members.view().lost == view.lost  # for as long as the layout routes to it


def test_a_promoted_backup_names_no_loss():
    members, clock = _job(1)
    _report(members, "ps-1", "ps-2")

    _kill(members, clock, "ps-1")

    assert members.failovers == 1 and members.view().lost == ()


def test_a_layout_that_no_longer_routes_to_the_lost_server_forgets_the_loss():
    members, clock = _job(1)
    _kill(members, clock, "ps-1")
    layout = members.layout()
    assert layout is not None and members.view().lost

    # Re-planned on the two live servers (what a restore onto fewer servers does).
    members.replace_layout(plan_layout(PARAMS, ["a:1", "c:1"], 4096, 1))

    assert members.view().lost == ()


def test_the_lost_servers_cross_the_wire_with_the_view():
    view = ClusterView(9, (), 3, (ServerLoss("b:1", 3, "no in-sync copy"), ServerLoss("c:1", 2, "x")))

    p = sched_pb.ClusterView.FromString(codec.view_to_proto(view).SerializeToString())

    assert codec.view_from_proto(p) == view


def test_only_losses_of_servers_the_layout_routes_to_count():
    layout = plan_layout(PARAMS, list(SERVERS), 4096, 1)
    gone = ServerLoss("b:1", layout.version, "r")
    elsewhere = ServerLoss("z:9", layout.version, "r")  # not a server of this layout
    drained = plan_layout(PARAMS, ["a:1", "c:1"], 4096, 1)  # b:1 serves nothing here

    assert lost_in(ClusterView(5, (), layout.version, (gone, elsewhere)), layout) == (gone,)
    assert lost_in(ClusterView(5, (), layout.version, (gone,)), drained) == ()
    assert lost_in(ClusterView(5, (), layout.version), layout) == ()


def test_the_error_names_the_server_what_it_held_and_what_to_do():
    layout = dataclasses.replace(plan_layout(PARAMS, list(SERVERS), 4096, 1), version=4)
    keys = sorted({s.key for s in layout.slices_on(1)})
    assert keys

    err = slices_lost_error([ServerLoss("b:1", 4, "no live server holds an in-sync copy")], layout)

    text = str(err)
    assert "parameter server 1 (b:1) is lost" in text and "no live server holds an in-sync copy" in text
    assert all(key in text for key in keys) and "row partition(s) [1]" in text
    assert "--checkpoint-dir" in text and "--resume" in text and "start the job again" in text
    assert err.facts == {"server": "b:1", "layout_version": 4}
    # Decisions are made on the type: it is no UnavailableError, which callers retry.
    assert isinstance(err, PSError) and not isinstance(err, UnavailableError) and err.status == "DATA_LOSS"


def test_the_error_keeps_its_type_and_facts_across_a_transport():
    layout = plan_layout(PARAMS, list(SERVERS), 4096, 1)
    err = slices_lost_error([ServerLoss("b:1", 1, "r"), ServerLoss("c:1", 2, "r")], layout)

    again = rebuild(type(err).__name__, str(err), facts_json(err))

    assert isinstance(again, SlicesLostError) and again.facts == {"server": "b:1,c:1", "layout_version": 2}
    assert "parameter server 1 (b:1)" in str(again) and "parameter server 2 (c:1)" in str(again)
