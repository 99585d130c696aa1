"""`ClusterCoordinator`: the chief holds the training loop and schedules functions on serving workers.

    coordinator = ClusterCoordinator()                    # the chief task of TF_CONFIG (pshard launch)
    v = coordinator.create_variable("v", np.zeros(1))     # lives on the parameter servers
    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    result = coordinator.schedule(step, args=(v, it))     # a RemoteValue, at once
    coordinator.join(); result.fetch()

The names follow TensorFlow's ClusterCoordinator where they fit (docs/guide/coordinator.md sets them side
by side). Variables are declared before the first schedule (they make the layout every worker uses).
Functions travel by name and arguments through the codec (nothing is pickled); each call gets a schedule
id that its pushes carry, so a call run again after its worker died counts once on the servers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.client.tables import TableClient
from pshard.common import checkpoint_store as gc
from pshard.common.cluster.layout import ParamSpec
from pshard.common.cluster.view import ClusterView
from pshard.common.errors import ClusterConfigError, InvalidArgumentError, PSError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig
from pshard.common.wire import codec
from pshard.common.wire.dtypes import PARAM_DTYPES
from pshard.coordinator import functions, values
from pshard.coordinator.closures import Closure, ClosureQueue, RemoteValue
from pshard.coordinator.dispatch import Dispatcher
from pshard.coordinator.shards import ShardQueue
from pshard.worker import checkpoint_coordinator as checkpoints
from pshard.worker.session import ClusterSession

from pshard.api.v1 import coordinator_pb2 as pb

log = logging.getLogger("pshard.coordinator")
# TensorFlow's sample adds to its variable: plain SGD with lr 1 makes a pushed gradient of -x add x.
DEFAULT_JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))


def first_schedule_id(generation: int) -> int:
    """This incarnation's first schedule id: its registration generation in the high 32 bits. A coordinator
    launched again on the same servers then numbers its calls above every id (and floor) of the one before,
    so its pushes are not taken for that one's finished calls, and that one's stragglers stay dropped."""
    if not 0 < generation < 2**32:
        raise InvalidArgumentError(f"generation: got {generation}, expected 1 to {2**32 - 1}")
    return (generation << 32) + 1


class Variable:
    """A dense variable on the parameter servers, declared through the coordinator. Passed to a scheduled
    function it arrives as a RemoteVariable (read, push_gradient, assign_add)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str,
                 coordinator: ClusterCoordinator) -> None:
        self.name, self.shape, self.dtype = name, shape, dtype
        self._coordinator = coordinator

    def read_value(self) -> np.ndarray:
        """Its value on the servers now."""
        return self._coordinator._read(self.name)

    def __pshard_ref__(self) -> values.VariableRef:
        return values.VariableRef(self.name)

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, shape={self.shape}, dtype={self.dtype})"


class Table:
    """A sparse table on the parameter servers, declared through the coordinator. Passed to a scheduled
    function it arrives as a RemoteTable (pull rows, push row gradients: each push counted once per call)."""

    def __init__(self, config: TableConfig, coordinator: ClusterCoordinator) -> None:
        self.config = config
        self._coordinator = coordinator

    @property
    def name(self) -> str:
        return self.config.name

    def read_rows(self, ids: Any) -> np.ndarray:
        """The rows of `ids` on the servers now (ids.shape + (dim,)); after the first schedule."""
        return self._coordinator._table_client().pull(self.name, np.asarray(ids, np.int64))

    def __pshard_ref__(self) -> values.TableRef:
        return values.TableRef(self.config)

    def __repr__(self) -> str:
        return f"Table({self.name!r}, dim={self.config.dim})"


class PerWorkerDataset:
    """`create_per_worker_dataset(dataset_fn)`: each `iter()` is a new iterator on every worker, made there by
    calling `dataset_fn(*args)` when a function first uses it, and kept between calls."""

    def __init__(self, coordinator: ClusterCoordinator, fn: str, args: tuple[Any, ...]) -> None:
        self._coordinator, self.dataset_fn, self.args = coordinator, fn, args

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(values.IteratorRef(self._coordinator._new_dataset_id(), self.dataset_fn,
                                                    self.args))


