"""What a scheduled function sees on its worker: variables on the parameter servers, its own iterators.

A serving worker runs one call at a time inside `WorkerContext.running(schedule_id, floor)`. Every push
made through the context carries the call's schedule id and the push's number within the call
(`PSClient.scheduled`), so when the call is run again elsewhere (its worker died or was cut off) the
servers apply each of its pushes once. Pushes are waited for before the function goes on: the number
must name the same push on every run, and a function that returns has landed all of its updates.

Inside a function, `current()` is this context: `current().pull([...])`, `current().push({...})`, or the
variables the coordinator passed as arguments (`RemoteVariable.read`, `push_gradient`, `assign_add`) and
its sparse tables (`RemoteTable.pull`, `push`: table pushes are numbered and keyed the same way).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.client.tables import TableClient
from pshard.common.cluster.layout import ParamSpec
from pshard.common.errors import InvalidArgumentError, PSError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig
from pshard.coordinator import functions
from pshard.coordinator.values import IteratorRef

_current = threading.local()
T = TypeVar("T")
_END = object()


def current() -> WorkerContext:
    """The context of the scheduled call running on this thread; PSError outside one."""
    ctx = getattr(_current, "ctx", None)
    if ctx is None:
        raise PSError("pshard.coordinator.current(): no scheduled call is running on this thread; it is for "
                      "functions a ClusterCoordinator schedules")
    return ctx  # type: ignore[no-any-return]


class RemoteVariable:
    """A variable on the parameter servers, as a scheduled function holds it."""

    def __init__(self, name: str, ctx: WorkerContext) -> None:
        self.name = name
        self._ctx = ctx

    def read(self) -> np.ndarray:
        """Its value now (an async pull)."""
        return self._ctx.pull([self.name])[self.name]

    def push_gradient(self, grad: Any) -> None:
        """One step of the job's server optimizer with `grad`, counted once per scheduled call."""
        self._ctx.push({self.name: grad})

    def assign_add(self, delta: Any) -> None:
        """value += delta (broadcast to its shape): a gradient of -delta / lr, so it needs the job's
        optimizer to be plain SGD."""
        step = -np.asarray(delta, dtype=np.float64) / self._ctx.plain_sgd_lr(self.name)
        self._ctx.push({self.name: np.broadcast_to(step, self._ctx.spec(self.name).shape)})

    def __repr__(self) -> str:
        return f"RemoteVariable({self.name!r})"


class RemoteTable:
    """A sparse table on the parameter servers, as a scheduled function holds it: rows by id."""

    def __init__(self, config: TableConfig, ctx: WorkerContext) -> None:
        self.config = config
        self._ctx = ctx

    @property
    def name(self) -> str:
        return self.config.name

    def pull(self, ids: Any) -> np.ndarray:
        """Rows of `ids` (any shape, repeats allowed): ids.shape + (dim,)."""
        return self._ctx.tables.pull(self.name, np.asarray(ids, np.int64), self._ctx.clock)

    def push(self, ids: Any, grads: Any) -> int:
        """Row gradients (ids.shape + (dim,), repeated ids summed), applied by the table's optimizer once
        for this call and push number; the rows stored."""
        if hasattr(grads, "detach"):
            grads = grads.detach().cpu().numpy()
        keys = np.asarray(ids, np.int64)
        return self._ctx._stamped(lambda: self._ctx.tables.push(self.name, keys, np.asarray(grads),
                                                                 self._ctx.clock))

    def __repr__(self) -> str:
        return f"RemoteTable({self.name!r})"


