"""The tables client's stable id sort: three ways to one answer (numpy's stable argsort)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pshard.client.tables import _stable_sort

INT64 = np.iinfo(np.int64)


def _check(flat: np.ndarray) -> None:
    order, key = _stable_sort(flat)
    expected = np.argsort(flat, kind="stable")
    assert order.dtype == np.int64 and key.dtype == np.int64
    assert np.array_equal(order, expected)
    assert np.array_equal(key, flat[expected])


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 5000), span_bits=st.integers(0, 63), low=st.integers(INT64.min, INT64.max),
       seed=st.integers(0, 2**32 - 1))
def test_any_span_and_length_sorts_as_a_stable_argsort(n: int, span_bits: int, low: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    span = 1 << span_bits
    low = min(low, INT64.max - (span - 1))  # every id an int64
    flat = rng.integers(0, span, n, dtype=np.uint64).astype(np.int64) + np.int64(low)
    flat[rng.random(n) < 0.2] = flat[0] if n else 0  # repeats: stability is what the sums rely on
    _check(flat)


@pytest.mark.parametrize(("n", "span"), [
    (4096, 1_000_000),  # the sparse bench's batch: 32-bit keys
    (4096, 1 << 20),  # 12 + 20 bits: just fits 32
    (4096, (1 << 20) + 1),  # one over: 64-bit keys
    (4096, 1 << 51),  # 64-bit keys, at their edge
    (4096, 1 << 52),  # over it: numpy's argsort
])
def test_each_way_at_its_edges(n: int, span: int) -> None:
    rng = np.random.default_rng(span)
    flat = rng.integers(-5, span - 5, n, dtype=np.int64)
    flat[:2] = (-5, span - 6)  # the whole span
    flat[rng.random(n) < 0.3] = 7
    _check(flat)
