"""Twelve table row partitions on three real replicated servers (issue 20): each server serves the ids
of its four partitions and refuses the others', its backup holds them byte for byte, and a failover
hands all four to the heir, after which training goes on exactly as on one unsharded table, and a
sync table's pending clock is applied once in each partition the heir adopts."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.cluster.view import ClusterView, Node, NodeState, PartitionCopy
from pshard.common.rpc.serving import ServerThread
from pshard.common.sparse import server_of
from pshard.ps_server.replication.link import grpc_sender
from pshard.ps_server.replication.table_rows import all_ids
from pshard.ps_server.replication.tables import TableReplication
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.table import SparseTable

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc
from tests.e2e.harness import wait_until
from tests.service.test_table_replication import CONFIG, IDS, WAIT_S, _grads, _replicated, _rows, _state
from tests.service.test_table_replication_sync import CLOCKS, PENDING, TABLE, _batch, _expected
from tests.service.test_table_replication_sync import IDS as SYNC_IDS

PARTITIONS = 12


def _layout(addresses: list[str]) -> Layout:
    layout = plan_layout([ParamSpec("w", "float32", (4,))], addresses, replicas=1, row_partitions=PARTITIONS)
    return dataclasses.replace(layout, version=1)


def test_more_partitions_than_servers_are_served_replicated_and_failed_over_whole(
        start_server, new_client) -> None:
    servers, layout = _replicated(start_server, _layout)
    addresses = [s.address for s in servers]
    owners = np.asarray(layout.row_owners)
    moved, _ = fail_over(layout, 1, {0, 2})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    published = threading.Event()

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return moved if published.wait(timeout_s) and moved.version > current.version else None

    client = new_client(servers, "w0", layout=layout, relayout=relayout, reroute_wait_s=WAIT_S,
                        transport="grpc")
    client.declare_table(CONFIG)
    reference = SparseTable(CONFIG)
    for step in range(3):
        grads = _grads(step, len(IDS))
        client.push_rows("emb", IDS, grads)
        reference.push(IDS, grads)
    partition = server_of(IDS, PARTITIONS)
    for i, server in enumerate(servers):
        table = server.running.tables.find("emb")
        replica = _rows(servers[(i + 1) % 3]).replicas.table(addresses[i], "emb")
        assert table is not None and replica is not None
        held = np.sort(all_ids(table))
        assert np.array_equal(held, np.sort(IDS[owners[partition] == i]))  # its four partitions' ids
        assert _state(table, held) == _state(replica, held)
    # Ids of partition 4 (server 1's) sent to server 0: refused, nothing created.
    foreign = IDS[partition == 4][:3]
    stub = pb_grpc.SparseTablesServiceStub(client._channels[0])
    try:
        stub.PullRows(pb.PullRowsRequest(table="emb", ids=foreign.tobytes()), timeout=WAIT_S)
    except Exception as err:
        assert "row partition 4" in str(err)
    else:
        raise AssertionError("server 0 served ids of another server's partition")

    servers[1].stop(grace_s=0)
    for i in (0, 2):
        servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([addresses[2 - i]]),
                                     _rows(servers[i]).on_layout(moved)))
    published.set()
    assert client.pull_rows("emb", IDS).tobytes() == reference.pull(IDS).tobytes()
    assert moved.partitions_on(2) == (1, 2, 4, 5, 7, 8, 10, 11)
    for step in range(10, 12):  # training goes on with the heir serving eight partitions
        grads = _grads(step, len(IDS))
        client.push_rows("emb", IDS, grads)
        reference.push(IDS, grads)
    assert client.pull_rows("emb", IDS).tobytes() == reference.pull(IDS).tobytes()


SYNC_SETTINGS = ServerSettings(replicas=1, static_quorum={"w0": 0, "w1": 0}, pull_timeout_s=WAIT_S)


def _step(client: PSClient, w: int, clock: int, push: bool = True) -> None:
    """Worker `w`'s step of the sync table: its push of `clock`, then its pull of `clock` + 1."""
    if push:
        client.push_rows(TABLE.name, *_batch(w, clock), clock=clock)
    client.pull_rows(TABLE.name, SYNC_IDS, clock=clock + 1)


