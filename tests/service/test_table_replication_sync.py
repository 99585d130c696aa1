"""Sync sparse tables lose nothing on a failover with replicas (issue 10, docs/architecture.md 9).

A sync push is held pending by its server until every worker pushed that clock, and is not
replicated meanwhile. Three servers, replicas 1, two workers: worker w0 pushes clock 2, then the
server of row partition 1 stops before w1 pushed; the failover layout names its backup the heir.
w1's push reaches the heir, w0's pending part is gone with the dead server: w0 must send it again
(its table client kept it) and the heir must apply clock 2 in partition 1 exactly once, from the
applied clock that came with the replica's rows, although it holds both workers' pushes of clock 2
for its own partition already. Integer gradients, SGD at lr 1 and zero rows make the expected rows
exact: minus the sum over clocks of the mean of the two workers' gradients.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common import errors
from pshard.common.cluster.layout import Layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.rpc.serving import ServerThread
from pshard.common.rpc.status import error_from_rpc_error
from pshard.common.sparse import TableConfig, server_of
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc
from tests.e2e.harness import wait_until
from tests.service.test_table_replication import _layout, _replicated, _rows

from .conftest import WAIT_S

DIM = 4
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros", mode="sync")
IDS = np.arange(0, 600, 5, dtype=np.int64)
CLOCKS = 6
PENDING = 2  # the clock w0 pushed, and w1 not yet, when server 1 stops


def _batch(worker: int, clock: int) -> tuple[np.ndarray, np.ndarray]:
    """Half the ids, some twice (the client sums them), integer gradients."""
    rng = np.random.default_rng([worker, clock])
    ids = rng.choice(IDS, size=len(IDS) // 2)
    return ids, rng.integers(-4, 5, size=(len(ids), DIM)).astype(np.float32)


def _expected(clocks: int) -> np.ndarray:
    total = np.zeros((len(IDS), DIM), np.float64)
    for clock in range(clocks):
        for worker in (0, 1):
            ids, grads = _batch(worker, clock)
            np.add.at(total, np.searchsorted(IDS, ids), grads / 2)  # the mean over the two workers
    return (-total).astype(np.float32)


def _cluster(start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient], transport: str,
             relayout: Callable[[Layout, float], Layout | None], moved: list[Layout],
             ) -> tuple[list[ServerThread], Layout, list[PSClient]]:
    """Three replicated servers, the failover layout moving server 1's partition to server 2 (in
    `moved`), and workers w0 and w1 that find it through `relayout`."""
    settings = ServerSettings(replicas=1, static_quorum={"w0": 0, "w1": 0}, pull_timeout_s=WAIT_S)
    servers, layout = _replicated(start_server, _layout, settings=settings)
    moved.append(dataclasses.replace(fail_over(layout, 1, {0, 2})[0], version=layout.version + 1))
    clients = [new_client(servers, f"w{w}", layout=layout, relayout=relayout, reroute_wait_s=WAIT_S,
                          retry_budget_s=0.5, transport=transport) for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    return servers, layout, clients


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_sync_clock_pending_on_a_server_that_stops_is_applied_once_by_its_heir(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient],
        transport: str) -> None:
    published = threading.Event()
    layouts: list[Layout] = []

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return layouts[0] if published.wait(timeout_s) and layouts[0].version > current.version else None

    servers, _, clients = _cluster(start_server, new_client, transport, relayout, layouts)
    addresses, moved = [s.address for s in servers], layouts[0]
    assert set(server_of(IDS, 3).tolist()) == {0, 1, 2}

    def step(w: int, clock: int, push: bool = True) -> None:
        if push:
            clients[w].push_rows(TABLE.name, *_batch(w, clock), clock=clock)
        clients[w].pull_rows(TABLE.name, IDS, clock=clock + 1)  # as PSEmbedding: after the push

    with ThreadPoolExecutor(2) as pool:
        for clock in range(PENDING):
            for f in [pool.submit(step, w, clock) for w in (0, 1)]:
                f.result(timeout=WAIT_S)
        clients[0].push_rows(TABLE.name, *_batch(0, PENDING), clock=PENDING)  # acknowledged, pending
        servers[1].stop(grace_s=0)
        for i in (0, 2):  # the view without server 1, and the layout naming server 2 the heir
            servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([addresses[2 - i]]),
                                         _rows(servers[i]).on_layout(moved)))
        published.set()
        # w1 pushes clock 2 (its part for server 1 re-routed to the heir); w0 finds the failover on its
        # pull, and must send its pending push again first, or both pulls wait for it in vain.
        futures = [pool.submit(step, 0, PENDING, False), pool.submit(step, 1, PENDING)]
        for f in futures:
            f.result(timeout=3 * WAIT_S)
        for clock in range(PENDING + 1, CLOCKS):
            for f in [pool.submit(step, w, clock) for w in (0, 1)]:
                f.result(timeout=WAIT_S)

    final = clients[0].pull_rows(TABLE.name, IDS, clock=CLOCKS)
    np.testing.assert_array_equal(final, _expected(CLOCKS))
    assert clients[0].tables.resent >= 1 and clients[0].layout is moved
    heir = servers[2].running.tables.find(TABLE.name)
    pushed = np.unique(np.concatenate([_batch(w, c)[0] for w in (0, 1) for c in range(CLOCKS)]))
    assert heir is not None and len(heir) == len(pushed[server_of(pushed, 3) != 0])  # pulls create no rows


@pytest.fixture(params=["as_written", "reworded"])
def wording(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The re-route errors as the server words them, or with every message replaced: clients decide on
    the error's type (and its facts), never on its text, so a reworded message changes nothing."""
    if request.param == "reworded":
        for cls in (errors.PartitionMovedError, errors.LayoutNotYetError):
            init = cls.__init__

            def reworded(self: errors.PSError, message: str = "", *, _init: Callable[..., None] = init,
                         **facts: object) -> None:
                _init(self, "a message reworded beyond recognition", **facts)

            monkeypatch.setattr(cls, "__init__", reworded)
    return str(request.param)


