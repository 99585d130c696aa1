"""A scheduled call's row push survives a table failover exactly once (ps_server/tables/scheduled.py): the
table's record of scheduled pushes reaches its backup with the rows, so when the primary dies after
applying a push whose reply was lost, the heir drops the call's re-dispatch from another worker."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
from pshard.common.cluster.layout import Layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.sparse import server_of
from pshard.ps_server.tables.table import SparseTable

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc
from tests.service.test_table_replication import (
    CONFIG,
    IDS,
    WAIT_S,
    _grads,
    _layout,
    _replicated,
    _rows,
    _state,
)


def test_the_heir_drops_a_re_dispatched_scheduled_push_its_dead_primary_applied(start_server,
                                                                                 new_client) -> None:
    servers, layout = _replicated(start_server, _layout)
    addresses = [s.address for s in servers]
    moved, _ = fail_over(layout, 1, {0, 2})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    published = threading.Event()

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return moved if published.wait(timeout_s) and moved.version > current.version else None

    client = new_client(servers, "w0", layout=layout, relayout=relayout, reroute_wait_s=WAIT_S,
                        transport="grpc")
    client.declare_table(CONFIG)
    mine = IDS[server_of(IDS, 3) == 1][:5]
    client.pull_rows("emb", mine)  # the rows exist (initialized) before the call
    # Call 7's first push, applied on server 1 and acknowledged by its backup; no push_id: the per-worker
    # log cannot know the re-dispatch, which another worker sends.
    first = pb.PushRowsRequest(table="emb", ids=mine.tobytes(), grads=_grads(9, 5).tobytes(), worker_id="w0",
                               schedule_id=7, schedule_seq=0, schedule_floor=7)
    assert pb_grpc.SparseTablesServiceStub(client._channels[1]).PushRows(first, timeout=WAIT_S).stored == 5
    before = servers[1].running.tables.find("emb")
    assert before is not None
    expected = _state(before, mine)

    servers[1].stop(grace_s=0)
    for i in (0, 2):  # the view without server 1, and the failover layout naming server 2 the heir
        servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([addresses[2 - i]]),
                                     _rows(servers[i]).on_layout(moved)))
    published.set()
    heir_stub = pb_grpc.SparseTablesServiceStub(client._channels[2])
    again = pb.PushRowsRequest(table="emb", ids=mine.tobytes(), grads=_grads(9, 5).tobytes(), worker_id="w1",
                               schedule_id=7, schedule_seq=0, schedule_floor=7)
    assert heir_stub.PushRows(again, timeout=WAIT_S).stored == 0  # counted once, on the dead primary
    heir = servers[2].running.tables.find("emb")
    assert heir is not None and _state(heir, mine) == expected
    following = pb.PushRowsRequest(table="emb", ids=mine.tobytes(), grads=_grads(10, 5).tobytes(),
                                   worker_id="w1", schedule_id=7, schedule_seq=1, schedule_floor=7)
    assert heir_stub.PushRows(following, timeout=WAIT_S).stored == 5  # the call's next push is new


def test_a_push_that_reached_one_partition_is_applied_on_re_dispatch_to_the_other_only(start_server,
                                                                                       new_client) -> None:
    """Call 7's push reached server 2 and not server 1, which then died: the heir, serving both partitions,
    applies the re-dispatch to server 1's rows once and leaves its own, which had it, as they were."""
    servers, layout = _replicated(start_server, _layout)
    addresses = [s.address for s in servers]
    moved, _ = fail_over(layout, 1, {0, 2})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    client = new_client(servers, "w0", layout=layout, reroute_wait_s=WAIT_S, transport="grpc")
    client.declare_table(CONFIG)
    lost, reached = IDS[server_of(IDS, 3) == 1][:3], IDS[server_of(IDS, 3) == 2][:4]
    both = np.concatenate([lost, reached])
    assert client.push_rows("emb", both, _grads(3, 7)) == 7  # the rows exist, on servers and backups
    first = pb.PushRowsRequest(table="emb", ids=reached.tobytes(), grads=_grads(9, 4).tobytes(),
                               worker_id="w0", schedule_id=7, schedule_seq=0, schedule_floor=7)
    heir_stub = pb_grpc.SparseTablesServiceStub(client._channels[2])
    assert heir_stub.PushRows(first, timeout=WAIT_S).stored == 4  # the part for server 1 was never sent
    dead = servers[1].running.tables.find("emb")
    assert dead is not None
    # What one application of the call's push to server 1's rows gives, on a copy of them.
    once = SparseTable(CONFIG)
    rows = dead.index.lookup(lost)
    once.restore_rows(lost, {name: array[rows].copy() for name, (array, _) in dead.columns().items()})
    once.push(lost, _grads(9, 5)[:3])

    servers[1].stop(grace_s=0)
    for i in (0, 2):
        servers[i].call(lambda i=i: (_rows(servers[i]).set_backups([addresses[2 - i]]),
                                     _rows(servers[i]).on_layout(moved)))
    heir = servers[2].running.tables.find("emb")
    assert heir is not None
    pushed = _state(heir, reached)
    grads = np.concatenate([_grads(9, 5)[:3], _grads(9, 4)])
    again = pb.PushRowsRequest(table="emb", ids=both.tobytes(), grads=grads.tobytes(), worker_id="w1",
                               schedule_id=7, schedule_seq=0, schedule_floor=7)
    assert heir_stub.PushRows(again, timeout=WAIT_S).stored == 3  # server 1's rows only
    assert _state(heir, lost) == _state(once, lost) and _state(heir, reached) == pushed
    assert heir_stub.PushRows(again, timeout=WAIT_S).stored == 0  # a third run: both partitions have it
    assert _state(heir, lost) == _state(once, lost) and _state(heir, reached) == pushed