class Published:
    """Layouts as a scheduler publishes them: `relayout` (a PSClient's) waits for one newer than its own."""

    def __init__(self, layout: Layout) -> None:
        self._layouts = [layout]
        self._changed = threading.Condition()

    def publish(self, layout: Layout) -> None:
        with self._changed:
            self._layouts.append(layout)
            self._changed.notify_all()

    def relayout(self, current: Layout, timeout_s: float) -> Layout | None:
        with self._changed:
            self._changed.wait_for(lambda: self._layouts[-1].version > current.version, timeout_s)
            newest = self._layouts[-1]
            return newest if newest.version > current.version else None


def _train(pool: ThreadPoolExecutor, clients: list[PSClient], clocks: range) -> None:
    """Both workers' steps of `clocks`, side by side (a sync clock waits for both)."""
    for clock in clocks:
        for f in [pool.submit(_step, clients[w], w, clock) for w in (0, 1)]:
            f.result(timeout=WAIT_S)


def test_a_sync_clock_pending_on_a_failed_server_of_four_partitions_is_applied_once_by_its_heir(
        start_server, new_client) -> None:
    """As test_table_replication_sync's failover, with each server serving four partitions: every
    partition keeps its own clocks, and the heir applies the pending clock once in each it adopts."""
    published = threading.Event()
    servers, layout = _replicated(start_server, _layout, settings=SYNC_SETTINGS)
    addresses = [s.address for s in servers]
    moved = dataclasses.replace(fail_over(layout, 1, {0, 2})[0], version=layout.version + 1)

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return moved if published.wait(timeout_s) and moved.version > current.version else None

    clients = [new_client(servers, f"w{w}", layout=layout, relayout=relayout, reroute_wait_s=WAIT_S,
                          retry_budget_s=0.5, transport="grpc") for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    assert set(server_of(SYNC_IDS, PARTITIONS).tolist()) == set(range(PARTITIONS))

    with ThreadPoolExecutor(2) as pool:
        _train(pool, clients, range(PENDING))
        clients[0].push_rows(TABLE.name, *_batch(0, PENDING), clock=PENDING)  # acknowledged, pending
        servers[1].stop(grace_s=0)
        for i in (0, 2):
            servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([addresses[2 - i]]),
                                         _rows(servers[i]).on_layout(moved)))
        published.set()
        # w0's push of PENDING was acknowledged before the stop: it pulls; w1 pushes it now.
        futures = [pool.submit(_step, clients[0], 0, PENDING, False),
                   pool.submit(_step, clients[1], 1, PENDING)]
        for f in futures:
            f.result(timeout=3 * WAIT_S)
        _train(pool, clients, range(PENDING + 1, CLOCKS))
    final = clients[0].pull_rows(TABLE.name, SYNC_IDS, clock=CLOCKS)
    np.testing.assert_array_equal(final, _expected(CLOCKS))
    assert clients[0].tables.resent >= 1 and clients[0].layout is moved


def _applied(server: ServerThread) -> dict[int, int]:
    """The sync table's first clock not applied, per partition, on `server`."""
    return server.call(lambda: server.running.tables.sync_applied(TABLE.name))


def _switch(servers: list[ServerThread], layout: Layout, partition: int, target: int) -> Layout:
    """`partition` to server `target` under the next layout version, which every server learns."""
    moved = dataclasses.replace(layout, version=layout.version + 1, row_owners=tuple(
        target if p == partition else o for p, o in enumerate(layout.owners())))
    for server in servers:
        server.call(lambda server=server: _rows(server).on_layout(moved))
    return moved


def _move_to_backup(servers: list[ServerThread], layout: Layout, partition: int) -> Layout:
    """Move `partition` from server 0 to server 1, its backup (`pshard rebalance`), once server 1's replica
    holds server 0's applied clocks; every server learns the new layout."""
    wait_until(lambda: _rows(servers[1]).replicas.clocks(servers[0].address).get(TABLE.name)
               == _applied(servers[0]), WAIT_S, "server 1's replica of server 0 holds its applied clocks")
    return _switch(servers, layout, partition, 1)


def _copy(servers: list[ServerThread], layout: Layout, partition: int, target: int) -> None:
    """The scheduler's view naming a catch-up copy of `partition` from its server to server `target`, as
    every server gets it."""
    addresses = [s.address for s in servers]
    nodes = tuple(Node(f"ps-{i}", "ps", i, a, NodeState.LIVE, generation=i + 1)
                  for i, a in enumerate(addresses))
    copy = PartitionCopy(partition, addresses[layout.row_owner(partition)], addresses[target])
    view = ClusterView(10, nodes, layout.version, copies=(copy,))
    for server in servers:
        server.call(lambda server=server: _rows(server).on_view(view))


