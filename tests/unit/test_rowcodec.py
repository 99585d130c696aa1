"""8- and 16-bit rows' rounding (ps_server.tables.rowcodec) against references: torch's float16 and
bfloat16 conversions, and for int8 the error bound, the unbiasedness and the determinism of its
stochastic rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pshard.ps_server.tables.rowcodec import (
    decode16,
    decode_int8,
    encode16,
    encode_int8,
    from_bfloat16,
    representable,
    stored_bytes_per_row,
    to_bfloat16,
)

_FLOATS = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=12),
                     elements=st.floats(width=32, allow_nan=False))


@settings(max_examples=80, deadline=None)
@given(rows=_FLOATS)
def test_16_bit_rows_round_as_torch_does(rows: np.ndarray) -> None:
    want_bf16 = torch.from_numpy(rows).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(encode16(rows, "bfloat16"), want_bf16)
    want_fp16 = torch.from_numpy(rows).to(torch.float16).numpy()
    assert np.array_equal(encode16(rows, "float16"), want_fp16, equal_nan=True)
    for dtype in ("float16", "bfloat16"):  # reading back is exact
        back = decode16(encode16(rows, dtype), dtype)
        ref = torch.from_numpy(rows).to(getattr(torch, dtype)).float().numpy()
        assert np.array_equal(back, ref)


def test_bfloat16_keeps_nan_and_rounds_ties_to_even() -> None:
    assert np.isnan(from_bfloat16(to_bfloat16(np.array([np.nan], np.float32))))[0]
    one = np.float32(1.0).view(np.uint32)
    tie_down = np.array([one + 0x8000], np.uint32).view(np.float32)  # halfway, 1.0's last bit even: stays
    tie_up = np.array([one + 0x18000], np.uint32).view(np.float32)  # halfway, odd last bit: goes up
    assert from_bfloat16(to_bfloat16(tie_down))[0] == 1.0
    assert to_bfloat16(tie_up)[0] == (one >> 16) + 2


@settings(max_examples=60, deadline=None)
@given(rows=hnp.arrays(np.float32, st.tuples(st.integers(1, 8), st.integers(1, 16)),
                       elements=st.floats(-65504, 1e6, width=32)),
       seed=st.integers(0, 2**32), version=st.integers(0, 1000))
@example(rows=np.array([[-65504.0, 65504.0 * 254]], np.float32), seed=0, version=0)  # float16 edges
@example(rows=np.array([[3e-8, 3.1e-8, 0.0]], np.float32), seed=0, version=0)  # a subnormal scale
def test_int8_rows_are_within_one_step_and_the_same_for_the_same_id_and_version(
        rows: np.ndarray, seed: int, version: int) -> None:
    ids = np.arange(len(rows), dtype=np.int64) * 7 - 3
    versions = np.full(len(rows), version, np.int32)
    q, scale, offset = encode_int8(rows, ids, versions, seed)
    assert scale.dtype == offset.dtype == np.float16
    back = decode_int8(q, scale, offset)
    step = scale.astype(np.float32)[:, None] * np.float32(1.0001) + np.float32(1e-6) * np.abs(rows).max(
        axis=1, keepdims=True)
    assert (np.abs(back - rows) <= step).all()
    # The offset is the largest float16 at most the minimum, and the levels reach the maximum.
    low, high = rows.min(axis=1).astype(np.float64), rows.max(axis=1).astype(np.float64)
    assert (offset.astype(np.float64) <= low).all()
    with np.errstate(over="ignore"):  # the float16 after 65504 is inf
        assert (np.nextafter(offset, np.float16(np.inf)).astype(np.float64) > low).all()
    assert (offset.astype(np.float64) + 255 * scale.astype(np.float64) >= high).all()
    # Counter-based: the same (seed, id, version) rounds alike, whatever else is in the batch.
    again = encode_int8(rows[::-1], ids[::-1], versions, seed)[0][::-1]
    assert np.array_equal(q, again)


def test_int8_rounding_is_unbiased_over_versions() -> None:
    # Values between levels round up or down at random; over 4,000 pushes their mean is the value.
    row = np.array([[0.0, 0.305, 1.7025, 2.55]], np.float32)  # scale 0.01: 0.305 and 1.7025 between levels
    decoded = [decode_int8(*encode_int8(row, np.array([5], np.int64), np.array([v]), seed=1))[0]
               for v in range(4000)]
    assert np.allclose(np.mean(decoded, axis=0), row[0], atol=0.0008)
    assert len({tuple(d) for d in decoded}) > 1  # it does draw: not round-to-nearest


def test_int8_refuses_non_finite_rows_and_rows_beyond_float16_naming_the_id() -> None:
    rows = np.array([[1.0, 2.0], [np.inf, 0.0]], np.float32)
    with pytest.raises(ValueError, match="row of id 42 holds a NaN, an infinity"):
        encode_int8(rows, np.array([7, 42], np.int64), np.zeros(2, np.int32), 0)
    # A minimum below -65504 (the offset's float16) or a range past 255 x 65504 (the scale's).
    edges = np.array([[-65504.0, 0.0], [-65520.0, 0.0], [0.0, 65504.0 * 255], [0.0, 65520.0 * 256]],
                     np.float32)
    assert representable(edges).tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match="row of id 1 holds"):
        encode_int8(edges, np.arange(4, dtype=np.int64), np.zeros(4, np.int32), 0)


def test_a_narrow_row_takes_a_quarter_or_half_of_float32s_bytes() -> None:
    sizes = [stored_bytes_per_row(d, 64) for d in ("float32", "float16", "bfloat16", "int8")]
    assert sizes == [256, 128, 128, 68]  # int8: 64 bytes, a float16 scale and offset
    with pytest.raises(ValueError, match="row_dtype: got 'int4'"):
        encode16(np.zeros((1, 1), np.float32), "int4")
