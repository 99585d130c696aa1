"""The documented request limits (common.limits): each refusal names the field, the value and the limit."""

from __future__ import annotations

import time

import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.limits import DEFAULT_LIMITS, Limits


@pytest.mark.parametrize(("shape", "words"), [
    ([0, 2**62], ["(0, 4611686018427387904)", "2147483648"]),
    ([2**63 - 1] * 32, ["2147483648 elements"]),
    ([1] * 33, ["33 dimensions", "at most 32"]),
    ([1] * 65, ["65 dimensions"]),
    ([3, -1], ["negative dimension", "(3, -1)"]),
])
def test_shapes_past_the_limits_are_refused_naming_them(shape, words) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        DEFAULT_LIMITS.check_shape("slice 'w'", shape)

    assert "slice 'w'" in str(info.value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("shape", [[1] * 33, [3, -1], [2**62] * 2])
def test_a_shape_named_by_a_function_is_named_only_when_refused(shape) -> None:
    asked: list[str] = []

    def name() -> str:
        asked.append("slice 'w'")
        return asked[-1]

    assert DEFAULT_LIMITS.check_shape(name, [3, 4]) == 12
    assert asked == []  # the name of every pushed slice is not made on the way through
    with pytest.raises(InvalidArgumentError, match="slice 'w': shape"):
        DEFAULT_LIMITS.check_shape(name, shape)
    assert asked == ["slice 'w'"]


def test_element_counts_are_exact_within_the_limits() -> None:
    assert DEFAULT_LIMITS.check_shape("t", []) == 1
    assert DEFAULT_LIMITS.check_shape("t", [0, 5]) == 0
    assert DEFAULT_LIMITS.check_shape("t", [2**15, 2**16]) == 2**31


def test_a_huge_shape_is_refused_without_multiplying_it_out() -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidArgumentError):
        DEFAULT_LIMITS.check_shape("t", [2**62] * 32)
    assert time.perf_counter() - started < 0.1


def test_stamps_past_the_limits_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'w0': got generation 18446744073709551615"):
        DEFAULT_LIMITS.check_stamp("w0", 2**64 - 1, 0)
    with pytest.raises(InvalidArgumentError, match=r"'w0': got clock 4611686018427387905"):
        DEFAULT_LIMITS.check_stamp("w0", 0, 2**62 + 1)
    with pytest.raises(InvalidArgumentError, match=r"stamp.worker_id: got 257 characters"):
        DEFAULT_LIMITS.check_stamp("w" * 257, 0, 0)
    DEFAULT_LIMITS.check_stamp("w" * 256, 2**62, 2**62)


def test_limits_are_settable_and_checked() -> None:
    tight = Limits(max_dims=2, max_slices_per_request=3)
    with pytest.raises(InvalidArgumentError, match="3 dimensions"):
        tight.check_shape("t", [1, 1, 1])
    with pytest.raises(InvalidArgumentError, match="got 4 slices"):
        tight.check_count("push", 4)
    with pytest.raises(InvalidArgumentError, match="max_dims: got 65"):
        Limits(max_dims=65)
    with pytest.raises(InvalidArgumentError, match="max_clock: got 0"):
        Limits(max_clock=0)
