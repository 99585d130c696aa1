"""Module-level functions that the coordinator tests schedule: the workers import them by name."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pshard.coordinator.context import RemoteTable, RemoteVariable, current

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


def thread_and_next(it: Iterator[Any]) -> list[Any]:
    """The thread this call runs on, and the worker's iterator's next item."""
    import threading

    return [threading.current_thread().name, next(it)]


def run_a_loop_of_its_own(x: int) -> list[Any]:
    """A function that runs asyncio code of its own, and what it sees of a running loop afterwards."""
    import asyncio

    async def double() -> int:
        await asyncio.sleep(0)
        return 2 * x

    return [asyncio.run(double()), asyncio._get_running_loop() is None]


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


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


def push_rows(t: RemoteTable, ids: list[int], step: float) -> list[float]:
    """Pushes a gradient of -step to each row of `ids` (SGD, lr 1: row += step); returns the rows after."""
    t.push(np.array(ids), np.full((len(ids), t.config.dim), -step, np.float32))
    return [float(r[0]) for r in t.pull(np.array(ids))]


def hold_then_push_rows(t: RemoteTable, ids: list[int], step: float, marker: str) -> float:
    """hold_then_add for a table's rows: each run writes the rows the servers stored to `marker`.<worker>."""
    if _first_run(marker):
        _hold(marker)
    stored = t.push(np.array(ids), np.full((len(ids), t.config.dim), -step, np.float32))
    Path(f"{marker}.{current().client.worker_id}").write_text(f"stored={stored}")
    return step


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


_landing: dict[str, np.ndarray] = {}  # this (one) worker's own array for v, as a model's parameter is


def add_landing(x: float) -> list[Any]:
    """Adds x to v in one push+pull whose weights land in the worker's own array; returns v there before
    and after, whether push_pull returned that array, and v as latest(out=) copies it into another."""
    ctx = current()
    own = _landing.setdefault("v", np.full(1, -1.0, np.float32))
    ctx.latest(out={"v": own})  # the worker's first call: pulled into it; later: there already
    before = float(own[0])
    got = ctx.push_pull({"v": np.full(1, -x, np.float32)}, out={"v": own})
    other = np.zeros(1, np.float32)
    ctx.latest(out={"v": other})
    return [before, float(own[0]), got["v"] is own, float(other[0])]


def synthetic_batches(shape: tuple[int, ...], seed: int) -> Iterator[tuple[Any, Any]]:
    """Endless random batches of 32 images of `shape` (C, H, W) and labels in 0..9."""
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(32, *shape, generator=g), torch.randint(0, 10, (32,), generator=g)


_mlps: dict[tuple[int, ...], Any] = {}


def train_mlp(batches: Iterator[tuple[Any, Any]]) -> float:
    """One step of the demo's MLP: the weights of this worker's last step, one push+pull."""
    import torch
    from pshard.worker.model import build_model
    from torch.nn import functional as F

    ctx = current()
    x, y = next(batches)
    shape = tuple(x.shape[1:])
    model = _mlps.setdefault(shape, build_model("mlp", shape, 10))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ctx.latest().items()})
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    ctx.push_pull({name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None})
    return loss.item()


def add_shard(shard: int, v: RemoteVariable, poisoned: list[int]) -> int:
    """Trains shard `shard`: adds shard + 1; a poisoned shard fails (a crash half-way through the data)."""
    if shard in poisoned:
        raise RuntimeError(f"shard {shard} is poisoned")
    v.assign_add(shard + 1.0)
    return shard


def shard_batches(shard: int) -> list[list[int]]:
    """Shard `shard`'s samples as 4 batches of 3 sample ids: 12 * shard to 12 * shard + 11, in order."""
    return [[12 * shard + 3 * b + i for i in range(3)] for b in range(4)]


def train_shard_batches(shard: int, v: RemoteVariable, poisoned_at: list[int]) -> int:
    """Trains shard `shard` batch by batch from where its work stands: adds each sample's id + 1, so the
    variable ends at the sum over the samples trained, each as often as it was. Batch `poisoned_at[1]` of
    shard `poisoned_at[0]` raises before its push (a crash half-way through the shard)."""
    for batch in current().resume(shard_batches(shard)):
        if [shard, (batch[0] - 12 * shard) // 3] == poisoned_at:
            raise RuntimeError(f"shard {shard} is poisoned at sample {batch[0]}")
        v.assign_add(float(sum(i + 1 for i in batch)))
    return shard


def shard_on(shard: int, slow_worker: str, slow_s: float) -> str:
    """Which worker trained `shard`; `slow_worker` takes `slow_s` per shard (a slower machine)."""
    worker = current().client.worker_id
    if worker == slow_worker:
        time.sleep(slow_s)  # the workload of a slow worker, not a wait for a state
    return worker