class PerWorkerIterator:
    """A handle: scheduled functions receive their worker's own iterator in its place."""

    def __init__(self, ref: values.IteratorRef) -> None:
        self._ref = ref

    def __pshard_ref__(self) -> values.IteratorRef:
        return self._ref

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(f"{self!r}: its elements are on the workers; pass it to a scheduled function, which "
                        "gets its worker's own iterator")

    def __repr__(self) -> str:
        return f"PerWorkerIterator(dataset {self._ref.dataset_id}: {self._ref.dataset_fn})"


class ClusterCoordinator:
    """Schedules functions on the serving workers of the cluster this chief task belongs to.

    `job`: the consistency mode (async: TensorFlow's parameter-server training) and the servers'
    optimizer; default plain SGD with lr 1. `session`: the chief's ClusterSession (default: from
    TF_CONFIG, as `pshard launch --coordinator` sets it). Close it (or use `with`): the workers exit once
    their coordinator has left.
    """

    def __init__(self, job: JobConfig | None = None, *, session: ClusterSession | None = None,
                 startup_timeout_s: float = 60.0, step_timeout_s: float = 120.0,
                 checkpoint_dir: str | None = None, keep_checkpoints: int | None = None) -> None:
        job = job or DEFAULT_JOB
        if job.mode != "async":
            raise InvalidArgumentError(f"job.mode: got {job.mode!r}, expected 'async': scheduled functions "
                                       "run whenever a worker is free, as in TensorFlow's parameter-server "
                                       "training")
        self._session = session or ClusterSession.from_environment(
            startup_timeout_s=startup_timeout_s, step_timeout_s=step_timeout_s)
        if self._session.spec.task_type != "chief":
            raise ClusterConfigError(f"task.type: got {self._session.spec.task_type!r}, the coordinator is "
                                     "the chief task")
        self.job = self._session.job_of(job)
        self._job_proto = codec.job_to_proto(self.job)
        self._variables: dict[str, np.ndarray] = {}
        self._tables: dict[str, TableConfig] = {}
        self._tables_of: TableClient | None = None
        self._client: PSClient | None = None
        self._lock = threading.Lock()
        self._dispatchers: dict[tuple[str, int], Dispatcher] = {}
        self._datasets = 0
        self._closed = False
        # Global checkpoints (docs/guide/coordinator.md): restored before the Declare, saved on request.
        self._checkpoint_dir, self._keep = checkpoint_dir, keep_checkpoints
        self.restored_clock: int | None = None
        self._restored_state: dict[str, Any] = {}  # the restored checkpoint's coordinator state
        self._shard_queues: dict[str, ShardQueue] = {}
        self._session.host_scheduler_if_needed()
        self._scheduler = self._session.register()
        # One heartbeat timeout with no worker after the scheduler declared the last one dead: two in all.
        self._queue = ClosureQueue(no_worker_s=self._scheduler.heartbeat_timeout_s,
                                   startup_s=self._session.startup_timeout_s,
                                   first_id=first_schedule_id(self._scheduler.generation))

    # ---- variables and datasets ----

    def create_variable(self, name: str, initial_value: Any) -> Variable:
        """A variable on the parameter servers with `initial_value` (a float array or tensor); before the
        first schedule."""
        if self._client is not None:
            raise InvalidArgumentError(f"create_variable({name!r}): the variables are fixed at the first "
                                       "schedule (they make every worker's layout); create them before")
        if name in self._variables:
            raise InvalidArgumentError(f"create_variable: {name!r} exists already")
        array = np.array(initial_value.detach().cpu().numpy() if hasattr(initial_value, "detach")
                         else initial_value)
        if array.dtype == np.float64 and not hasattr(initial_value, "dtype"):
            array = array.astype(np.float32)  # a Python number: torch's default dtype
        dtype = codec.dtype_name_of(array) if array.dtype.kind == "f" else str(array.dtype)
        if dtype not in PARAM_DTYPES or dtype == "bfloat16":
            raise InvalidArgumentError(f"create_variable({name!r}): got dtype {array.dtype}, expected one of "
                                       f"{[d for d in PARAM_DTYPES if d != 'bfloat16']}")
        self._variables[name] = array.reshape(array.shape or (1,))
        return Variable(name, self._variables[name].shape, dtype, self)

    def create_table(self, config: TableConfig) -> Table:
        """A sparse table on the parameter servers (declared with the variables, at the first schedule);
        async only: scheduled calls run whenever a worker is free."""
        if self._client is not None:
            raise InvalidArgumentError(f"create_table({config.name!r}): the tables are declared at the first "
                                       "schedule; create them before")
        if config.mode != "async":
            raise InvalidArgumentError(f"create_table({config.name!r}): got mode {config.mode!r}, expected "
                                       "'async': scheduled functions run whenever a worker is free")
        if config.name in self._tables or config.name in self._variables:
            raise InvalidArgumentError(f"create_table: {config.name!r} exists already")
        self._tables[config.name] = config
        return Table(config, self)

    def create_variables(self, state: Mapping[str, Any]) -> dict[str, Variable]:
        """One variable per entry (a torch `state_dict()`'s floating-point tensors, say)."""
        return {name: self.create_variable(name, value) for name, value in state.items()}

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any] | str, *args: Any) -> PerWorkerDataset:
        """Each worker's own input pipeline: `dataset_fn(*args)` (a module-level function returning an
        iterable) runs on each worker; `iter()` of the result is a handle to pass to scheduled functions."""
        name = functions.name_of(dataset_fn, "dataset_fn")
        for i, a in enumerate(args):
            values.encode(a, f"create_per_worker_dataset({name}): args[{i}]", handles=False)
        return PerWorkerDataset(self, name, args)

    # ---- scheduling ----

    def schedule(self, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
                 kwargs: Mapping[str, Any] | None = None) -> RemoteValue:
        """Run `fn(*args, **kwargs)` on some worker; returns at once. `fn` is a module-level function (or
        its "module:function" name) the workers import; refused here, before anything is sent, when it
        cannot be named or an argument cannot travel. Raises the first unhandled error of an earlier call."""
        return self._schedule(fn, args, kwargs)

    def _schedule(self, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
                  kwargs: Mapping[str, Any] | None = None, resume_at: int = 0) -> RemoteValue:
        """schedule, its work resuming at item `resume_at` (a shard queue's offset: WorkerContext.resume)."""
        if self._closed:
            raise PSError("schedule: the coordinator is closed (it has left the cluster, its workers exit)")
        name = functions.name_of(fn, "schedule: fn")
        encoded_args, encoded_kwargs = values.encode_call(tuple(args), dict(kwargs or {}), name)
        self._start()
        request = pb.RunRequest(function=name, args=encoded_args, kwargs=encoded_kwargs,
                                schedule_id=self._queue.next_id(), resume_at=resume_at)
        remote = RemoteValue(request.schedule_id, name, resume_at)
        self._queue.put(Closure(request, remote))
        return remote

    def join(self, timeout_s: float | None = None) -> None:
        """Wait until every scheduled call has finished. Raises the first error of a call (and then it is
        handled), or NoWorkersError naming what waits when no worker is left."""
        self._start()
        self._queue.join(timeout_s)

    def done(self) -> bool:
        """Whether every scheduled call has finished; raises a call's error as join() does."""
        return self._queue.done()

    def save_checkpoint(self) -> str:
        """Wait for every scheduled call (`join`), then write a global checkpoint of the variables under
        `checkpoint_dir`, committed by its manifest; its directory. Its clock is the servers' lowest slice
        version: in async mode, the updates the least-updated slice has had. A coordinator launched again
        with the same `checkpoint_dir` on fresh servers restores the newest one at its first schedule."""
        if not self._checkpoint_dir:
            raise InvalidArgumentError("save_checkpoint: checkpoint_dir: got none, expected the directory "
                                       "the servers share (their --global-checkpoint-dir)")
        self.join()
        client = self._client
        assert client is not None and client.layout is not None  # join() started it
        layout = client.layout
        holding = [i for i in range(len(layout.servers)) if layout.slices_on(i)]
        stats = client.stats()
        clock = min(stats[i].min_version for i in holding)
        state = {"shards": {name: q.position() for name, q in self._shard_queues.items()}}
        saved = checkpoints.save(client, self._checkpoint_dir, clock, keep=self._keep, coordinator=state)
        return str(saved.path)

    def shard_queue(self, name: str, num_shards: int) -> ShardQueue:
        """Shards 0..num_shards-1 handed out dynamically (`ShardQueue.schedule(fn)`: one call per shard, to
        whichever worker is free). Its position goes into every save_checkpoint; from a restored one, the
        shards it had trained are not scheduled again. After the variables (it starts the coordinator)."""
        if name in self._shard_queues:
            raise InvalidArgumentError(f"shard_queue: {name!r} exists already")
        self._start()
        restored = self._restored_state.get("shards", {}).get(name)
        if restored is not None and restored["num_shards"] != num_shards:
            raise InvalidArgumentError(f"shard_queue({name!r}): num_shards: got {num_shards}, the restored "
                                       f"checkpoint has {restored['num_shards']}")
        queue = ShardQueue(name, num_shards, self._schedule, restored["done"] if restored else (),
                           restored.get("offsets") if restored else None)
        self._shard_queues[name] = queue
        return queue

    @property
    def redispatched(self) -> int:
        """Calls run again because the worker running them was lost."""
        return self._queue.redispatched

    # ---- lifecycle ----

    def close(self) -> None:
        """Leave the cluster: the serving workers exit. Calls still queued never run."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for d in self._dispatchers.values():
                d.stop()
        try:
            self._session.leave_quietly()
        finally:
            self._session.close()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    def _start(self) -> None:
        """At the first schedule: the layout of the variables, their Declare, and the dispatchers."""
        with self._lock:
            if self._client is not None:
                return
            if self._closed:
                raise PSError("coordinator: closed")
            if not self._variables:
                raise InvalidArgumentError("schedule: no variable declared; create_variable() at least one "
                                           "before the first schedule (the workers wait for the layout)")
            specs = [ParamSpec(k, codec.dtype_name_of(v), tuple(v.shape)) for k, v in self._variables.items()]
            layout = self._session.propose_layout(specs)
            client = self._session.connect(layout)
            with self._session.waiting_for_servers(layout):
                if self._checkpoint_dir:  # before the Declare, which would start the servers fresh
                    restored = checkpoints.restore_checkpoint_of(client, self._checkpoint_dir, self.job)
                    if restored is not None:
                        self.restored_clock, self._restored_state = restored.clock, restored.coordinator
                        self._queue.number_above(gc.last_scheduled_call(restored))
                client.declare(self._variables, self.job)
                if self._tables:
                    self._tables_of = TableClient(client)
                    for config in self._tables.values():
                        self._tables_of.declare(config)
            self._client = client
        self._scheduler.add_view_callback(self._on_view)
        view = self._scheduler.view
        if view is not None:
            self._on_view(view)

    def _table_client(self) -> TableClient:
        if self._tables_of is None:
            raise PSError("coordinator: its tables are declared at the first schedule; read them after it")
        return self._tables_of

    def read(self, name: str) -> np.ndarray:
        """Variable `name`'s value on the servers now."""
        return self._read(name)

    def _read(self, name: str) -> np.ndarray:
        self._start()
        assert self._client is not None
        return self._client.pull(0, [name])[name]

    def _new_dataset_id(self) -> int:
        with self._lock:
            self._datasets += 1
            return self._datasets

    def _on_view(self, view: ClusterView) -> None:
        with self._lock:
            if self._closed:
                return
            live = {(n.node_id, n.generation): n for n in view.live("worker") if n.address}
            for key in [k for k in self._dispatchers if k not in live]:
                self._dispatchers.pop(key).stop()
            for key, node in live.items():
                if key not in self._dispatchers:
                    d = Dispatcher(node.node_id, node.address, self._queue, self._job_proto,
                                   self._session.security, self._workers_changed)
                    self._dispatchers[key] = d
                    d.start()
        self._workers_changed()

    def _workers_changed(self) -> None:
        with self._lock:
            ready = {d.node_id for d in self._dispatchers.values() if d.reachable and not d.gone.is_set()}
        self._queue.set_workers(ready)
