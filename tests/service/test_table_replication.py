"""Sparse-table replication and failover through real servers and channels (docs/architecture.md, 9).

Three servers, replicas 1, each forwarding its table rows to the next in ring order (what
follow_scheduler sets up from the scheduler's views). A push is acknowledged only once the backup
holds the rows it changed, so the backup's replica equals its primary's table byte for byte when
the push returns. After a primary stops and the failover layout names its backup the heir, the
workers re-route its row partition there and get the exact rows, optimizer state included, and
training goes on exactly as on one unsharded table; a push resent with the same idempotence key is
dropped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.errors import UnknownKeyError
from pshard.common.rpc.serving import ServerThread
from pshard.common.sparse import TableConfig, server_of
from pshard.common.wire.sparse_codec import decode_rows
from pshard.ps_server.replication.link import grpc_sender, tcp_links
from pshard.ps_server.replication.table_rows import RowBatch, all_ids
from pshard.ps_server.replication.tables import TableReplication
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.table import SparseTable

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc
from tests.e2e.harness import wait_until

WAIT_S = 10.0
DIM = 8
CONFIG = TableConfig("emb", DIM, optimizer="adagrad", lr=0.5, initializer="normal", seed=5)
IDS = np.arange(-300, 900, 7, dtype=np.int64)


def _grads(step: int, n: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal((n, DIM)).astype(np.float32)


def _replicated(start_server: Callable[..., ServerThread], layout_of: Callable[[list[str]], Layout],
                shm_dirs: tuple[Path | None, ...] = (None, None, None),
                settings: ServerSettings | None = None, tcp: bool = False
                ) -> tuple[list[ServerThread], Layout]:
    """Three servers, each forwarding to the next; server i's rows through shared memory in
    shm_dirs[i] when given (its backup reads them there, or asks for them inline if it cannot),
    else, with `tcp`, over raw TCP links to the backups' fast-path listeners, else inline."""
    servers = [start_server(settings or ServerSettings(replicas=1)) for _ in range(3)]
    layout = layout_of([s.address for s in servers])
    for i, server in enumerate(servers):
        def wire(server: ServerThread = server, backup: str = servers[(i + 1) % 3].address,
                 shm: Path | None = shm_dirs[i]) -> None:
            rows = TableReplication(server.address, grpc_sender(), server.loop, server.running.tables,
                                    shm_dir=None if shm is None else str(shm),
                                    links=tcp_links(server.address) if tcp else None)
            server.running.tables.replication = server.running.handlers.table_replication = rows
            rows.set_backups([backup])
            rows.on_layout(layout)
        server.call(wire)
    return servers, layout


def _layout(addresses: list[str]) -> Layout:
    layout = plan_layout([ParamSpec("w", "float32", (4,))], addresses, replicas=1)
    return dataclasses.replace(layout, version=1)


def _rows(server: ServerThread) -> TableReplication:
    rows = server.running.tables.replication
    assert isinstance(rows, TableReplication)
    return rows


def _state(table: SparseTable, ids: np.ndarray) -> dict[str, bytes]:
    rows = table.index.lookup(ids)
    assert (rows >= 0).all()
    return {name: array[rows].tobytes() for name, (array, _) in table.columns().items()}


