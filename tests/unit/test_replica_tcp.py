"""The raw TCP replication link's frame form (ps_server/transport/replica_tcp.py): a batch as records without
bytes plus the states' arrays, decoded as a backup's fast-path connection decodes a request, and the
same batch filled in for gRPC when the link breaks. Real stores, no network."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.replication.backends import fill_inline
from pshard.ps_server.replication.dense import ReplicaSet
from pshard.ps_server.replication.records import record_from_proto, state_to_proto
from pshard.ps_server.transport.fastconn import push_metas
from pshard.ps_server.transport.replica_tcp import frame_header, records_from_frame

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
    # A coordinator's call (pshard.coordinator): its record travels with the state.
    store.push(Stamp("w0", 0, 0, schedule=9, schedule_seq=0), {A: np.ones(50, np.float32)})
    return store


def _batch(store: ShardStore) -> tuple[pb.ReplicateRequest, list[np.ndarray]]:
    arrays: list[np.ndarray] = []
    records = [state_to_proto(slot, None, arrays) for slot in store.slots()]
    return pb.ReplicateRequest(primary="p", records=records), arrays


def _received(header: pb.ExchangeHeader, arrays: list[np.ndarray]) -> tuple[list, list[np.ndarray]]:
    """What the backup's connection hands over: the header's pushed slices, and byte views of a region."""
    metas, sizes = push_metas(pb.ExchangeHeader.FromString(header.SerializeToString()))
    region = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    offsets = np.cumsum([0, *sizes])[:-1]
    return metas, [region[o:o + n] for o, n in zip(offsets, sizes, strict=True)]


def _assert_identical(store: ShardStore, backup: ReplicaSet) -> None:
    for slot in store.slots():
        copy = backup._slots[slot.key]
        assert (copy.version, copy.last_clock) == (slot.version, slot.last_clock)
        assert copy.scheduled == slot.scheduled
        assert copy.value.tobytes() == slot.value.tobytes()
        for name, value in slot.opt_state.items():
            other = copy.opt_state[name]
            assert (other.tobytes() == value.tobytes()) if isinstance(value, np.ndarray) else other == value


def test_a_batch_over_the_link_gives_the_backup_the_primarys_bytes():
    store = _primary()
    request, arrays = _batch(store)
    assert len(arrays) == 6  # per slice: the value, then Adam's two moments by name
    assert all(not r.value.data for r in request.records)  # the bytes travel as the frame's data
    header = frame_header("ps-0", request, arrays)
    metas, views = _received(header, arrays)
    records = records_from_frame(header.replicate, metas, views)
    views[0][:] = 0  # the region is reused by the next request: the copies own their bytes
    backup = ReplicaSet()
    assert backup.apply(ADAM, records, "p") == []
    _assert_identical(store, backup)


def test_a_batch_whose_link_broke_goes_over_grpc_with_the_same_bytes():
    store = _primary()
    request, arrays = _batch(store)
    fill_inline(request, arrays)
    backup = ReplicaSet()
    assert backup.apply(ADAM, [record_from_proto(r) for r in request.records], "p") == []
    _assert_identical(store, backup)


def test_arrays_that_do_not_match_the_records_are_refused():
    store = _primary()
    request, arrays = _batch(store)
    header = frame_header("ps-0", request, arrays)
    metas, views = _received(header, arrays)
    with pytest.raises(InvalidArgumentError, match=r"replicate a exp_avg_sq: array b\[1\] float32\[4, 3\]"):
        records_from_frame(header.replicate, metas[1:], views[1:])
    del header.replicate.records[-1]
    with pytest.raises(InvalidArgumentError, match="6 arrays, its records announce 3"):
        records_from_frame(header.replicate, metas, views)
