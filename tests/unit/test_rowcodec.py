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
                       elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       seed=st.integers(0, 2**32), version=st.integers(0, 1000))
# A top level past float32's maximum (the scale rounded up) decoded to inf: hypothesis found it.
@example(rows=np.array([[1.0141205e31, 3.4028233e38]], np.float32), seed=0, version=0)
def test_int8_rows_are_within_one_step_and_the_same_for_the_same_id_and_version(
        rows: np.ndarray, seed: int, version: int) -> None:
    ids = np.arange(len(rows), dtype=np.int64) * 7 - 3
    versions = np.full(len(rows), version, np.int32)
    q, scale, offset = encode_int8(rows, ids, versions, seed)
    back = decode_int8(q, scale, offset)
    step = scale[:, None] * np.float32(1.0001) + np.float32(1e-6) * np.abs(rows).max(axis=1, keepdims=True)
    assert (np.abs(back - rows) <= step).all()
    assert (offset == rows.min(axis=1)).all()
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


def test_int8_refuses_non_finite_rows_naming_the_id() -> None:
    rows = np.array([[1.0, 2.0], [np.inf, 0.0]], np.float32)
    with pytest.raises(ValueError, match="row of id 42 holds a NaN or an infinity"):
        encode_int8(rows, np.array([7, 42], np.int64), np.zeros(2, np.int32), 0)


def test_a_narrow_row_takes_a_quarter_or_half_of_float32s_bytes() -> None:
    sizes = [stored_bytes_per_row(d, 64) for d in ("float32", "float16", "bfloat16", "int8")]
    assert sizes == [256, 128, 128, 72]
    with pytest.raises(ValueError, match="row_dtype: got 'int4'"):
        encode16(np.zeros((1, 1), np.float32), "int4")
