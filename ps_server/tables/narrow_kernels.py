"""Compiled pushes of narrow rows (`row_dtype` float16, bfloat16 or int8, issue 22) for sgd and adagrad.

A narrow push went through numpy in passes over gathered copies: gather the stored bytes, decode them to
float32, update, encode (int8's draws are a dozen uint64 array operations), scatter back, then write touch
and count, each pass over temporaries the size of the request. These loops do each row once: decode it to
float32, apply the update, round it back and store it, with the rows ahead prefetched as in
ps_server.tables.kernels.

Bit for bit what the numpy path computes (ps_server.tables.rowcodec, common.wire.sparse_codec.decode_rows,
row_optim.apply), with the same float operations in the same order and precision (no fastmath):

- float16: numpy's float32 -> half conversion spelled out on the bits (round to nearest, ties to even,
  overflow to inf; npy_floatbits_to_halfbits) and its exact inverse; bfloat16: rowcodec.to_bfloat16's.
- int8: the row's min and max, its float16 offset rounded down and scale rounded up (on the half bits,
  as numpy's astype and nextafter), floor(steps + u) in float64 with the same counter-based draws of
  (seed, id, version, column): rowcodec.encode_int8's unbiased rounding.

An int8 row cannot hold a NaN, an infinity or a row beyond its float16 pair, and such a push must be
refused with nothing changed, so `push_int8` updates into scratch rows first and writes none if one
cannot be held (two loops, one call).
tests/unit/test_narrow_kernels.py checks every dtype and optimizer against the numpy path on random pushes.
"""

from __future__ import annotations

import itertools

import numpy as np
from numba import uint64
from pshard.ps_server.tables.kernels import AHEAD, _jit, _mix64, _prefetch, _prefetch_row, touches

_GOLDEN = uint64(0x9E3779B97F4A7C15)
_UNIT = np.float32(2.0**-24)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_LEVELS = 255


@_jit
def _half_to_bits(h):  # type: ignore[no-untyped-def]
    """The float32 bits of half `h` (uint32 holding 16 bits), exactly (npy_halfbits_to_floatbits)."""
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = h & np.uint32(0x7C00)
    sig = h & np.uint32(0x03FF)
    if exp == 0:
        if sig == 0:
            return sign
        # subnormal: shift the significand up until its leading bit reaches the implicit one
        e = np.uint32(113)  # 127 - 15 + 1
        while (sig & np.uint32(0x0400)) == 0:
            sig <<= np.uint32(1)
            e -= np.uint32(1)
        return sign | (e << np.uint32(23)) | ((sig & np.uint32(0x03FF)) << np.uint32(13))
    if exp == np.uint32(0x7C00):
        return sign | np.uint32(0x7F800000) | (sig << np.uint32(13))
    return sign | (((exp >> np.uint32(10)) + np.uint32(112)) << np.uint32(23)) | (sig << np.uint32(13))


@_jit
def _bits_to_half(f):  # type: ignore[no-untyped-def]
    """Half bits (uint32) of float32 bits `f`: round to nearest, ties to even; overflow to inf; NaN stays
    NaN (numpy's npy_floatbits_to_halfbits, which its astype(float16) computes)."""
    sign = (f & np.uint32(0x80000000)) >> np.uint32(16)
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):
        if f_exp == np.uint32(0x7F800000):
            f_sig = f & np.uint32(0x007FFFFF)
            if f_sig != 0:
                ret = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
                if ret == np.uint32(0x7C00):
                    ret += np.uint32(1)
                return sign + ret
        return sign + np.uint32(0x7C00)
    if f_exp <= np.uint32(0x38000000):
        if f_exp < np.uint32(0x33000000):
            return sign
        e = f_exp >> np.uint32(23)
        f_sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        f_sig >>= np.uint32(113) - e
        if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            f_sig += np.uint32(0x1000)
        return sign + (f_sig >> np.uint32(13))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    f_sig = f & np.uint32(0x007FFFFF)
    if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        f_sig += np.uint32(0x1000)
    return sign + (h_exp + (f_sig >> np.uint32(13)))


