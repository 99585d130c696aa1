"""The compiled push of narrow rows (ps_server.tables.narrow_kernels) against the numpy path it replaces
(SparseTable._push_gathered: decode_rows, row_optim.apply, rowcodec.encode_rows), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.sparse import TableConfig
from pshard.ps_server.tables import narrow_kernels, rowcodec
from pshard.ps_server.tables.kernels import AHEAD
from pshard.ps_server.tables.table import SparseTable

# Request sizes around the prefetch distance, and values from subnormal to past float16's range.
_SIZES = (1, AHEAD - 1, AHEAD, AHEAD + 1, 300)
_SCALES = (1e-6, 0.01, 1.0, 300.0, 1e6)
# int8 rows hold a minimum down to -65504 and a range up to 255 x 65504 (float16 offset and scale).
_INT8_SCALES = (1e-6, 0.01, 1.0, 300.0, 3000.0)


def _columns(table: SparseTable) -> dict[str, bytes]:
    return {"values": table.values.tobytes(), "touch": table.touch.tobytes(), "count": table.count.tobytes(),
            **{name: a.tobytes() for name, a in table.state.items()}}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16", "int8"])
def test_compiled_narrow_pushes_store_what_the_numpy_path_stores(row_dtype: str, optimizer: str) -> None:
    """Two tables alike; one pushes through the compiled pass (SparseTable.push), the other through the
    numpy path on the same rows: after rounds of random pushes of every size and scale, their stored
    bytes, sums, touches and counts are equal. The adagrad tables keep their last touch (a ttl that
    expires nothing), the sgd ones write it to a sink (ps_server.tables.table._sink)."""
    config = TableConfig("emb", 13, row_dtype=row_dtype, optimizer=optimizer, initializer="normal",
                         init_scale=0.5, lr=0.3, seed=5, ttl=1e9 if optimizer == "adagrad" else 0.0)
    compiled, reference = SparseTable(config), SparseTable(config)
    rng = np.random.default_rng(11)
    universe = np.arange(1000, 1400, dtype=np.int64)
    for table in (compiled, reference):  # rows created alike (creation is not what this compares)
        table.push(universe, np.zeros((len(universe), config.dim), np.float32), clock=0.0)
    assert _columns(compiled) == _columns(reference)
    clock = 1.0
    for scale in _INT8_SCALES if row_dtype == "int8" else _SCALES:
        for n in _SIZES:
            ids = np.sort(rng.choice(universe, n, replace=False))
            grads = (rng.standard_normal((n, config.dim)) * scale).astype(np.float32)
            grads[rng.random(grads.shape) < 0.05] = 0.0
            compiled.push(ids, grads, clock=clock)
            rows = reference.index.lookup(ids)
            reference.step += 1
            reference._push_gathered(rows, grads, clock)
            assert _columns(compiled) == _columns(reference), (scale, n)
            clock += 1.0
    if row_dtype == "float16" and optimizer == "sgd":  # the largest took rows past 65504: inf, as numpy
        assert np.isinf(compiled.decoded(np.arange(len(universe)))).any()


def test_half_conversions_match_numpy_on_every_half_and_the_float32_edges() -> None:
    """Every 16-bit pattern widens as numpy widens it, and float32s around each rounding edge (ties,
    subnormals, overflow, NaN) narrow as numpy's astype(float16) narrows them."""
    halves = np.arange(1 << 16, dtype=np.uint32)
    widened = np.array([narrow_kernels._half_to_bits(h) for h in halves.tolist()], np.uint32)
    expected = halves.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    finite = ~np.isnan(expected.view(np.float32))
    assert np.array_equal(widened[finite], expected[finite])
    assert np.isnan(widened[~finite].view(np.float32)).all()
    edges = expected[finite].astype(np.int64)  # every half's float32: the rounding boundaries lie beside
    probes = np.unique(np.concatenate([edges + d for d in (-1, 0, 1, 0x1000, 0xFFF, 0x1001)]))
    probes = probes[(probes >= 0) & (probes < 1 << 32)].astype(np.uint32)
    rng = np.random.default_rng(0)
    probes = np.concatenate([probes, rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)])
    narrowed = np.array([narrow_kernels._bits_to_half(f) for f in probes.tolist()], np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        reference = probes.view(np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    numbers = ~np.isnan(probes.view(np.float32))
    assert np.array_equal(narrowed[numbers], reference[numbers])
    assert (narrowed[~numbers] & 0x7C00 == 0x7C00).all() and (narrowed[~numbers] & 0x3FF != 0).all()


def test_int8_offset_and_scale_match_numpy_at_the_float16_edges() -> None:
    """The compiled float16 offset (the minimum rounded down) and scale ((max - offset) / 255 rounded up)
    are rowcodec's bits for minima and maxima around every float16, subnormal ones included, zeros, and
    past float16's largest (where both mark the row as one an int8 row cannot hold)."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    edges = np.unique(halves[np.isfinite(halves)]).view(np.int32).astype(np.int64)
    near = np.concatenate([edges + d for d in (-1, 0, 1)])
    near = near[(near > -(1 << 31)) & (near < 1 << 31)].astype(np.int32).view(np.float32)
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 65504, 65520, -65520, 1e7, 3e38], np.float32)
    values = np.concatenate([near, special, rng.standard_normal(2000).astype(np.float32)])
    values = values[np.isfinite(values)]
    low = rng.choice(values, 40_000)
    high = low + np.abs(rng.choice(values, 40_000))
    high = np.where(np.isfinite(high), high, low).astype(np.float32)
    rows = np.stack([low, high], axis=1)
    want_offset, want_scale = rowcodec._offset_and_scale(rows)
    cell = np.empty(1, np.float32)
    bits = cell.view(np.uint32)
    got = np.array([narrow_kernels._offset_and_scale(lo, hi, cell, bits)
                    for lo, hi in zip(low.tolist(), high.tolist(), strict=True)], np.uint32)
    assert np.array_equal(got[:, 0], want_offset.view(np.uint16).astype(np.uint32))
    assert np.array_equal(got[:, 1], want_scale.view(np.uint16).astype(np.uint32))
    held = rowcodec.representable(rows)
    assert not held.all() and held.any()  # both kinds were probed
    assert np.array_equal(held, [narrow_kernels._holdable(o, c) for o, c in got.tolist()])