def _await_copy(servers: list[ServerThread], partition: int, target: int) -> None:
    """Until server 0 reports server `target` caught up with `partition` (its in-sync report)."""
    address = servers[target].address
    wait_until(lambda: servers[0].call(lambda: _rows(servers[0]).copies_in_sync()) == {address: partition},
               WAIT_S, f"server 0 reporting server {target} in sync with partition {partition}")


def test_a_sync_partition_moved_to_its_backup_is_served_there_from_its_own_applied_clock_only(
        start_server, new_client) -> None:
    """A move takes over one partition of a live server: its rows and its applied clock, never the
    clocks of the partitions the source keeps, which the target does not serve."""
    servers, layout = _replicated(start_server, _layout, settings=SYNC_SETTINGS)
    clients = [new_client(servers, f"w{w}", layout=layout, transport="grpc") for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    with ThreadPoolExecutor(2) as pool:
        _train(pool, clients, range(PENDING))
    assert _applied(servers[0]) == {p: PENDING for p in layout.partitions_on(0)}
    moved = _move_to_backup(servers, layout, 3)
    assert 3 in moved.partitions_on(1)
    assert _applied(servers[1]) == {p: PENDING for p in moved.partitions_on(1)}
    mine = SYNC_IDS[server_of(SYNC_IDS, PARTITIONS) == 3]
    table = servers[1].running.tables.find(TABLE.name)
    source_table = servers[0].running.tables.find(TABLE.name)
    assert table is not None and source_table is not None and len(mine)
    held = np.intersect1d(all_ids(source_table), mine)

    def rows(t: SparseTable) -> dict[str, bytes]:
        return {name: b for name, b in _state(t, held).items() if name != "touch"}  # pulls touch unreplicated

    assert rows(table) == rows(source_table)


def test_the_heir_of_a_server_a_sync_partition_moved_from_keeps_that_partitions_clock(
        start_server, new_client) -> None:
    """Partition 3 moves from server 0 to server 1 and trains on there; then server 0 dies and server 1,
    its backup, is its heir. Server 0 still reports its stale clock of partition 3 with its rows: the heir
    must not adopt it (it rewound partition 3 to the clock of the move, and the pulls waited in vain for
    clocks the workers had already pushed), and training goes on exactly."""
    servers, layout = _replicated(start_server, _layout, settings=SYNC_SETTINGS)
    layouts = Published(layout)
    clients = [new_client(servers, f"w{w}", layout=layout, relayout=layouts.relayout, reroute_wait_s=WAIT_S,
                          retry_budget_s=0.5, transport="grpc") for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    with ThreadPoolExecutor(2) as pool:
        _train(pool, clients, range(PENDING))
        moved = _move_to_backup(servers, layout, 3)
        layouts.publish(moved)
        _train(pool, clients, range(PENDING, PENDING + 2))
        assert _applied(servers[0])[3] == PENDING and _applied(servers[1])[3] == PENDING + 2
        wait_until(lambda: _rows(servers[1]).replicas.clocks(servers[0].address).get(TABLE.name)
                   == _applied(servers[0]), WAIT_S, "server 1's replica of server 0 holds its applied clocks")
        failed = dataclasses.replace(fail_over(moved, 0, {1, 2})[0], version=moved.version + 1)
        servers[0].stop(grace_s=0)
        for i in (1, 2):
            servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([servers[3 - i].address]),
                                         _rows(servers[i]).on_layout(failed)))
        layouts.publish(failed)
        assert _applied(servers[1]) == {p: PENDING + 2 for p in failed.partitions_on(1)}
        _train(pool, clients, range(PENDING + 2, CLOCKS))
    np.testing.assert_array_equal(clients[0].pull_rows(TABLE.name, SYNC_IDS, clock=CLOCKS), _expected(CLOCKS))