@_jit
def _bits_to_bfloat16(f):  # type: ignore[no-untyped-def]
    """rowcodec.to_bfloat16 of float32 bits `f`: round to nearest, ties to even; NaN a quiet NaN."""
    if (f & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (f & np.uint32(0x007FFFFF)) != 0:
        return (f >> np.uint32(16)) | np.uint32(0x40)
    return (f + (np.uint32(0x7FFF) + ((f >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)


@_jit
def _update(row, acc, r, grads, i, lr, eps, adagrad):  # type: ignore[no-untyped-def]
    """row_optim.apply's sgd or adagrad of float32 `row` (dim,) with grads[i], as kernels.push_touch;
    adagrad's new sums go to acc[r]."""
    dim = len(row)
    if adagrad:
        for j in range(dim):
            g = grads[i, j]
            a = acc[r, j] + g * g
            acc[r, j] = a
            std = np.sqrt(a) + eps
            row[j] -= (g / std) * lr
    else:
        for j in range(dim):
            row[j] -= grads[i, j] * lr


@_jit
def push16(values, acc, touch, count, rows, grads, lr, eps, now, bfloat):  # type: ignore[no-untyped-def]
    """A push of float16 (bfloat False) or bfloat16 rows, `values` their uint16 bits (cap, dim), in place:
    decoded, updated as kernels.push_touch (float32), rounded back; touch[rows] = now, count[rows] += 1.
    `rows` distinct; sgd passes an `acc` of no rows."""
    dim, n = values.shape[1], len(rows)
    adagrad = acc.shape[0] > 0
    row = np.empty(dim, np.float32)
    bits = row.view(np.uint32)
    for i in range(n):
        if i + AHEAD < n:
            ahead = rows[i + AHEAD]
            _prefetch_row(values, ahead)
            if adagrad:
                _prefetch_row(acc, ahead)
            _prefetch(touch, ahead)
            _prefetch(count, ahead)
        r = rows[i]
        if bfloat:  # the flag outside the loops over the row, so that each one compiles on its own
            for j in range(dim):
                bits[j] = np.uint32(values[r, j]) << np.uint32(16)
        else:
            for j in range(dim):
                bits[j] = _half_to_bits(np.uint32(values[r, j]))
        _update(row, acc, r, grads, i, lr, eps, adagrad)
        if bfloat:
            for j in range(dim):
                values[r, j] = np.uint16(_bits_to_bfloat16(bits[j]))
        else:
            for j in range(dim):
                values[r, j] = np.uint16(_bits_to_half(bits[j]))
        touch[r] = now
        count[r] += 1


@_jit
def _read_half(values, r, at):  # type: ignore[no-untyped-def]
    """The float16 bits (uint32) at byte `at` of row r, little-endian."""
    return np.uint32(values[r, at]) | (np.uint32(values[r, at + 1]) << np.uint32(8))


@_jit
def _write_half(values, r, at, h):  # type: ignore[no-untyped-def]
    values[r, at] = np.uint8(h & np.uint32(0xFF))
    values[r, at + 1] = np.uint8(h >> np.uint32(8))


@_jit
def _half_value(h, cell, bits):  # type: ignore[no-untyped-def]
    """float16 bits `h` as a float32, exactly (through `bits`, a uint32 view of the float32 `cell`)."""
    bits[0] = _half_to_bits(h)
    return cell[0]


@_jit
def _half_up(h):  # type: ignore[no-untyped-def]
    """The float16 just above finite `h` (np.nextafter towards +inf): from either zero the least one."""
    if h == np.uint32(0) or h == np.uint32(0x8000):
        return np.uint32(1)
    return h - np.uint32(1) if h & np.uint32(0x8000) else h + np.uint32(1)


@_jit
def _half_down(h):  # type: ignore[no-untyped-def]
    """The float16 just below `h` (np.nextafter towards -inf): from either zero minus the least one."""
    if h == np.uint32(0) or h == np.uint32(0x8000):
        return np.uint32(0x8001)
    return h + np.uint32(1) if h & np.uint32(0x8000) else h - np.uint32(1)


@_jit
def _offset_and_scale(low, high, cell, bits):  # type: ignore[no-untyped-def]
    """float16 bits of rowcodec._offset_and_scale's offset (low rounded down) and scale ((high - offset)
    / 255 rounded up, through float32 first as numpy's astype chain), for float32 `low` and `high`, and
    the offset's value."""
    cell[0] = low
    offset = _bits_to_half(bits[0])
    at = _half_value(offset, cell, bits)
    if at > low:
        offset = _half_down(offset)
        at = _half_value(offset, cell, bits)
    exact = (np.float64(high) - np.float64(at)) / _LEVELS
    cell[0] = np.float32(exact)
    scale = _bits_to_half(bits[0])
    if np.float64(_half_value(scale, cell, bits)) < exact:
        scale = _half_up(scale)
    return offset, scale


@_jit
def _holdable(offset, scale):  # type: ignore[no-untyped-def]
    """Whether both halves are finite (rowcodec.representable)."""
    inf = np.uint32(0x7C00)
    return (offset & inf) != inf and (scale & inf) != inf


@_jit
def push_int8(values, acc, touch, count, rows, row_ids, grads, lr, eps, now, key,  # type: ignore[no-untyped-def]
              scratch, sums):
    """A push of int8 rows, `values` their bytes (cap, dim + 4: q, then float16 scale and offset): each
    row decoded (float64, exact, rounded once to float32), updated as kernels.push_touch into
    scratch[i] (adagrad's sums into sums[i]); if a row cannot be held (rowcodec.representable), returns
    its index i and changes nothing; else encodes every row as rowcodec.encode_int8 with the draws of
    (key = mix64(seed), id, version = count + 1), writes rows, sums, touch and count, and returns -1."""
    n, dim = len(rows), scratch.shape[1]
    adagrad = acc.shape[0] > 0
    cell = np.empty(1, np.float32)
    bits = cell.view(np.uint32)
    halves = np.empty((n, 2), np.uint32)  # each row's float16 offset and scale, from the first loop
    for i in range(n):
        if i + AHEAD < n:
            ahead = rows[i + AHEAD]
            _prefetch_row(values, ahead)
            if adagrad:
                _prefetch_row(acc, ahead)
        r = rows[i]
        scale = np.float64(_half_value(_read_half(values, r, dim), cell, bits))
        offset = np.float64(_half_value(_read_half(values, r, dim + 2), cell, bits))
        for j in range(dim):
            exact = offset + scale * np.float64(values[r, j])
            scratch[i, j] = np.float32(min(max(exact, -_FLOAT32_MAX), _FLOAT32_MAX))
        if adagrad:
            for j in range(dim):
                g = grads[i, j]
                a = acc[r, j] + g * g
                sums[i, j] = a
                std = np.sqrt(a) + eps
                scratch[i, j] -= (g / std) * lr
        else:
            for j in range(dim):
                scratch[i, j] -= grads[i, j] * lr
        low = scratch[i, 0] if dim else np.float32(0)
        high = low
        for j in range(dim):
            x = scratch[i, j]
            if not np.isfinite(x):
                return i
            low = min(low, x)
            high = max(high, x)
        half_offset, half_scale = _offset_and_scale(low, high, cell, bits)
        if not _holdable(half_offset, half_scale):
            return i
        halves[i, 0], halves[i, 1] = half_offset, half_scale
    for i in range(n):
        if i + AHEAD < n:
            ahead = rows[i + AHEAD]
            _prefetch(row_ids, ahead)
            _prefetch(touch, ahead)
            _prefetch(count, ahead)
        r = rows[i]
        version = count[r] + 1
        half_offset, half_scale = halves[i, 0], halves[i, 1]
        offset = np.float64(_half_value(half_offset, cell, bits))
        scale = np.float64(_half_value(half_scale, cell, bits))
        safe = scale if scale > 0 else 1.0
        base = _mix64(uint64(row_ids[r]) ^ key) + uint64(version) * _GOLDEN
        h = _mix64(base)
        for j in range(dim):
            u = np.float32(_mix64(h + uint64(j)) >> uint64(40)) * _UNIT
            q = np.floor((np.float64(scratch[i, j]) - offset) / safe + np.float64(u))
            values[r, j] = np.uint8(min(max(q, 0.0), 255.0))
        _write_half(values, r, dim, half_scale)
        _write_half(values, r, dim + 2, half_offset)
        if adagrad:
            for j in range(dim):
                acc[r, j] = sums[i, j]
        touch[r] = now
        count[r] = version
    return -1


_warmed: set[str] = set()


def warm(row_dtype: str) -> None:
    """Compile (or load from numba's cache) the push of `row_dtype` rows, once per process: the types a
    table passes (gradients writable or read-only views of gRPC's bytes; adagrad's sums or none)."""
    if row_dtype in _warmed:
        return
    rows, ids = np.zeros(1, np.int64), np.array([7], np.int64)
    count = np.zeros(1, np.int32)
    one, key = np.float32(1), np.uint64(1)
    grads = np.zeros((1, 2), np.float32)
    frozen = grads.copy()
    frozen.flags.writeable = False
    for touch, g, sums in itertools.product(touches(), (grads, frozen),
                                            (np.zeros((1, 2), np.float32), np.zeros((0, 2), np.float32))):
        if row_dtype == "int8":
            push_int8(np.zeros((1, 6), np.uint8), sums, touch, count, rows, ids, g, one, one, 0.0, key,
                      np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32))
        else:
            push16(np.zeros((1, 2), np.uint16), sums, touch, count, rows, g, one, one, 0.0,
                   row_dtype == "bfloat16")
    _warmed.add(row_dtype)


if __name__ == "__main__":  # compile into numba's cache ahead of time (docker/Dockerfile.server)
    for _row_dtype in ("float16", "bfloat16", "int8"):
        warm(_row_dtype)
