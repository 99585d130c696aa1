"""Issue 23, item 4: sparse-table requests are bound to the caller's credential, as dense pushes are.
With worker-1's certificate, a push (or push-pull) to a sync table as worker-0 is refused
PERMISSION_DENIED, counted, and the table is as it was; worker-1 pushing as itself is served. A real
parameter server on 127.0.0.1:0 with mutual TLS and certificates per role."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.common.security.ca import CertFiles, ensure
from pshard.common.security.identity import Identity
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import spec_to_proto
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import sparse_pb2 as spb
from pshard.api.v1 import sparse_pb2_grpc as spb_grpc

from .conftest import WAIT_S

NODES = [Identity("ps", "ps-0"), Identity("chief", "chief-0"), Identity("worker", "worker-0"),
         Identity("worker", "worker-1")]
TABLE = TableConfig(name="emb", dim=4, optimizer="sgd", lr=0.5, initializer="normal", init_scale=0.1,
                    mode="sync")
IDS = np.array([3, 17, 40], dtype=np.int64)
GRADS = np.ones((3, 4), dtype=np.float32)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return {i.node_id: files for i, files in ensure(tmp_path, NODES).items()}


@pytest.fixture
def server(pki: dict[str, CertFiles]) -> Iterator[ServerThread]:
    running = start_server_thread(ServerSettings(static_quorum={"worker-0": 0, "worker-1": 0},
                                                 pull_timeout_s=WAIT_S),
                                  security=pki["ps-0"].security("ps", "ps-0"))
    # The first table compiles numba's loops, or loads them from its cache: seconds on a loaded machine.
    stub(running, pki["chief-0"]).DeclareTable(spb.DeclareTableRequest(spec=spec_to_proto(TABLE)),
                                               timeout=12 * WAIT_S)
    yield running
    running.stop(grace_s=0.2)


def stub(server: ServerThread, files: CertFiles) -> spb_grpc.SparseTablesServiceStub:
    return spb_grpc.SparseTablesServiceStub(files.security().channel(server.address))


def table_state(server: ServerThread) -> tuple[int, int, dict[int, int] | None]:
    """(rows, steps, the sync table's applied clocks): what a counted push would change."""
    tables = server.running.tables
    assert tables is not None
    stats = server.call(lambda: tables.stats(TABLE.name))
    return stats.rows, stats.steps, server.call(lambda: tables.sync_applied(TABLE.name))


def permission_refusals(server: ServerThread) -> int:
    assert server.running.refusals is not None
    return server.running.refusals.total("PERMISSION_DENIED")


def push_as(worker: str) -> spb.PushRowsRequest:
    return spb.PushRowsRequest(table=TABLE.name, ids=IDS.tobytes(), grads=GRADS.tobytes(), clock=0,
                               worker_id=worker)


def test_a_table_push_under_another_workers_id_is_refused_and_changes_nothing(
        server: ServerThread, pki: dict[str, CertFiles]) -> None:
    before, refusals = table_state(server), permission_refusals(server)
    worker1 = stub(server, pki["worker-1"])

    for call, request in [
            (worker1.PushRows, push_as("worker-0")),
            (worker1.PushPullRows, spb.PushPullRowsRequest(table=TABLE.name, push_ids=IDS.tobytes(),
                                                           grads=GRADS.tobytes(), pull_ids=IDS.tobytes(),
                                                           clock=0, worker_id="worker-0")),
            (worker1.PullRows, spb.PullRowsRequest(table=TABLE.name, ids=IDS.tobytes(),
                                                   worker_id="worker-0"))]:
        with pytest.raises(grpc.RpcError) as refused:
            call(request, timeout=WAIT_S)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "worker-0" in (refused.value.details() or "")

    assert table_state(server) == before
    assert permission_refusals(server) == refusals + 3
    # Nothing was counted as worker-0's clock 0: worker-1's own push alone leaves the clock pending.
    assert worker1.PushRows(push_as("worker-1"), timeout=WAIT_S).stored == len(IDS)
    assert table_state(server) == before


def test_a_workers_own_table_push_still_counts(server: ServerThread, pki: dict[str, CertFiles]) -> None:
    """The binding refuses only impersonation: worker-1's push as itself is stored, and the clock
    completes once worker-0 (its own certificate) pushes too."""
    assert stub(server, pki["worker-1"]).PushRows(push_as("worker-1"), timeout=WAIT_S).stored == len(IDS)
    assert stub(server, pki["worker-0"]).PushRows(push_as("worker-0"), timeout=WAIT_S).stored == len(IDS)
    rows = stub(server, pki["worker-0"]).PullRows(
        spb.PullRowsRequest(table=TABLE.name, ids=IDS.tobytes(), clock=1, worker_id="worker-0"),
        timeout=WAIT_S)
    assert len(rows.rows) == GRADS.nbytes
    assert permission_refusals(server) == 0
