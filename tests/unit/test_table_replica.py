"""Table rows as a backup holds them (ps_server/replication/table_rows.py) and row partitions in the
layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.replicas import NoInSyncCopyError, fail_over, heir_of, moved_partitions
from pshard.common.sparse import TableConfig, server_of
from pshard.common.wire import codec
from pshard.ps_server.replication.table_rows import (
    PUSHES_KEPT,
    PushLog,
    ReplicaTables,
    all_ids,
    capture,
    install,
    merge,
)
from pshard.ps_server.replication.table_wire import batch_from_proto, batch_to_proto
from pshard.ps_server.tables.table import SparseTable

DIM = 4


def _table(**kw: object) -> SparseTable:
    return SparseTable(TableConfig("emb", DIM, **kw))  # type: ignore[arg-type]


def _push(table: SparseTable, ids: list[int], seed: int, clock: float | None = None) -> np.ndarray:
    keys = np.array(ids, np.int64)
    grads = np.random.default_rng(seed).standard_normal((len(keys), DIM)).astype(np.float32)
    table.push(keys, grads, clock)
    return keys


def _assert_same(primary: SparseTable, replica: SparseTable) -> None:
    ids = np.sort(all_ids(primary))
    assert np.array_equal(ids, np.sort(all_ids(replica)))
    mine, theirs = primary.index.lookup(ids), replica.index.lookup(ids)
    for name, (array, _) in primary.columns().items():
        other = replica.columns()[name][0]
        assert array[mine].tobytes() == other[theirs].tobytes(), name
    assert (primary.step, primary.clock, primary.evicted, primary.admitted) == (
        replica.step, replica.clock, replica.evicted, replica.admitted)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "lazy_adam"])
def test_a_replica_fed_the_changed_rows_equals_its_primary_byte_for_byte(optimizer: str) -> None:
    primary, replica = _table(optimizer=optimizer, lr=0.1), _table(optimizer=optimizer, lr=0.1)
    dirty: list[np.ndarray] = []
    for step in range(6):
        dirty.append(_push(primary, [1, 5 + step, 70, -3 * step], step, clock=step))
        if step % 2:  # batches coalesce the pushes in between: a row travels once, as it is now
            ids = np.unique(np.concatenate(dirty))
            install(replica, batch_from_proto(batch_to_proto(capture(primary, ids))))
            dirty.clear()
            _assert_same(primary, replica)
    # The replica keeps serving as its primary would: the same push gives the same rows.
    _push(primary, [1, 99], 100, clock=9)
    _push(replica, [1, 99], 100, clock=9)
    _assert_same(primary, replica)


def test_evictions_and_admission_counts_reach_the_replica() -> None:
    primary = _table(max_rows=64, cap_policy="lru", admit_after=2)
    replica = _table(max_rows=64, cap_policy="lru", admit_after=2)
    evicted: list[np.ndarray] = []
    primary.evict_hook = evicted.append
    dirty = [_push(primary, list(range(100)), 0, clock=0)]  # only counted: nothing is a row yet
    install(replica, capture(primary, np.unique(np.concatenate(dirty))))
    assert len(replica) == 0 and replica.sightings(np.arange(100)).tolist() == [1] * 100
    dirty = [_push(primary, list(range(80)), 1, clock=1)]  # admitted (a request's own rows stay)
    dirty.append(_push(primary, list(range(10)), 2, clock=2))  # the next cuts to the cap
    dirty += evicted
    install(replica, capture(primary, np.unique(np.concatenate(dirty))))
    assert primary.evicted > 0 and len(primary) <= 64
    _assert_same(primary, replica)
    assert replica.sightings(np.arange(80, 100)).tolist() == [1] * 20
    # The counts of rows, and of evicted rows, go on (ps_server.tables.admission): the replica's follow.
    assert replica.sightings(np.arange(100)).tolist() == primary.sightings(np.arange(100)).tolist()
    assert primary.sightings(np.arange(80)).tolist() == [2] * 80
    # A second sighting of 80..99 admits them (the cap evicting others): the replica follows.
    evicted.clear()
    dirty = [_push(primary, list(range(80, 100)), 3, clock=3), *evicted]
    assert len(evicted)
    install(replica, capture(primary, np.unique(np.concatenate(dirty))))
    _assert_same(primary, replica)


def test_admission_by_probability_draws_the_same_numbers_on_the_replica() -> None:
    primary, replica = _table(admit_prob=0.5, seed=3), _table(admit_prob=0.5, seed=3)
    _push(primary, list(range(50)), 0)
    install(replica, batch_from_proto(batch_to_proto(capture(primary, np.arange(50, dtype=np.int64)))))
    _assert_same(primary, replica)
    _push(primary, list(range(50, 90)), 1)
    _push(replica, list(range(50, 90)), 1)
    _assert_same(primary, replica)


def test_merge_moves_every_row_of_another_partition_with_its_state() -> None:
    ids = np.arange(2000, dtype=np.int64)
    part = server_of(ids, 3)
    heir, dead = _table(optimizer="adagrad"), _table(optimizer="adagrad")
    _push(heir, ids[part == 0].tolist(), 0)
    _push(dead, ids[part == 1].tolist(), 1)
    _push(dead, ids[part == 1][:10].tolist(), 2)
    expected = {name: a[dead.index.lookup(ids[part == 1])].copy() for name, (a, _) in dead.columns().items()}
    moved = merge(heir, dead)
    assert np.array_equal(np.sort(moved), ids[part == 1])
    assert len(heir) == int((part < 2).sum())
    rows = heir.index.lookup(ids[part == 1])
    for name, (array, _) in heir.columns().items():
        assert array[rows].tobytes() == expected[name].tobytes(), name
    assert heir.step == 2


def test_push_log_and_replica_tables() -> None:
    log = PushLog()
    for key in range(PUSHES_KEPT + 5):
        log.add("w0", (key, 1))
    assert log.seen("w0", (PUSHES_KEPT + 4, 1)) and not log.seen("w0", (PUSHES_KEPT + 4, 2))
    assert not log.seen("w0", (0, 1)) and not log.seen("w1", (7, 1))
    primary = _table()
    keys = _push(primary, [4, 8, 15], 0)
    replicas = ReplicaTables()
    batch = capture(primary, keys, {"w0": [(11, 1), (12, 2)]})
    replicas.apply("p:1", [batch_from_proto(batch_to_proto(batch))])
    assert replicas.primaries() == {"p:1"} and replicas.rows("p:1", "emb") == 3
    [(table, pushes)] = replicas.take("p:1")
    _assert_same(primary, table)
    assert pushes.seen("w0", (12, 2)) and not pushes.seen("w0", (12, 1)) and not pushes.seen("w0", (13, 2))
    assert replicas.primaries() == set()
    replicas.apply("p:2", [capture(primary, keys)])
    assert replicas.release("p:2") == 3 and replicas.release("p:2") == 0


def test_fail_over_moves_row_partitions_with_the_slices_and_again_after_a_second_failure() -> None:
    layout = plan_layout([ParamSpec("w", "float32", (10,))], ["h:0", "h:1", "h:2"], replicas=1)
    assert layout.owners() == (0, 1, 2) and layout.row_owner(1) == 1
    # Server 1 holds no slice, only its row partition: it fails over all the same.
    assert not layout.slices_on(1)
    moved, slices = fail_over(layout, 1, {0, 2}, in_sync={2})
    assert slices == () and moved.row_owners == (0, 2, 2) and moved.partitions_on(2) == (1, 2)
    assert moved_partitions(layout, moved) == {1: 2} and heir_of(layout, moved, 1) == 2
    again, _ = fail_over(moved, 2, {0}, in_sync={0})
    assert again.owners() == (0, 0, 0)
    assert fail_over(again, 1, {0})[0] is again  # serves nothing now: nothing moves
    with pytest.raises(NoInSyncCopyError, match="partitions"):
        fail_over(layout, 1, {0, 2}, in_sync=set())
    round_trip = codec.layout_from_proto(codec.layout_to_proto(dataclasses.replace(again, version=4)))
    assert round_trip.row_owners == (0, 0, 0) and round_trip.version == 4
    assert codec.layout_from_proto(codec.layout_to_proto(layout)).row_owners == ()


def test_the_scheduled_record_reaches_the_replica_whole_and_a_batch_without_it_keeps_the_replicas() -> None:
    primary, replica = _table(), _table()
    primary.scheduled.repeated(7, 0, 5)
    primary.scheduled.record(7, 0)
    install(replica, batch_from_proto(batch_to_proto(capture(primary, _push(primary, [1, 2], 0)))))
    assert (replica.scheduled.floor, replica.scheduled.last) == (5, {7: 0})
    primary.scheduled.record(7, 1)
    partial = capture(primary, _push(primary, [3], 1))
    partial.scheduled = None  # rows of the table still to come (or an older primary's batch)
    install(replica, batch_from_proto(batch_to_proto(partial)))
    assert replica.scheduled.last == {7: 0}
    heir = _table()
    heir.scheduled.record(8, 3)
    merge(heir, replica)
    assert (heir.scheduled.floor, heir.scheduled.last) == (5, {7: 0, 8: 3})


def test_the_record_per_partition_reaches_the_replica_and_the_heir_takes_it_for_those_only() -> None:
    primary, replica, heir = _table(), _table(), _table()
    primary.scheduled.record(7, 0, 1)  # call 7's push reached the primary's partition 1, not the heir's 2
    install(replica, batch_from_proto(batch_to_proto(capture(primary, _push(primary, [1, 2], 0)))))
    assert replica.scheduled.parts == {1: {7: 0}}
    heir.scheduled.record(7, 1, 2)
    merge(heir, replica)
    assert heir.scheduled.parts == {1: {7: 0}, 2: {7: 1}}  # not folded: push 1 is new on partition 1
    assert not heir.scheduled.repeated(7, 1, 0, 1) and heir.scheduled.repeated(7, 1, 0, 2)


def test_a_server_taking_partitions_over_keeps_its_own_newest_push_keys_and_only_those_partitions_keys():
    own = PushLog()
    for push in range(1000, 1000 + PUSHES_KEPT):  # this server's: partition 3, the newest pushes
        own.add("w0", (push, 3))
    moved = PushLog()
    for push in range(900, 900 + PUSHES_KEPT):  # its old server's, partitions 1 and 2, older and newer
        moved.add("w0", (push, 1 + push % 2))
    own.merge(moved, partitions={1})
    # Appended, the old server's keys evicted this server's newest: a push a move's re-route resent
    # here was applied twice.
    assert own.seen("w0", (1000 + PUSHES_KEPT - 1, 3)) and own.seen("w0", (1154, 1))
    assert not own.seen("w0", (1155, 2))  # a partition it does not take
    assert not own.seen("w0", (1000, 3))  # the oldest go first, whoever's they are
