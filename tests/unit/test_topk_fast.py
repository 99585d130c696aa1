"""Top-k's fast selection (compress.topk_indices, issue 19): a threshold from a sample of magnitudes,
then a partition of the candidates alone. It must choose what a partition of the whole slice chooses."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.compression import Compressor
from pshard.common.types import SliceKey
from pshard.common.wire import compress

N = 4 * compress._SAMPLE  # the smallest slice that takes the sampled path


def reference(values: np.ndarray, k: int) -> np.ndarray:
    chosen = np.argpartition(np.abs(values), values.size - k)[values.size - k:]
    chosen.sort()
    return chosen


def slices() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    heavy = rng.standard_cauchy(N).astype(np.float32)
    with_nan = rng.standard_normal(N, dtype=np.float32)
    with_nan[[3, 1000, N - 1]] = np.nan
    # A compressed pull's change after sparse pushes: 2 % nonzero, so the sample's threshold would be 0.
    sparse = np.where(rng.random(N) < 0.98, 0.0, rng.standard_normal(N)).astype(np.float32)
    sparse[[5, N - 2]] = np.nan
    return {"normal": rng.standard_normal(N, dtype=np.float32),
            "sparse-with-nan": sparse,
            "heavy-tailed": heavy,
            "mostly-zero": np.where(rng.random(N) < 0.995, 0.0, rng.standard_normal(N)).astype(np.float32),
            "with-nan": with_nan,
            "sorted": np.linspace(-1, 1, N, dtype=np.float32)}


@pytest.mark.parametrize("ratio", [1e-4, 0.01, 0.1, 0.25])
@pytest.mark.parametrize("name", list(slices()))
def test_the_sampled_threshold_picks_the_same_elements_as_a_partition_of_the_whole_slice(
        name: str, ratio: float) -> None:
    values = slices()[name]
    k = Compressor("topk", ratio).k(values.size)
    got = compress.topk_indices(values, k)
    want = reference(values, k)
    assert got.size == k and np.all(got[1:] > got[:-1])
    # The same magnitudes; ties at the k-th (zeros, linspace's mirror images) may go either way.
    np.testing.assert_array_equal(np.sort(np.abs(values[got])), np.sort(np.abs(values[want])))
    if name in ("normal", "heavy-tailed", "with-nan"):  # no ties: the very same elements
        np.testing.assert_array_equal(got, want)


def test_a_threshold_that_leaves_fewer_than_k_falls_back_to_the_whole_slice() -> None:
    values = np.zeros(N, np.float32)
    values[compress._sample_positions(N)] = 1.0  # every sampled magnitude is 1, few others are
    k = N // 4  # more than the ones: the sampled threshold (1.0) leaves too few candidates
    got = compress.topk_indices(values, k)
    assert got.size == k and np.all(values[got] == 1.0) is np.False_  # zeros fill up to k
    np.testing.assert_array_equal(np.sort(np.abs(values[got])), np.sort(np.abs(values[reference(values, k)])))


def test_packed_topk_bytes_are_those_of_the_partition() -> None:
    values = slices()["heavy-tailed"]
    wire = compress.encode(Compressor("topk", 0.01), values, SliceKey("w", 0), 0)
    k = Compressor("topk", 0.01).k(values.size)
    chosen = reference(values, k)
    want = np.concatenate([chosen.astype("<u4").view(np.uint8), values[chosen].astype("<f4").view(np.uint8)])
    np.testing.assert_array_equal(wire.array, want)
    unpacked = compress.decode(wire, values.size, SliceKey("w", 0), 0)
    np.testing.assert_array_equal(unpacked[chosen], values[chosen])


def test_sign_unpacks_to_plus_and_minus_the_scale_bit_for_bit() -> None:
    values = np.array([0.5, -2.0, 0.0, -0.0, 3.0, -1.0, 7.0, -0.25, 1.0], np.float32)
    wire = compress.encode(Compressor("sign"), values, SliceKey("w", 0), 0)
    scale = np.float32(np.abs(values).mean(dtype=np.float64))
    want = np.where(values >= 0, scale, -scale).astype(np.float32)
    got = compress.decode(wire, values.size, SliceKey("w", 0), 0)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
