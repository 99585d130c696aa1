"""A serving worker's Run handler (pshard.worker.serve) takes one thread hop per call once it is ready: the
function runs on a thread, and the readiness check, an Event set once at start-up, costs no hop of its own
(it took one per call: a thread-pool round trip on every scheduled step's critical path)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pshard.worker import serve

from tests.service import coordinator_functions as f
from tests.service.coordinator_cluster import cluster


def test_a_ready_worker_runs_each_call_with_one_thread_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    hops: Counter[str] = Counter()
    to_thread = asyncio.to_thread

    async def counted(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        hops[getattr(func, "__qualname__", "")] += 1
        return await to_thread(func, *args, **kwargs)

    monkeypatch.setattr(serve.asyncio, "to_thread", counted)
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            coordinator.schedule(f.noop).fetch()  # the worker is ready from here on
            hops.clear()
            for _ in range(5):
                coordinator.schedule(f.noop).fetch()
    assert (hops["CallRunner.run"], hops["Event.wait"]) == (5, 0)
