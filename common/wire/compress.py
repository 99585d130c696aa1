"""Gradient compressors: pack a float32 slice for the wire, and unpack it back to float32.

Each lossy compressor packs a slice into bytes that travel as a uint8 tensor tagged with its
encoding (proto/pshard/api/v1/tensor.proto, Encoding); the casts (fp16, bf16) are plain dtypes and go
through the codec's `cast`. The formats, little-endian:

- topk: the k largest magnitudes, as k uint32 indices (strictly increasing) then their k float32 values;
- randomk: k float32 values at indices drawn from a seed that worker and server both derive from the
  (slice, clock), so no index travels;
- sign: one float32 scale, the mean magnitude, then one bit per element (1: +scale, 0: -scale).

A payload's size is fixed by its encoding and the slice's element count (k from the size for the
sparsifiers), so a server checks a request's whole header before reading any gradient
(`check_payload`). A server unpacks into float32 and aggregates there: sync mode's union-batch rule
then holds for what was sent.

Pure: numpy only.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
from pshard.common.compression import CASTS, Compressor, payload_k
from pshard.common.errors import InvalidArgumentError
from pshard.common.types import SliceKey
from pshard.common.wire.codec import WireArray, cast

ENCODINGS = ("topk", "randomk", "sign")
_INDEX = np.dtype("<u4")
_VALUE = np.dtype("<f4")


def slice_seed(key: SliceKey, clock: int) -> np.random.Generator:
    """The random-k generator of one (slice, clock): the same on every worker and server, and a new
    draw each clock, so every element is sent now and then. crc32, not hash(): Python salts str hashes
    per process."""
    return np.random.default_rng([zlib.crc32(key.key.encode()), key.part, clock])


def random_indices(key: SliceKey, clock: int, numel: int, k: int) -> np.ndarray:
    """The k distinct indices random-k sends of a slice at a clock, in increasing order."""
    chosen = slice_seed(key, clock).choice(numel, size=k, replace=False)
    chosen.sort()
    return chosen


def encode(compressor: Compressor, values: np.ndarray, key: SliceKey, clock: int) -> WireArray:
    """`values` (a float32 slice, flat) packed by `compressor`: a cast's array in its dtype, or a
    sparsifier's or sign's bytes tagged with the encoding."""
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    if compressor.name == "none":
        return WireArray(values, "float32")
    if compressor.name in CASTS:
        return cast(WireArray(values, "float32"), compressor.wire_dtype)
    if compressor.name == "topk":
        return _packed(_topk(values, compressor.k(values.size)), "topk")
    if compressor.name == "randomk":
        chosen = random_indices(key, clock, values.size, compressor.k(values.size))
        return _packed([values[chosen].astype(_VALUE)], "randomk")
    return _packed(_sign(values), "sign")


def decode(wire: WireArray, numel: int, key: SliceKey, clock: int) -> np.ndarray:
    """The float32 slice (flat, `numel` elements) a packed `wire` stands for; the casts are widened.
    A payload that is not what its encoding says (size, indices out of range or repeated) is an
    InvalidArgumentError naming the slice."""
    what = f"slice {str(key)!r}"
    if not wire.encoding:
        return np.asarray(cast(wire, "float32").array, dtype=np.float32).reshape(-1)
    raw = np.asarray(wire.array).reshape(-1).view(np.uint8)
    k = payload_k(wire.encoding, numel, raw.nbytes, what)
    if wire.encoding == "sign":
        scale_bits = raw[:_VALUE.itemsize].view("<u4")[0]
        # -scale is scale with its sign bit flipped (IEEE negation): a 0 bit flips it. Integer work on the
        # bits gives the lookup by bit's float32 values, 7x faster per 4 MiB slice (0.23 ms against 1.6).
        out_bits = np.unpackbits(raw[_VALUE.itemsize:], count=numel, bitorder="little").astype("<u4")
        out_bits ^= 1
        out_bits <<= 31
        out_bits ^= scale_bits
        return out_bits.view(np.float32)
    out = np.zeros(numel, dtype=np.float32)
    if wire.encoding == "topk":
        indices = raw[:k * _INDEX.itemsize].view(_INDEX)
        if indices[-1] >= numel or (k > 1 and not np.all(indices[1:] > indices[:-1])):
            raise InvalidArgumentError(f"{what}: topk indices must be increasing and below {numel}")
        out[indices] = raw[k * _INDEX.itemsize:].view(_VALUE)
    else:
        out[random_indices(key, clock, numel, k)] = raw.view(_VALUE)
    return out


def subtract_sent(acc: np.ndarray, wire: WireArray, key: SliceKey, clock: int) -> None:
    """acc -= decode(wire), in place (`acc`: the float32 slice `wire` was packed from). The sparsifiers touch
    only the elements they sent, bit for bit what the full subtraction gives (x - 0 is x, -0.0 too),
    without unpacking a slice of zeros: error feedback's bookkeeping was most of top-k's time a step."""
    if wire.encoding in ("topk", "randomk"):
        raw = np.asarray(wire.array).reshape(-1).view(np.uint8)
        k = payload_k(wire.encoding, acc.size, raw.nbytes, f"slice {str(key)!r}")
        if wire.encoding == "topk":
            indices, values = raw[:k * _INDEX.itemsize].view(_INDEX), raw[k * _INDEX.itemsize:].view(_VALUE)
        else:
            indices, values = random_indices(key, clock, acc.size, k), raw.view(_VALUE)
        acc[indices] -= values
        return
    acc -= decode(wire, acc.size, key, clock)


def add_sent(acc: np.ndarray, wire: WireArray, key: SliceKey, clock: int) -> None:
    """acc += decode(wire), in place: how a compressed pull's change lands on the worker's copy of a slice
    and on the server's copy of that copy, the same float32 additions in the same order on both. Top-k
    touches only the elements it sent (x + 0 is x)."""
    if wire.encoding == "topk":
        raw = np.asarray(wire.array).reshape(-1).view(np.uint8)
        k = payload_k("topk", acc.size, raw.nbytes, f"slice {str(key)!r}")
        indices = raw[:k * _INDEX.itemsize].view(_INDEX)
        if k and (indices[-1] >= acc.size or (k > 1 and not np.all(indices[1:] > indices[:-1]))):
            raise InvalidArgumentError(f"slice {str(key)!r}: topk indices must be increasing and below "
                                       f"{acc.size}")
        acc[indices] += raw[k * _INDEX.itemsize:].view(_VALUE)
        return
    acc += decode(wire, acc.size, key, clock)


def pack_topk(values: np.ndarray, k: int) -> WireArray:
    """The k largest magnitudes of a float32 slice, packed as top-k (a count, where `encode` takes a
    fraction: a compressed pull names its k)."""
    return _packed(_topk(np.asarray(values, dtype=np.float32).reshape(-1), k), "topk")


def pack_sign(values: np.ndarray) -> WireArray:
    """A float32 slice packed as scaled sign."""
    return _packed(_sign(np.asarray(values, dtype=np.float32).reshape(-1)), "sign")


def packed_nbytes(encoding: str, numel: int, k: int) -> int:
    """The size of a top-k payload of k elements, or of a sign payload, for a slice of `numel`."""
    if encoding == "topk":
        return (_INDEX.itemsize + _VALUE.itemsize) * k
    return _VALUE.itemsize + -(-numel // 8)


def _packed(parts: list[np.ndarray], encoding: str) -> WireArray:
    return WireArray(np.concatenate([p.reshape(-1).view(np.uint8) for p in parts]), "uint8", encoding)


def _topk(values: np.ndarray, k: int) -> list[np.ndarray]:
    chosen = topk_indices(values, k)
    return [chosen.astype(_INDEX), values[chosen].astype(_VALUE)]


def topk_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest magnitudes of `values`, increasing (NaN counts as the largest, as in
    numpy's partition).

    argpartition over the whole slice is what top-k cost (1.56 s per 100 MB on one loaded core: more
    than a 1 Gbit/s link saves). A threshold from a sample of magnitudes, about twice as selective as
    k, keeps a few k candidates in one comparison pass; the partition then runs over them alone. The
    result is the same set (ties aside): every element above the k-th largest is a candidate, and a
    threshold that leaves fewer than k falls back to the whole slice."""
    n = values.size
    if k >= n:
        return np.arange(n)
    magnitudes = np.abs(values)
    if n >= 4 * _SAMPLE and 4 * k <= n:
        sample = magnitudes[_sample_positions(n)]
        above = min(_SAMPLE - 1, 2 * -(-k * _SAMPLE // n) + 16)  # twice k's share of the sample, and some
        # Zeros out of the partition: numpy's introselect slows down tenfold on a sample of ties.
        positive = sample[~(sample <= 0)]
        threshold = np.partition(positive, positive.size - above)[positive.size - above] \
            if positive.size > above else 0
        if threshold == 0:
            # Mostly zeros (a compressed pull's change after sparse pushes): a threshold of 0 would keep
            # every element as a candidate. The nonzero ones are the candidates, padded with zeros (ties).
            candidates = np.flatnonzero(~(magnitudes <= 0))
            if candidates.size <= k:
                # The first k + c elements hold at least k zeros when only c are nonzero.
                zeros = np.flatnonzero(magnitudes[:k + candidates.size] == 0)[:k - candidates.size]
                chosen = np.concatenate([candidates, zeros])
                chosen.sort()
                return chosen
        else:
            # ~(m < t), not m >= t: a NaN is a candidate, as the partition would rank it.
            candidates = np.flatnonzero(~(magnitudes < threshold))
        if candidates.size >= k:
            picked = np.argpartition(magnitudes[candidates], candidates.size - k)[candidates.size - k:]
            chosen = candidates[picked]
            chosen.sort()
            return chosen
    chosen = np.argpartition(magnitudes, n - k)[n - k:]
    chosen.sort()
    return chosen


# Magnitudes sampled to set top-k's threshold. At k = 1 % of a slice, twice k's share is 1,328 of them: a
# threshold that leaves fewer than k elements is some 25 standard deviations away (the fallback covers it).
_SAMPLE = 1 << 16


@functools.lru_cache(maxsize=8)
def _sample_positions(n: int) -> np.ndarray:
    """Fixed positions per slice size (the result does not depend on them, only the time it takes)."""
    positions = np.random.default_rng(n).integers(0, n, _SAMPLE)
    positions.flags.writeable = False
    return positions


def _sign(values: np.ndarray) -> list[np.ndarray]:
    # The mean magnitude keeps the slice's L1 norm: sign-SGD's step size without a learning-rate change.
    scale = np.float32(np.abs(values).mean(dtype=np.float64)) if values.size else np.float32(0)
    bits = np.packbits(values >= 0, bitorder="little")
    return [np.array([scale], dtype=_VALUE), bits]