def test_a_sync_push_waits_for_a_server_to_know_its_layout_and_an_older_routing_is_refused(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient], wording: str) -> None:
    layouts: list[Layout] = []

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return layouts[0] if layouts[0].version > current.version else None

    servers, layout, clients = _cluster(start_server, new_client, "grpc", relayout, layouts)
    addresses, moved = [s.address for s in servers], layouts[0]
    with ThreadPoolExecutor(2) as pool:
        for clock in range(PENDING):
            for f in [pool.submit(lambda w, clock: (clients[w].push_rows(TABLE.name, *_batch(w, clock),
                                                                         clock=clock),
                                                    clients[w].pull_rows(TABLE.name, IDS, clock=clock + 1)),
                                  w, clock) for w in (0, 1)]:
                f.result(timeout=WAIT_S)
        servers[1].stop(grace_s=0)
        for i in (0, 2):  # the view without server 1: the survivors back each other up
            servers[i].call(lambda i=i: _rows(servers[i]).set_backups([addresses[2 - i]]))
        # The workers learn the failover before the heir does: their pushes, which count an empty part
        # as a push for each partition the heir serves, must wait until it serves what they believe.
        pushes = [pool.submit(clients[w].push_rows, TABLE.name, *_batch(w, PENDING), clock=PENDING)
                  for w in (0, 1)]
        wait_until(lambda: all(c.tables.not_yet > 0 for c in clients), WAIT_S,
                   "both workers' pushes to be refused by the heir that knows no failover yet")
        assert not any(f.done() for f in pushes)
        for i in (0, 2):
            servers[i].call(lambda i=i: _rows(servers[i]).on_layout(moved))
        for f in pushes:
            f.result(timeout=WAIT_S)
    rows = clients[0].pull_rows(TABLE.name, IDS, clock=PENDING + 1)
    np.testing.assert_array_equal(rows, _expected(PENDING + 1))
    # A push routed with the old layout: taken by server 0, whose partitions did not change; refused
    # by the heir, which the old layout did not give partition 1 (its empty part would count there),
    # with a typed error that says so in facts: the partitions' layout version.
    empty = pb.PushRowsRequest(table=TABLE.name, clock=PENDING + 1, worker_id="w0",
                               layout_version=layout.version)
    pb_grpc.SparseTablesServiceStub(clients[0]._channels[0]).PushRows(empty, timeout=WAIT_S)
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.SparseTablesServiceStub(clients[0]._channels[2]).PushRows(empty, timeout=WAIT_S)
    err = error_from_rpc_error(refused.value)
    assert isinstance(err, errors.PartitionMovedError), err
    assert err.facts == {"table": TABLE.name, "partition": -1, "layout_version": moved.version}
    assert ("re-route" in str(err)) == (wording == "as_written")
    # A worker routing by the right servers but an older layout version is refused the same way by the
    # heir, and re-routes on the type alone (every other server it routes to is alive and serving).
    stale = clients[1]
    reroutes = stale.tables.reroutes
    stale.set_layout(dataclasses.replace(moved, version=layout.version))
    ids, grads = _batch(1, PENDING + 1)
    stale.push_rows(TABLE.name, ids, grads, clock=PENDING + 1)
    assert stale.tables.reroutes == reroutes + 1 and stale.layout is moved


def test_a_worker_keeps_few_sync_pushes_when_its_pulls_read_one_partition_only(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    settings = ServerSettings(replicas=1, static_quorum={"w0": 0}, pull_timeout_s=WAIT_S)
    servers, layout = _replicated(start_server, _layout, settings=settings)
    client = new_client(servers, "w0", layout=layout)
    client.declare_table(TABLE)
    mine = IDS[server_of(IDS, 3) == 0][:8]
    for clock in range(12):
        client.push_rows(TABLE.name, mine, np.ones((len(mine), DIM), np.float32), clock=clock)
        client.pull_rows(TABLE.name, mine, clock=clock + 1)
        # Partitions 1 and 2 are never read: past a few clocks the oldest push is confirmed with a
        # pull of no ids from their servers, so the pushes kept for a failover stay few.
        assert 1 <= len(client.tables._kept[TABLE.name]) <= 5
    np.testing.assert_array_equal(client.pull_rows(TABLE.name, mine, clock=12),
                                  np.full((len(mine), DIM), -12.0, np.float32))
