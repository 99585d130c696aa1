"""Same-host replication's data plane (ps_server/replication/shm.py): a primary's states written into
segment files, read back by a backup's mapping; the double-buffered slots and their reset. Real files
in a temporary directory, real stores, no network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.policies import Slot
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.replication.shm import SegmentMaps, SegmentWriter, state_specs

A, B = SliceKey("a"), SliceKey("b", 1)
ADAM = JobConfig(mode="async", optimizer=OptimizerConfig(name="adam", lr=0.01))


def _store() -> ShardStore:
    store = ShardStore(ADAM, quorum={"w0": 0})
    rng = np.random.default_rng(0)
    store.declare([(A, rng.standard_normal(50).astype(np.float32)),
                   (B, rng.standard_normal((4, 3)).astype(np.float32))])
    return store


def _step(store: ShardStore, clock: int) -> None:
    rng = np.random.default_rng(clock)
    store.push(Stamp("w0", 0, clock), {A: rng.standard_normal(50).astype(np.float32),
                                       B: rng.standard_normal((4, 3)).astype(np.float32)})


def _arrays(slot: Slot) -> dict[str, bytes]:
    out = {"": slot.value.tobytes()}
    out.update({n: v.tobytes() for n, v in slot.opt_state.items() if isinstance(v, np.ndarray)})
    return out


def _read(maps: SegmentMaps, slot: Slot, where: tuple[str, int]) -> dict[str, np.ndarray]:
    return maps.arrays("p", where[0], where[1], state_specs(slot))


def test_a_state_written_is_read_back_and_survives_the_next_write_until_acknowledged(tmp_path: Path):
    store = _store()
    slots = {s.key: s for s in store.slots()}
    writer, maps = SegmentWriter(tmp_path), SegmentMaps(tmp_path)
    writer.reserve(list(slots.values()))
    _step(store, 0)
    first = {k: writer.write(s) for k, s in slots.items()}
    copies = {k: _read(maps, slots[k], w) for k, w in first.items()}
    expected = {k: _arrays(s) for k, s in slots.items()}
    for key, arrays in copies.items():
        assert {n: a.tobytes() for n, a in arrays.items()} == expected[key]
        assert not arrays[""].flags.writeable
    writer.acknowledged(slots)
    assert list(tmp_path.glob("*.seg")) == []  # opened by the backup: unlinked, still mapped by both
    # The next state goes to the other slot: the backup's copy does not move under it.
    _step(store, 1)
    second = {k: writer.write(s) for k, s in slots.items()}
    assert all(second[k][1] != first[k][1] for k in slots)
    for key, arrays in copies.items():
        assert {n: a.tobytes() for n, a in arrays.items()} == expected[key]
        now = _read(maps, slots[key], second[key])
        assert {n: a.tobytes() for n, a in now.items()} == _arrays(slots[key])
    # Acknowledged: the third state goes back to the first slot.
    writer.acknowledged(slots)
    assert {k: writer.write(s)[1] for k, s in slots.items()} == {k: w[1] for k, w in first.items()}


def test_after_a_reset_states_go_to_a_fresh_segment_and_old_copies_stay_valid(tmp_path: Path):
    store = _store()
    [slot] = [s for s in store.slots() if s.key == A]
    writer, maps = SegmentWriter(tmp_path), SegmentMaps(tmp_path)
    writer.reserve([slot])
    where = writer.write(slot)
    copy = _read(maps, slot, where)[""].copy()
    view = _read(maps, slot, where)[""]
    writer.reset()  # a failed call: which slot the backup holds is unknown
    _step(store, 0)
    writer.reserve([slot])
    fresh = writer.write(slot)
    assert fresh[0] != where[0] and writer.names == [fresh[0]]
    assert view.tobytes() == copy.tobytes()  # the mapping outlives the file
    maps.keep("p", writer.names)
    assert _read(maps, slot, fresh)[""].tobytes() == slot.value.tobytes()


@pytest.mark.parametrize("name", ["../etc/passwd", "x.seg", "pshard-s-1-2-0123456789abcdef.sock"])
def test_a_backup_maps_only_pshard_segment_names(tmp_path: Path, name: str):
    store = _store()
    with pytest.raises(OSError):
        SegmentMaps(tmp_path).arrays("p", name, 0, state_specs(next(iter(store.slots()))))


def test_arrays_outside_the_segment_are_refused(tmp_path: Path):
    store = _store()
    slots = list(store.slots())
    writer = SegmentWriter(tmp_path)
    writer.reserve(slots)
    name, _ = writer.write(slots[0])
    with pytest.raises(ValueError):
        SegmentMaps(tmp_path).arrays("p", name, 1 << 20, state_specs(slots[0]))