def test_a_sync_partition_copied_to_a_server_that_is_no_backup_moves_with_its_clock_and_trains_on_exactly(
        start_server, new_client) -> None:
    """`pshard rebalance` to a server without a copy (issue 20): server 0 sends partition 3 alone to server 2
    (server 1 is its backup), its rows and its applied clock, then every clock's change; once server 2 is
    reported in sync the partition switches, server 2 serves it from that clock, and training goes on
    exactly. Server 2 holds nothing else of server 0, and drops the copy once it took it over."""
    servers, layout = _replicated(start_server, _layout, settings=SYNC_SETTINGS)
    addresses = [s.address for s in servers]
    layouts = Published(layout)
    clients = [new_client(servers, f"w{w}", layout=layout, relayout=layouts.relayout, reroute_wait_s=WAIT_S,
                          retry_budget_s=0.5, transport="grpc") for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    with ThreadPoolExecutor(2) as pool:
        _train(pool, clients, range(PENDING))
        _copy(servers, layout, 3, 2)
        _train(pool, clients, range(PENDING, PENDING + 1))  # a clock applied while it copies
        _await_copy(servers, 3, 2)
        assert servers[0].call(lambda: _rows(servers[0]).in_sync()) == {addresses[1]}  # its backup only
        copy = _rows(servers[2]).replicas
        assert copy.primaries() == {addresses[0], addresses[1]}  # server 2 backs up server 1
        held = copy.copy(addresses[0], lambda ids: np.ones(len(ids), bool), lambda: None)
        assert all(set(server_of(all_ids(t), PARTITIONS).tolist()) <= {3} for t, _, _ in held)
        moved = _switch(servers, layout, 3, 2)
        assert _applied(servers[2]) == {p: PENDING + 1 for p in moved.partitions_on(2)}
        assert copy.primaries() == {addresses[1]}  # server 0's copy taken over, then dropped
        layouts.publish(moved)
        _train(pool, clients, range(PENDING + 1, CLOCKS))
    assert _applied(servers[0])[3] == PENDING + 1 and _applied(servers[2])[3] == CLOCKS
    np.testing.assert_array_equal(clients[0].pull_rows(TABLE.name, SYNC_IDS, clock=CLOCKS), _expected(CLOCKS))


def test_a_sync_partition_moved_in_a_job_without_replicas_applies_its_pending_clock_once_on_its_new_server(
        start_server, new_client) -> None:
    """No replicas (issue 20): w0 pushed clock PENDING, w1 not yet, when partition 3 moves from server 0 to
    server 2 after a catch-up copy. Server 0's pending sum is not copied: w0's client kept its push (more
    row partitions than servers: they may move) and sends it again to the new layout, so server 2 applies
    clock PENDING once, with both workers' gradients, and training goes on exactly."""
    servers = [start_server(dataclasses.replace(SYNC_SETTINGS, replicas=0)) for _ in range(3)]
    addresses = [s.address for s in servers]
    layout = dataclasses.replace(plan_layout([ParamSpec("w", "float32", (4,))], addresses,
                                             row_partitions=PARTITIONS), version=1)
    for server in servers:
        def wire(server: ServerThread = server) -> None:
            rows = TableReplication(server.address, grpc_sender(), server.loop, server.running.tables)
            server.running.tables.replication = server.running.handlers.table_replication = rows
            rows.on_layout(layout)
        server.call(wire)
    layouts = Published(layout)
    clients = [new_client(servers, f"w{w}", layout=layout, relayout=layouts.relayout, reroute_wait_s=WAIT_S,
                          retry_budget_s=0.5, transport="grpc") for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    with ThreadPoolExecutor(2) as pool:
        _train(pool, clients, range(PENDING))
        clients[0].push_rows(TABLE.name, *_batch(0, PENDING), clock=PENDING)  # acknowledged, pending
        _copy(servers, layout, 3, 2)
        _await_copy(servers, 3, 2)
        layouts.publish(_switch(servers, layout, 3, 2))
        futures = [pool.submit(_step, clients[0], 0, PENDING, False),
                   pool.submit(_step, clients[1], 1, PENDING)]
        for f in futures:
            f.result(timeout=3 * WAIT_S)
        _train(pool, clients, range(PENDING + 1, CLOCKS))
    assert _applied(servers[2])[3] == CLOCKS
    np.testing.assert_array_equal(clients[0].pull_rows(TABLE.name, SYNC_IDS, clock=CLOCKS), _expected(CLOCKS))
    assert clients[0].tables.resent >= 1