@pytest.mark.parametrize("shm", [False, True], ids=["inline", "shm"])
def test_a_push_returns_once_the_backup_holds_its_rows_and_the_heir_serves_them_exactly(
        start_server, new_client, shm: bool, tmp_path: Path) -> None:
    servers, layout = _replicated(start_server, _layout, (tmp_path if shm else None,) * 3)
    addresses = [s.address for s in servers]
    moved, _ = fail_over(layout, 1, {0, 2})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    published = threading.Event()

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return moved if published.wait(timeout_s) and moved.version > current.version else None

    client = new_client(servers, "w0", layout=layout, relayout=relayout, reroute_wait_s=WAIT_S,
                        transport="grpc")
    client.declare_table(CONFIG)
    started = time.monotonic()
    with pytest.raises(UnknownKeyError):  # a table never declared is no failover to wait for
        client.pull_rows("nope", IDS[:3])
    assert time.monotonic() - started < WAIT_S / 2
    reference = SparseTable(CONFIG)  # one unsharded table: per-row optimizers make sharding invisible
    mine = IDS[server_of(IDS, 3) == 1]
    assert len(mine) > 20
    for step in range(4):
        ids = IDS[step % 2::2] if step < 3 else IDS
        grads = _grads(step, len(ids))
        client.push_rows("emb", ids, grads)
        reference.push(ids, grads)
        # Acknowledged: each backup already holds what its primary holds, byte for byte.
        for i, server in enumerate(servers):
            primary = server.running.tables.find("emb")
            replica = _rows(servers[(i + 1) % 3]).replicas.table(addresses[i], "emb")
            assert primary is not None and replica is not None
            held = np.sort(all_ids(primary))
            assert np.array_equal(held, np.sort(all_ids(replica)))
            assert _state(primary, held) == _state(replica, held), (step, i)
    for server in servers:  # the rows went the way the test asked
        worked = server.call(lambda server=server: [p.shm_worked for p in _rows(server)._peers.values()])
        assert worked == [shm]
    # A push applied (and replicated) whose reply is lost: its resend after the failover is dropped.
    stub = pb_grpc.SparseTablesServiceStub(client._channels[1])
    lost = pb.PushRowsRequest(table="emb", ids=mine[:5].tobytes(), grads=_grads(9, 5).tobytes(),
                              worker_id="w0", push_id=424242)
    assert stub.PushRows(lost, timeout=WAIT_S).stored == 5
    reference.push(mine[:5], _grads(9, 5))
    before = servers[1].running.tables.find("emb")
    assert before is not None
    expected = _state(before, mine)

    servers[1].stop(grace_s=0)
    for i in (0, 2):  # the view without server 1, and the failover layout naming server 2 the heir
        servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([addresses[2 - i]]),
                                     _rows(servers[i]).on_layout(moved)))
    published.set()
    pulled = client.pull_rows("emb", IDS)
    assert pulled.tobytes() == reference.pull(IDS).tobytes()
    assert client.tables.reroutes == 1 and client.layout is moved
    heir = servers[2].running.tables.find("emb")
    assert heir is not None and _state(heir, mine) == expected  # optimizer state and metadata too
    # A worker that starts now declares the table on the servers that serve rows, not the dead one.
    late = new_client(servers, "w9", layout=moved, transport="grpc")
    late.declare_table(CONFIG)
    assert late.pull_rows("emb", mine).tobytes() == reference.pull(mine).tobytes()
    assert len(late.tables.stats("emb")) == 2
    assert _rows(servers[2]).promoted_rows == len(all_ids(before))
    heir_stub = pb_grpc.SparseTablesServiceStub(client._channels[2])
    assert heir_stub.PushRows(lost, timeout=WAIT_S).stored == 0  # the heir knows the push: not applied twice
    # The same push resent with ids of the heir's own partition too (one request per server): only
    # the partition that had applied it drops its part.
    own = IDS[server_of(IDS, 3) == 2][:4]
    both = np.concatenate([mine[:5], own])
    order = np.argsort(both)
    grads = np.concatenate([_grads(9, 5), _grads(11, 4)])
    again = pb.PushRowsRequest(table="emb", ids=both[order].tobytes(), grads=grads[order].tobytes(),
                               worker_id="w0", push_id=424242)
    assert heir_stub.PushRows(again, timeout=WAIT_S).stored == len(own)
    reference.push(own, _grads(11, 4))
    for step in range(10, 13):  # training goes on, the heir replicating to server 0 now
        grads = _grads(step, len(IDS))
        client.push_rows("emb", IDS, grads)
        reference.push(IDS, grads)
    assert client.pull_rows("emb", IDS).tobytes() == reference.pull(IDS).tobytes()
    wait_until(lambda: servers[2].call(lambda: _rows(servers[2]).in_sync()) == {addresses[0]}, WAIT_S,
               "server 0 to hold every row of server 2, promoted ones included")
    replica = _rows(servers[0]).replicas.table(addresses[2], "emb")
    assert replica is not None
    assert _state(replica, IDS[server_of(IDS, 3) > 0]) == _state(heir, IDS[server_of(IDS, 3) > 0])
    assert list(tmp_path.glob("*.seg")) == []  # each segment unlinked once its backup had mapped it


