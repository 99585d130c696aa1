"""8- and 16-bit rows: how float32 rows are rounded into a narrower stored form and read back (issue 22).

A table with a narrow `row_dtype` (TableConfig) applies each push in float32 to its decoded rows and
`encode_rows` them once (SparseTable); the stored bytes are what pulls send, replicas copy and
checkpoints save, and common/wire/sparse_codec.decode_rows reads them back.

- float16: IEEE half, numpy's conversion (round to nearest, ties to even; overflow to inf).
- bfloat16: the top 16 bits of the float32, rounded to nearest, ties to even (as torch's conversion);
  stored as uint16, numpy having no bfloat16. NaN stays NaN.
- int8 (row-wise, as FBGEMM's fused 8-bit rows and Monolith's fixed_r8): each row keeps a float16
  `scale` and `offset`, a value is `offset + scale * q` with q in 0..255 stored as uint8. The offset is
  the row's minimum rounded down to a float16 and the scale (max - offset) / 255 rounded up, so the 255
  levels cover every value of the row (a scale below float16's least, 2**-24, is that least). The
  rounding is stochastic and unbiased (E[decode] = the value): q is floor(x + u) with u uniform in
  [0, 1) drawn from a counter-based hash of (seed, id, version, column), not from a generator's state,
  so a backup, a restart or another batch order rounds a row's push the same way: `version` is the
  row's update count. float16 halves the 8 bytes a float32 pair took (a tenth of a 64-value row's RSS),
  and bounds what a row may hold: a minimum below -65504, or a range past 255 x 65504, is refused as a
  NaN is (`representable`).

Layout 1 (before issue 22's float16 pair: a float32 scale and offset, dim + 8 bytes) is read by
`upgrade_int8`, which re-rounds such rows into this layout (a restore of an older checkpoint).
"""

from __future__ import annotations

import numpy as np
from pshard.common.sparse import ROW_DTYPES, TableConfig, mix64

__all__ = ["ROW_DTYPES", "decode16", "decode_int8", "encode16", "encode_int8", "encode_rows", "representable",
           "upgrade_int8"]
_LEVELS = 255
_UNIT = float(2**-24)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
INT8_TAIL_BYTES = 4  # a float16 scale and offset
INT8_TAIL_BYTES_V1 = 8  # layout 1: a float32 scale and offset


def stored_bytes_per_row(row_dtype: str, dim: int) -> int:
    """Bytes a row of `dim` values takes in `row_dtype` (int8: with its scale and offset)."""
    return {"float32": 4 * dim, "float16": 2 * dim, "bfloat16": 2 * dim,
            "int8": dim + INT8_TAIL_BYTES}[row_dtype]


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest, ties to even; NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(x)
    return np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _uniform(seed: int, ids: np.ndarray, versions: np.ndarray, dim: int) -> np.ndarray:
    """(len(ids), dim) float32 in [0, 1): a pure function of (seed, id, version, column)."""
    key = mix64(np.array([seed], np.uint64))[0]
    with np.errstate(over="ignore"):
        base = mix64(ids.astype(np.int64).view(np.uint64) ^ key) + versions.astype(np.uint64) * np.uint64(
            0x9E3779B97F4A7C15)
        words = mix64(mix64(base)[:, None] + np.arange(dim, dtype=np.uint64)[None, :])
    return ((words >> np.uint64(40)).astype(np.float32) * np.float32(_UNIT)).astype(np.float32)


