"""Issue 23, item 5: only a role that holds the job's layout across a scheduler restart may give it back
(a server, the chief), and only a layout that agrees with what the servers hold.

worker-1's certificate once restored a layout with version +10 and the servers swapped; the scheduler
took it and logged that it had restarted. Here a real scheduler with mutual TLS on 127.0.0.1:0 plays
the restarted one: the servers have registered again at their ranks and report routing by version 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.security.ca import CertFiles, ensure
from pshard.common.security.identity import Identity
from pshard.common.wire.codec import layout_to_proto
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread

from pshard.api.v1 import scheduler_pb2 as spb
from pshard.api.v1 import scheduler_pb2_grpc as spb_grpc

from .conftest import WAIT_S

NODES = [Identity("scheduler", "scheduler-0"), Identity("ps", "ps-0"), Identity("ps", "ps-1"),
         Identity("chief", "chief-0"), Identity("worker", "worker-1")]
SERVERS = ("127.0.0.1:7100", "127.0.0.1:7101")
HELD = dataclasses.replace(
    plan_layout([ParamSpec("fc.weight", "float32", (64, 64)), ParamSpec("fc.bias", "float32", (64,))],
                SERVERS, 4096, 1), version=1)
RESTARTED = "restored from a member that holds it (this scheduler restarted)"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return {i.node_id: files for i, files in ensure(tmp_path, NODES).items()}


@pytest.fixture
def scheduler(pki: dict[str, CertFiles]) -> Iterator[SchedulerHandle]:
    """A restarted scheduler: the servers and the chief registered again, the servers report version 1."""
    handle = start_scheduler_thread(heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0,
                                    security=pki["scheduler-0"].security("scheduler", "scheduler-0"))
    for rank, address in enumerate(SERVERS):
        ps = stub(handle, pki, f"ps-{rank}")
        reg = ps.Register(spb.RegisterRequest(role=spb.ROLE_PS, address=address, node_id=f"ps-{rank}",
                                              rank_hint=rank), timeout=WAIT_S)
        ps.Heartbeat(spb.HeartbeatRequest(node_id=f"ps-{rank}", generation=reg.generation,
                                          in_sync_layout=HELD.version), timeout=WAIT_S)
    for node, role in (("chief-0", spb.ROLE_CHIEF), ("worker-1", spb.ROLE_WORKER)):
        stub(handle, pki, node).Register(spb.RegisterRequest(role=role, address=f"{node}:1", node_id=node),
                                         timeout=WAIT_S)
    yield handle
    handle.stop(grace_s=0.2)


def stub(handle: SchedulerHandle, pki: dict[str, CertFiles], node: str) -> spb_grpc.SchedulerServiceStub:
    return spb_grpc.SchedulerServiceStub(pki[node].security().channel(handle.address))


def restore(handle: SchedulerHandle, pki: dict[str, CertFiles], node: str, layout: Layout
            ) -> spb.ProposeLayoutResponse:
    return stub(handle, pki, node).ProposeLayout(spb.ProposeLayoutRequest(restore=layout_to_proto(layout)),
                                                 timeout=WAIT_S)


def refusal(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        call()  # type: ignore[operator]
    return refused.value.code(), refused.value.details() or ""  # type: ignore[attr-defined]


def stored(handle: SchedulerHandle) -> tuple[object, int]:
    members = handle.running.servicer.membership
    return handle.call(lambda: (members.layout(), members.generation))


FORGED = dataclasses.replace(HELD, version=HELD.version + 10, servers=(SERVERS[1], SERVERS[0]))


def test_a_workers_forged_restore_is_refused_and_no_restart_is_logged(
        scheduler: SchedulerHandle, pki: dict[str, CertFiles], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pshard.scheduler")
    before = stored(scheduler)

    for layout in (FORGED, HELD):  # a worker may not restore at all, even the true layout
        code, details = refusal(lambda layout=layout: restore(scheduler, pki, "worker-1", layout))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "worker-1" in details and "may not restore the layout" in details

    assert stored(scheduler) == before
    assert not any(RESTARTED in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("forged", "says"), [
    (dataclasses.replace(HELD, version=HELD.version + 10),
     "version 11: newer than any live server holds (newest reported: version 1)"),
    (dataclasses.replace(HELD, servers=(SERVERS[1], SERVERS[0])),
     f"servers[0] is '{SERVERS[1]}', but 'ps-0' registered at '{SERVERS[0]}' with rank 0"),
])
def test_the_chiefs_restore_must_agree_with_the_servers(
        scheduler: SchedulerHandle, pki: dict[str, CertFiles], caplog: pytest.LogCaptureFixture,
        forged: Layout, says: str) -> None:
    caplog.set_level(logging.INFO, logger="pshard.scheduler")
    before = stored(scheduler)

    code, details = refusal(lambda: restore(scheduler, pki, "chief-0", forged))

    assert code == grpc.StatusCode.FAILED_PRECONDITION and says in details
    assert stored(scheduler) == before
    assert not any(RESTARTED in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("node", ["chief-0", "ps-0"])
def test_a_server_or_the_chief_gives_the_true_layout_back(
        scheduler: SchedulerHandle, pki: dict[str, CertFiles], caplog: pytest.LogCaptureFixture,
        node: str) -> None:
    caplog.set_level(logging.INFO, logger="pshard.scheduler")

    assert restore(scheduler, pki, node, HELD).created

    assert stored(scheduler)[0] == HELD
    assert any(RESTARTED in r.getMessage() for r in caplog.records)


def test_a_server_may_not_propose_a_new_layout(scheduler: SchedulerHandle, pki: dict[str, CertFiles]) -> None:
    request = spb.ProposeLayoutRequest(params=[spb.ParamSpec(key="w", shape=[4])], servers=list(SERVERS))
    code, details = refusal(lambda: stub(scheduler, pki, "ps-0").ProposeLayout(request, timeout=WAIT_S))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "may not propose a layout" in details