def test_a_backup_that_cannot_map_the_segment_gets_the_rows_inline(start_server, new_client,
                                                                   tmp_path: Path) -> None:
    # Server 0 writes its rows to shared memory; its backup, server 1, has none (another host).
    servers, layout = _replicated(start_server, _layout, (tmp_path, None, None))
    client = new_client(servers, "w0", layout=layout)
    client.declare_table(CONFIG)
    for step in range(3):
        client.push_rows("emb", IDS, _grads(step, len(IDS)))
    table = servers[0].running.tables.find("emb")
    replica = _rows(servers[1]).replicas.table(servers[0].address, "emb")
    assert table is not None and replica is not None
    held = all_ids(table)
    assert _state(table, held) == _state(replica, held)
    assert servers[0].call(lambda: [p.segment for p in _rows(servers[0])._peers.values()]) == [None]


def test_a_new_backup_copies_every_row_before_it_counts_in_sync_and_foreign_ids_are_refused(
        start_server, new_client) -> None:
    servers, layout = _replicated(start_server, _layout)
    client = new_client(servers, "w0", layout=layout)
    client.declare_table(CONFIG)
    client.push_rows("emb", IDS, _grads(0, len(IDS)))
    primary = servers[0]
    assert primary.call(lambda: _rows(primary).in_sync()) == {servers[1].address}
    # Server 2 becomes a backup of server 0 too: it must first get every row.
    joined = primary.call(lambda: (_rows(primary).set_backups([servers[1].address, servers[2].address]),
                                   _rows(primary).in_sync())[1])
    assert joined == {servers[1].address}
    wait_until(lambda: primary.call(lambda: _rows(primary).in_sync()) == {s.address for s in servers[1:]},
               WAIT_S, "server 2 to copy server 0's rows")
    table = primary.running.tables.find("emb")
    replica = _rows(servers[2]).replicas.table(primary.address, "emb")
    assert table is not None and replica is not None
    held = all_ids(table)
    assert len(held) and _state(table, held) == _state(replica, held)
    # A table restored by a global checkpoint (rows no backup has): the backups copy it before they
    # count in sync again.
    restored = SparseTable(dataclasses.replace(CONFIG, name="restored"))
    own = IDS[server_of(IDS, 3) == 0]
    restored.push(own, _grads(1, len(own)))
    copying = primary.call(lambda: (primary.running.tables.add(restored), _rows(primary).in_sync())[1])
    assert copying == set()
    wait_until(lambda: primary.call(lambda: _rows(primary).in_sync()) == {s.address for s in servers[1:]},
               WAIT_S, "the backups to copy the restored table")
    for backup in servers[1:]:
        copy = _rows(backup).replicas.table(primary.address, "restored")
        assert copy is not None and _state(copy, own) == _state(restored, own)
    # Server 1 comes back as a new process (a new generation in the view): it holds nothing, so it is
    # out of sync at once, and in sync again only once it has every row anew.
    def view(generation: int) -> ClusterView:
        node = Node("ps-1", "ps", 1, servers[1].address, NodeState.LIVE, generation)
        return ClusterView(generation, (node,))
    primary.call(lambda: _rows(primary).on_view(view(1)))
    _rows(servers[1]).replicas.release(primary.address)  # what a new process holds: nothing
    assert primary.call(lambda: (_rows(primary).on_view(view(2)), _rows(primary).in_sync())[1]) == {
        servers[2].address}
    wait_until(lambda: primary.call(lambda: _rows(primary).in_sync()) == {s.address for s in servers[1:]},
               WAIT_S, "the restarted backup to copy server 0's rows again")
    again = _rows(servers[1]).replicas.table(primary.address, "emb")
    assert again is not None and _state(again, held) == _state(table, held)
    # Ids of server 1's partition sent to server 0: refused (NOT_FOUND), nothing created.
    stub = pb_grpc.SparseTablesServiceStub(client._channels[0])
    foreign = IDS[server_of(IDS, 3) == 1][:3]
    try:
        stub.PullRows(pb.PullRowsRequest(table="emb", ids=foreign.tobytes()), timeout=WAIT_S)
    except Exception as err:
        assert "row partition 1" in str(err)
    else:
        raise AssertionError("server 0 served ids of another server's partition")
    assert (table.index.lookup(foreign) < 0).all()


