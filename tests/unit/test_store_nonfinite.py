"""The store's non-finite gradient check (issue 10, point 7) at its edges: finite values whose sum
overflows are not refused, float16 gradients are checked, and the first bad index is the flat order's."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.store import ShardStore

W = SliceKey("w", 0)


def store(dtype: str = "float32", nonfinite: str = "reject") -> ShardStore:
    s = ShardStore(JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1e-40),
                             nonfinite=nonfinite), quorum={"w0": 0})
    s.declare([(W, np.zeros((2, 3), dtype=dtype))])
    return s


@pytest.mark.filterwarnings("error")  # and quietly: no RuntimeWarning from the check's own sum
def test_finite_values_whose_sum_overflows_are_applied() -> None:
    s = store()
    big = np.full((2, 3), 3e38, np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.sum())  # the fast path says "maybe", the exact check clears it
    assert s.push(Stamp("w0", 0, 0), {W: big}).applied == 1


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_first_bad_index_is_named_in_every_dtype(dtype: str) -> None:
    s = store(dtype)
    grad = np.zeros((2, 3), dtype=dtype)
    grad[1, 0], grad[1, 2] = np.inf, np.nan
    with pytest.raises(InvalidArgumentError, match=r"key 'w.*index \(1, 0\) \(2 non-finite values\)"):
        s.push(Stamp("w0", 0, 0), {W: grad})
    assert s.stats().pushes_applied == 0 and s.stats().worker_clocks == {}


def test_float16_near_its_limit_is_finite() -> None:
    # 6 x 60000 overflows a float16 sum, not the float32 one the check uses.
    s = store("float16")
    assert s.push(Stamp("w0", 0, 0), {W: np.full((2, 3), 60000, np.float16)}).applied == 1