class WorkerContext:
    """A serving worker's state between calls: its PSClient, its clock, its per-worker iterators."""

    def __init__(self, client: PSClient, job: JobConfig) -> None:
        self.client = client
        self.job = job
        # Scheduled pushes and pulls go at clock 0: a call runs on any worker, so the servers key its pushes
        # on (schedule id, push number) instead of a worker's clock, and async reads never wait.
        self.clock = 0
        self.schedule_id = 0
        self._floor = 0
        self._seq = 0
        self._iterators: dict[int, Iterator[Any]] = {}
        self._latest: dict[str, np.ndarray] | None = None
        self._tables: TableClient | None = None
        self.pushes_applied = 0
        self.pushes_dropped = 0
        # The call's work as items (a shard's batches): those that count already, and how far it got.
        self.resume_at = 0
        self.progress = 0

    # ---- the serving loop's side ----

    @contextlib.contextmanager
    def running(self, schedule_id: int, floor: int, resume_at: int = 0) -> Iterator[WorkerContext]:
        self.schedule_id, self._floor, self._seq = schedule_id, floor, 0
        self.pushes_applied = self.pushes_dropped = 0
        self.resume_at = self.progress = resume_at
        _current.ctx = self
        try:
            yield self
        finally:
            _current.ctx = None
            self.client.scheduled = (0, 0, 0)

    def variable(self, name: str) -> RemoteVariable:
        self.spec(name)
        return RemoteVariable(name, self)

    def table(self, config: TableConfig) -> RemoteTable:
        """Table `config`, which the coordinator declared on the servers before its first schedule."""
        self.tables.configs[config.name] = config
        return RemoteTable(config, self)

    @property
    def tables(self) -> TableClient:
        """This worker's TableClient, over its PSClient's connections (made on first use)."""
        if self._tables is None:
            self._tables = TableClient(self.client)
        return self._tables

    def iterator(self, ref: IteratorRef) -> Iterator[Any]:
        """This worker's iterator of dataset `ref`, made by calling its function on first use and kept."""
        it = self._iterators.get(ref.dataset_id)
        if it is None:
            dataset = functions.resolve(ref.dataset_fn, "dataset_fn")(*ref.args)
            it = self._iterators[ref.dataset_id] = iter(dataset)
        return it

    # ---- the function's side ----

    def pull(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """The variables `names` (all when None) as the servers hold them now."""
        return self.client.pull(self.clock, names)

    def push(self, grads: Mapping[str, Any]) -> None:
        """Gradients of variables, applied by the servers' optimizer once for this call and push number."""
        arrays = {k: self._as_param(k, g) for k, g in grads.items()}
        result = self._stamped(lambda: self.client.wait(self.client.push(arrays, self.clock)))
        self.pushes_applied += result.applied
        self.pushes_dropped += result.dropped

    def push_pull(self, grads: Mapping[str, Any],
                  out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Push gradients of every variable and get the weights back in the same round trip, as PSTrainer's
        fused step: `latest()` answers the next call on this worker with them, without a pull. `out`:
        contiguous arrays the weights land in instead of new ones; with numpy views of a CPU model's own
        parameters (`p.detach().numpy()`) there is nothing left to load, as in PSTrainer's step."""
        arrays = {k: self._as_param(k, g) for k, g in grads.items()}
        weights = self._stamped(lambda: self.client.push_pull(arrays, self.clock, out))
        result = self.client.last_result
        if result is not None:
            self.pushes_applied += result.applied
            self.pushes_dropped += result.dropped
        self._latest = weights
        return weights

    def resume(self, items: Iterable[T]) -> Iterator[T]:
        """`items` (a shard's batches, in the same order on every run) from where this call's work stands:
        the first `resume_at` are skipped (a checkpoint's weights, or an earlier run that failed, have them).
        An item counts once the loop asks for the next one or ends, so after its step and its pushes: an
        exception or a `break` in its step leaves it to the next run. The coordinator gets the count
        (`progress`) with the call's result or error; a shard queue resumes its shard there."""
        it = iter(items)
        for skipped in range(self.resume_at):
            if next(it, _END) is _END:
                raise InvalidArgumentError(f"resume: the call's work goes on at item {self.resume_at}, but "
                                           f"its items end after {skipped} (not the same items as before?)")
        for item in it:
            yield item
            self.progress += 1

    def latest(self, out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The weights this worker got back with its last push_pull (async: as fresh as a pull at the end
        of its last step, which is what a worker-driven loop trains on), else a pull of every variable.
        `out`: arrays to put them in (views of a model's parameters): copied, unless the last push_pull
        landed them in these very arrays, so a step that passes the same `out` to both loads nothing."""
        if self._latest is None:
            self._latest = self.client.pull(self.clock, None, out)
        if out is None:
            return self._latest
        for name, into in out.items():
            have = self._latest[name]
            if have is not into:
                np.copyto(into, have.reshape(into.shape))
        return dict(out)

    def _stamped(self, send: Callable[[], T]) -> T:
        self.client.scheduled = (self.schedule_id, self._seq, self._floor)
        try:
            return send()
        finally:
            self.client.scheduled = (0, 0, 0)
            self._seq += 1  # a failed push keeps its number: a re-run numbers its pushes the same way

    def plain_sgd_lr(self, name: str) -> float:
        o = self.job.optimizer
        if o.name != "sgd" or o.momentum or o.weight_decay or o.lr <= 0:
            raise InvalidArgumentError(
                f"variable {name!r}: assign_add needs the job's optimizer to be plain SGD with lr > 0, got "
                f"{o.name} (lr {o.lr}, momentum {o.momentum}, weight_decay {o.weight_decay}); push a "
                "gradient with push_gradient instead")
        return float(o.lr)

    def spec(self, name: str) -> ParamSpec:
        layout = self.client.layout
        spec = next((p for p in layout.params if p.key == name), None) if layout else None
        if spec is None:
            raise InvalidArgumentError(f"variable {name!r}: not declared through the coordinator")
        return spec

    def _as_param(self, name: str, grad: Any) -> np.ndarray:
        spec = self.spec(name)
        if hasattr(grad, "detach"):
            grad = grad.detach().cpu().numpy()
        array = np.asarray(grad, dtype=spec.dtype)
        if array.shape != tuple(spec.shape):
            raise InvalidArgumentError(f"push: variable {name!r}: got shape {array.shape}, it has "
                                       f"{tuple(spec.shape)}")
        return array
