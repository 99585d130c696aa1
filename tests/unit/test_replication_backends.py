"""The ways a batch of slice states reaches a backup (ps_server/replication/backends.py), and the no-op
replication of a job without replicas (ps_server/replication/api.py). The backup is a real ReplicaSet,
reached through a Replicate call made in process (the service tests cover the network)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import codec
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.replication.api import NO_ROW_REPLICATION, NO_SLICE_REPLICATION
from pshard.ps_server.replication.backends import Backend, Send, link_to
from pshard.ps_server.replication.dense import ReplicaSet
from pshard.ps_server.replication.records import record_from_proto
from pshard.ps_server.replication.tables import hold_rows

from pshard.api.v1 import parameter_server_pb2 as pb

A, B = SliceKey("a"), SliceKey("b", 1)
ADAM = JobConfig(mode="async", optimizer=OptimizerConfig(name="adam", lr=0.01))


def _primary() -> ShardStore:
    store = ShardStore(ADAM, quorum={"w0": 0})
    rng = np.random.default_rng(0)
    store.declare([(A, rng.standard_normal(50).astype(np.float32)),
                   (B, rng.standard_normal((4, 3)).astype(np.float16))])
    for clock in range(3):
        store.push(Stamp("w0", 0, clock), {A: rng.standard_normal(50).astype(np.float32),
                                           B: rng.standard_normal((4, 3)).astype(np.float16)})
    return store


def _replicate_into(backup: ReplicaSet, calls: list[pb.ReplicateRequest]) -> Send:
    """The backup's side of a Replicate call, as the servicer makes it (decode, replay, answer)."""
    def send(address: str, request: pb.ReplicateRequest) -> pb.ReplicateResponse:
        calls.append(request)
        records = [record_from_proto(r) for r in request.records]
        need = backup.apply(ADAM, records, request.primary, request.segments)
        return pb.ReplicateResponse(need_state=[codec.slice_id_to_proto(k) for k in need])
    return send


def _ship(link: Backend, store: ShardStore) -> tuple[Backend, list[SliceKey]]:
    """One batch of every slice, as the Replicator's sender makes it: the link it went by, and the
    slices the backup asked for again."""
    slots = store.slots()
    link = link.prepare(slots)
    arrays: list[np.ndarray] = []
    records = []
    for slot in slots:
        with slot.lock:
            records.append(link.record(slot, arrays))
    request = pb.ReplicateRequest(primary="p", config=codec.job_to_proto(ADAM), records=records)
    reply = link.call(request, arrays)
    return link, [codec.slice_id_from_proto(k) for k in reply.need_state]


def _assert_identical(store: ShardStore, backup: ReplicaSet) -> None:
    for slot in store.slots():
        copy = backup._slots[slot.key]
        assert (copy.version, copy.last_clock) == (slot.version, slot.last_clock)
        assert copy.value.tobytes() == slot.value.tobytes()


def test_without_shared_memory_or_links_the_states_go_inline_over_grpc():
    store, backup, calls = _primary(), ReplicaSet(), list[pb.ReplicateRequest]()
    link = link_to("b:1", "p", _replicate_into(backup, calls))
    assert not link.segmented
    link, need = _ship(link, store)
    assert need == []
    assert [len(r.value.data) > 0 for r in calls[0].records] == [True, True]  # the bytes in the message
    _assert_identical(store, backup)


def test_a_backup_that_cannot_map_the_segments_makes_the_link_fall_back_to_inline_for_good(tmp_path: Path):
    store, calls = _primary(), list[pb.ReplicateRequest]()
    backup = ReplicaSet()  # no shared-memory directory: another host, as the primary learns
    link = link_to("b:1", "p", _replicate_into(backup, calls), shm_dir=str(tmp_path))
    assert link.segmented
    link, need = _ship(link, store)
    assert sorted(need) == sorted([A, B]) and list(calls[0].segments)  # states named segments, unmapped
    link = link.refused()
    assert not link.segmented
    link, need = _ship(link, store)
    assert need == [] and not calls[1].segments
    _assert_identical(store, backup)
    link.close()


def test_a_same_host_backup_maps_the_states_the_call_carries_none_of(tmp_path: Path):
    store, calls = _primary(), list[pb.ReplicateRequest]()
    backup = ReplicaSet(str(tmp_path))
    link = link_to("b:1", "p", _replicate_into(backup, calls), shm_dir=str(tmp_path))
    link, need = _ship(link, store)
    assert need == [] and link.segmented
    assert all(not r.value.data for r in calls[0].records)
    _assert_identical(store, backup)
    link.acknowledged([A, B])
    link.close()
    backup.release("p")


def test_without_replicas_nothing_is_waited_for_and_no_rows_are_held():
    store = _primary()
    NO_SLICE_REPLICATION.attach(store)
    NO_SLICE_REPLICATION.seed([A])
    asyncio.run(NO_SLICE_REPLICATION.settle([A], deadline=0.0))  # returns at once, past any deadline
    assert NO_SLICE_REPLICATION.lag() == 0
    ids = np.arange(5, dtype=np.int64)
    assert NO_ROW_REPLICATION.fresh("t", ids, "w0", 7) is None  # every row of a push is applied
    assert NO_ROW_REPLICATION.served() is None
    with pytest.raises(InvalidArgumentError, match="no --replicas"):
        asyncio.run(hold_rows(NO_ROW_REPLICATION, pb.ReplicateRequest(primary="p", release_tables=True)))
