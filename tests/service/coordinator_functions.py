"""Module-level functions that the coordinator tests schedule: the workers import them by name."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pshard.coordinator.context import RemoteVariable, current

# A call told to hold waits at most this long for the test to kill or release its worker.
HOLD_S = 60.0


def add(v: RemoteVariable, x: float) -> float:
    v.assign_add(x)
    return float(x)


def add_next(v: RemoteVariable, it: Iterator[Any]) -> int:
    x = next(it)
    v.assign_add(x)
    return int(x)


def count_to(n: int) -> Iterator[int]:
    yield from range(1, n + 1)


def echo(*args: Any, **kwargs: Any) -> Any:
    return [list(args), sorted(kwargs.items())]


def noop() -> None:
    return None


def worker_id() -> str:
    return current().client.worker_id


def fail(message: str) -> None:
    raise ValueError(message)


def read(v: RemoteVariable) -> np.ndarray:
    return v.read()


def hold_then_add(v: RemoteVariable, x: float, marker: str) -> float:
    """The first run writes `marker` and waits for `marker`.release before it adds x (a run cut off from the
    cluster, still going); any other run adds at once. Each run writes how many gradients the servers
    applied to `marker`.<worker>."""
    if _first_run(marker):
        _hold(marker)
    ctx = current()
    v.assign_add(x)
    Path(f"{marker}.{ctx.client.worker_id}").write_text(f"applied={ctx.pushes_applied}")
    return float(x)


def _first_run(marker: str) -> bool:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _hold(marker: str) -> None:
    release = Path(marker + ".release")
    deadline = time.monotonic() + HOLD_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # a held run is the state under test: the test kills, cuts off or releases it


def add_then_hold(v: RemoteVariable, x: float, marker: str) -> float:
    """Adds x, then (the first run only) writes its pid to `marker` and waits to be killed or cut off: a
    re-dispatched run finds the marker and returns at once, so only its push can double-count."""
    v.assign_add(x)
    if _first_run(marker):
        _hold(marker)
    return float(x)


def add_fused(x: float) -> list[float]:
    """Adds x to every variable (SGD, lr 1) in one push+pull; returns what `latest()` saw before and after."""
    ctx = current()
    before = ctx.latest()
    after = ctx.push_pull({k: np.full_like(w, -x) for k, w in before.items()})
    return [float(before["v"][0]), float(after["v"][0]), float(ctx.latest()["v"][0])]