def _offset_and_scale(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's float16 offset (its minimum rounded down) and scale ((max - offset) / 255 rounded up):
    -inf or inf where the row cannot be held (narrow_kernels.push_int8 computes the same bits)."""
    low = rows.min(axis=1) if rows.shape[1] else np.zeros(len(rows), np.float32)
    high = rows.max(axis=1) if rows.shape[1] else np.zeros(len(rows), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        offset = low.astype(np.float16)
        offset = np.where(offset.astype(np.float32) > low, np.nextafter(offset, np.float16(-np.inf)), offset)
        # In float64: exact for any float16 offset and float32 maximum. Rounded to float32 first (as the
        # compiled pass does), then to float16 and up where short: that is the float16 ceiling still.
        exact = (high.astype(np.float64) - offset.astype(np.float64)) / _LEVELS
        scale = exact.astype(np.float32).astype(np.float16)
        scale = np.where(scale.astype(np.float64) < exact, np.nextafter(scale, np.float16(np.inf)), scale)
    return offset.astype(np.float16), scale.astype(np.float16)


def representable(rows: np.ndarray) -> np.ndarray:
    """Which float32 rows (n, dim) an int8 row can hold: finite, minimum at least -65504 and range at
    most 255 x 65504 (float16's largest, the scale's and the offset's)."""
    rows = np.asarray(rows, np.float32)
    finite = np.isfinite(rows).all(axis=1)
    offset, scale = _offset_and_scale(np.where(finite[:, None], rows, np.float32(0)))
    return finite & np.isfinite(offset) & np.isfinite(scale)


def encode_int8(rows: np.ndarray, ids: np.ndarray, versions: np.ndarray, seed: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows (n, dim) -> (q uint8 (n, dim), scale float16 (n,), offset float16 (n,)),
    rounded stochastically with the counter-based draws of (seed, id, version). ValueError naming the
    first id whose row an int8 row cannot hold (`representable`: a NaN, an infinity, or beyond float16)."""
    rows = np.asarray(rows, np.float32)
    ok = representable(rows)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"int8 rows: row of id {int(ids[bad])} holds a NaN, an infinity, or a value below "
                         "-65504 or a range past 255 x 65504 (float16 scale and offset)")
    offset, scale = _offset_and_scale(rows)
    safe = np.where(scale > 0, scale, np.float16(1)).astype(np.float64)
    steps = (rows.astype(np.float64) - offset.astype(np.float64)[:, None]) / safe[:, None]
    q = np.floor(steps + _uniform(seed, ids, versions, rows.shape[1]))
    return np.clip(q, 0, _LEVELS).astype(np.uint8), scale, offset


def decode_int8(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The float32 rows an int8 encoding stands for: offset + scale * q, exact in float64, rounded once.
    Clipped to float32's range: layout 1's float32 scale, rounded up, could take a top level past it."""
    exact = offset[:, None].astype(np.float64) + scale[:, None].astype(np.float64) * q
    return np.clip(exact, -_FLOAT32_MAX, _FLOAT32_MAX).astype(np.float32)


def upgrade_int8(config: TableConfig, stored: np.ndarray, ids: np.ndarray, versions: np.ndarray
                 ) -> np.ndarray:
    """int8 rows in layout 1 (uint8 (n, dim + 8): q, then a float32 scale and offset, as saved before the
    float16 pair) in this layout: decoded, then rounded as a push of update count `versions` rounds
    them. ValueError if a row is beyond what a float16 pair holds (an older row could hold any float32)."""
    dim = config.dim
    raw = np.ascontiguousarray(stored, np.uint8)
    tail = np.ascontiguousarray(raw[:, dim:]).view("<f4")
    return encode_rows(config, decode_int8(raw[:, :dim], tail[:, 0], tail[:, 1]), ids, versions)


def encode16(rows: np.ndarray, row_dtype: str) -> np.ndarray:
    """float32 rows -> float16 values or bfloat16 bits, rounded to nearest even."""
    if row_dtype == "float16":
        with np.errstate(over="ignore"):  # beyond 65504: inf, as torch's conversion
            return np.asarray(rows, np.float32).astype(np.float16)
    if row_dtype == "bfloat16":
        return to_bfloat16(np.asarray(rows, np.float32))
    raise ValueError(f"row_dtype: got {row_dtype!r}, expected float16 or bfloat16")


def decode16(stored: np.ndarray, row_dtype: str) -> np.ndarray:
    """The float32 rows of `encode16`'s output, exactly."""
    if row_dtype == "float16":
        return stored.astype(np.float32)
    if row_dtype == "bfloat16":
        return from_bfloat16(stored)
    raise ValueError(f"row_dtype: got {row_dtype!r}, expected float16 or bfloat16")


def encode_rows(config: TableConfig, rows: np.ndarray, ids: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """float32 rows (n, dim) -> their stored form, uint8 (n, config.row_bytes) (TableConfig.row_layout):
    float16 or bfloat16 little-endian, or int8's bytes then its float16 scale and offset. `versions`:
    each row's update count, int8's draws. ValueError if an int8 row cannot hold a row (`representable`)."""
    n, dim = len(rows), config.dim
    out = np.empty((n, config.row_bytes), np.uint8)
    if config.row_dtype in ("float16", "bfloat16"):
        out.view("<u2")[:] = encode16(rows, config.row_dtype).view(np.uint16)
        return out
    q, scale, offset = encode_int8(rows, ids, versions, config.seed)
    out[:, :dim] = q
    tail = np.stack([scale, offset], axis=1).astype("<f2")
    out[:, dim:] = tail.view(np.uint8)
    return out
