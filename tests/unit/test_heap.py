"""HeapTrimmer (ps_server/heap.py): one trim after a burst of large requests, none for small ones."""

from __future__ import annotations

import time

import pytest
from pshard.ps_server.heap import TRIM_AFTER_BYTES, HeapTrimmer, _malloc_trim

pytestmark = pytest.mark.skipif(_malloc_trim() is None, reason="no malloc_trim: not glibc")


def wait_for_trims(trimmer: HeapTrimmer, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while trimmer.trims < count:
        assert time.monotonic() < deadline, f"{trimmer.trims} trims after {timeout_s} s, expected {count}"
        time.sleep(0.005)


def test_a_burst_of_large_requests_is_followed_by_one_trim_once_quiet() -> None:
    trimmer = HeapTrimmer(quiet_s=0.2)
    try:
        trimmer.request_ended(TRIM_AFTER_BYTES - 1)  # small: nothing to give back
        for _ in range(20):
            trimmer.request_ended(TRIM_AFTER_BYTES)
        assert trimmer.trims == 0  # not during the burst
        wait_for_trims(trimmer, 1)
        trimmer.request_ended(4 * TRIM_AFTER_BYTES)
        wait_for_trims(trimmer, 2)
    finally:
        trimmer.close()


def test_sustained_large_traffic_still_trims_every_max_interval() -> None:
    trimmer = HeapTrimmer(quiet_s=0.05, max_interval_s=0.2)
    try:
        deadline = time.monotonic() + 10.0
        while trimmer.trims == 0 and time.monotonic() < deadline:
            trimmer.request_ended(TRIM_AFTER_BYTES)  # never quiet
            time.sleep(0.01)
        assert trimmer.trims >= 1
    finally:
        trimmer.close()
