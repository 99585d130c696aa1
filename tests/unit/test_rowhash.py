"""The vectorised hash index against a dict model: batches of inserts, lookups and deletions (evictions)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pshard.ps_server.tables.rowhash import IdIndex

# Small id ranges force collisions, tombstone reuse and rehashes; the extremes check int64's edges.
_IDS = st.one_of(st.integers(-50, 50), st.sampled_from([-(2**63), 2**63 - 1, 0, 1 << 40]))
_OPS = st.lists(st.tuples(st.sampled_from(["insert", "delete", "lookup"]), st.lists(_IDS, max_size=40)),
                max_size=60)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_index_behaves_like_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    index = IdIndex()
    model: dict[int, int] = {}
    for op, raw in ops:
        ids = np.unique(np.array(raw, np.int64))
        if op == "insert":
            new = np.array([i for i in ids.tolist() if i not in model], np.int64)
            rows = index.insert(new)
            assert len(set(rows.tolist()) | set(model.values())) == len(rows) + len(model)  # rows distinct
            model.update(zip(new.tolist(), rows.tolist(), strict=True))
        elif op == "delete":
            gone = [i for i in ids.tolist() if i in model]
            index.delete_rows(np.array([model.pop(i) for i in gone], np.int64))
        rows = index.lookup(np.array(raw, np.int64))  # repeats and absent ids alike
        assert rows.tolist() == [model.get(i, -1) for i in raw]
        assert len(index) == len(model)
        live = index.live_rows()
        assert sorted(live.tolist()) == sorted(model.values())
        assert sorted(index.ids[live].tolist()) == sorted(model)


def test_a_large_batch_round_trips_through_rehashes() -> None:
    index = IdIndex()
    ids = np.random.default_rng(0).choice(1 << 60, 300_000, replace=False).astype(np.int64)
    rows = np.concatenate([index.insert(chunk) for chunk in np.array_split(ids, 7)])
    assert (index.lookup(ids) == rows).all()
    index.delete_rows(rows[::2])
    assert (index.lookup(ids[::2]) == -1).all() and (index.lookup(ids[1::2]) == rows[1::2]).all()
    again = index.insert(ids[::2])  # freed rows are reused: none beyond the peak
    assert again.max() < len(ids) and (index.lookup(ids[::2]) == again).all()


def test_a_repeated_lookup_sees_every_insertion_and_deletion_in_between() -> None:
    index = IdIndex()
    ids = np.array([5, -7, 2**40], np.int64)
    assert (index.lookup(ids) == -1).all()
    rows = index.insert(ids[:2])
    np.testing.assert_array_equal(index.lookup(ids), [rows[0], rows[1], -1])
    index.delete_rows(rows[:1])
    np.testing.assert_array_equal(index.lookup(ids), [-1, rows[1], -1])
    answer = index.lookup(ids)
    answer[:] = 99  # the caller owns its answer: the remembered one is not changed through it
    np.testing.assert_array_equal(index.lookup(ids), [-1, rows[1], -1])