def test_a_push_split_over_several_calls_sends_its_idempotence_key_with_its_last_rows(
        start_server, new_client, monkeypatch) -> None:
    """A push whose rows exceed one Replicate call goes out in several; its key must reach the backup
    no earlier than its last rows, else an heir (the primary dead between two calls) would drop the
    worker's resend of a push whose rows it lacks."""
    import pshard.ps_server.replication.tables as table_replication

    monkeypatch.setattr(table_replication, "_BATCH_BYTES", 1000)  # about ten rows a call
    servers, layout = _replicated(start_server, _layout)
    calls: list[tuple[str, np.ndarray, bool]] = []  # (primary, ids, carried w0's push keys)
    lock = threading.Lock()
    backup = _rows(servers[2])  # server 1's backup
    apply = backup.replicas.apply

    def recording(primary: str, batches: Iterable[RowBatch],
                  refuse: Callable[[RowBatch], None] | None = None) -> None:
        taken = list(batches)
        with lock:
            for batch in taken:
                calls.append((primary, batch.ids.copy(), bool(batch.pushes.get("w0"))))
        apply(primary, taken, refuse)

    backup.replicas.apply = recording  # type: ignore[method-assign]
    client = new_client(servers, "w0", layout=layout, transport="grpc")
    client.declare_table(CONFIG)
    mine = IDS[server_of(IDS, 3) == 1]
    client.push_rows("emb", IDS, _grads(0, len(IDS)))  # returns once the backup holds every row
    with lock:
        of_primary = [(ids, keyed) for primary, ids, keyed in calls if primary == servers[1].address]
    assert len(of_primary) > 2, "the push was not split: the test proves nothing"
    received: set[int] = set()
    for ids, keyed in of_primary:
        received.update(ids.tolist())
        if keyed:
            missing = sorted(set(mine.tolist()) - received)
            assert not missing, f"the push's key reached the backup before its rows {missing[:5]}"
            break
    else:
        pytest.fail("the push's key never reached the backup")


@pytest.mark.parametrize("shm", [False, True], ids=["inline", "shm"])
def test_int8_rows_reach_the_backup_as_their_primary_stores_them(start_server, new_client, shm: bool,
                                                                 tmp_path: Path) -> None:
    """Narrow rows (row_dtype, issue 22) replicate as stored bytes: backups equal their primary bit for bit,
    and a client over gRPC decodes the rows one unsharded table of the same rounding holds."""
    config = dataclasses.replace(CONFIG, name="q", row_dtype="int8")
    servers, layout = _replicated(start_server, _layout, (tmp_path if shm else None,) * 3)
    client = new_client(servers, "w0", layout=layout, transport="grpc")
    client.declare_table(config)
    reference = SparseTable(config)  # int8 draws of the seed, id and update count: sharding is invisible
    for step in range(3):
        grads = _grads(step, len(IDS))
        client.push_rows("q", IDS, grads)
        reference.push(IDS, grads)
    for i, server in enumerate(servers):
        primary = server.running.tables.find("q")
        replica = _rows(servers[(i + 1) % 3]).replicas.table(server.address, "q")
        assert primary is not None and replica is not None and primary.values.dtype == np.uint8
        held = np.sort(all_ids(primary))
        assert len(held) and _state(primary, held) == _state(replica, held), i
        worked = server.call(lambda server=server: [p.shm_worked for p in _rows(server)._peers.values()])
        assert worked == [shm]
    assert client.pull_rows("q", IDS).tobytes() == decode_rows(config, reference.pull(IDS)).tobytes()
