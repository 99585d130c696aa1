"""`PSTrainer`: train your own torch model on the parameter servers, in the spirit of Horovod.

Wrap the model once; after every backward pass `step()` pushes the gradients and pulls
the fresh weights back into the parameters in one fused exchange per server:

    trainer = PSTrainer(model, PSClient(servers, worker_id="worker-0"),
                        JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1)))
    for x, y in batches:
        trainer.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()
    trainer.close()

Given no client, `PSTrainer(model, job=...)` joins the cluster its environment describes (TF_CONFIG,
as `pshard launch ... train.py`, compose or a TFJob set it) through the same `ClusterSession` as
`pshard worker`: it registers with the scheduler, gets its rank (`trainer.rank`, `trainer.world_size`,
for `pshard.worker.ShardSampler`) and the layout, waits at the start barrier, reports each clock,
and `close()` leaves the job at a clock boundary. A restarted worker rejoins at the job's clock.

What travels: the parameters that require gradients, and in sync mode the floating-point buffers
(BatchNorm's running statistics), whose mean every worker loads back (`buffers=`, pshard.worker.buffers).
An `lr_scheduler` drives the servers' learning rate through `param_groups` (pshard.worker.hyper), and
`DataLoader(num_workers=N)` may fork the process (pshard.client.forking). bfloat16 parameters are
held as float32 on the servers (numpy has no bfloat16; set the job's wire_dtype="bfloat16" to keep
the traffic small).

Overlap (`overlap=True`, what `python -m pshard.worker` uses): each bucket of gradients is pushed
as soon as backward has produced it, last layer first, and the next forward waits only for the
layers it reaches (pshard.worker.overlap). `step()` then returns None at once; the step's outcome is
`last_result` once `clock` (or `synchronize()`) has waited for it. One backward per step.
With `priority=True` too, the queued bucket nearest the model's input is pushed first and the pulls
go apart, first layers first (ByteScheduler's layer priority; pshard.worker.priority).

Aggregate-only mode (optimizer "aggregate"): the servers return the mean gradient, the
trainer writes it into `.grad` and steps the torch optimizer you pass as
`local_optimizer=`. Every worker then applies the same update to the same weights.

CPU training on a host shared with servers or peers: start Python with
OMP_WAIT_POLICY=PASSIVE (`python -m pshard.worker` sets it). OpenMP's default busy-waiting starves
the gRPC threads that carry the push/pull and made steps ~20x slower on a loaded 2-core box.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from types import TracebackType
from typing import Any

import numpy as np
import torch
from pshard.client.forking import warn_if_fork_unsafe
from pshard.client.ps_client import PSClient, PushResult
from pshard.common.cluster.layout import ParamSpec
from pshard.common.errors import InvalidArgumentError, PSError
from pshard.common.job import JobConfig
from pshard.common.wire import dtypes
from pshard.worker import buffers as buffer_policy
from pshard.worker import hyper
from pshard.worker.device import HostStaging, select_device
from pshard.worker.embedding import attach_tables, push_table_grads
from pshard.worker.overlap import DEFAULT_BUCKET_BYTES, BackwardOverlap, merge_results
from pshard.worker.session import ClusterSession
from torch import nn

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.trainer")

# dtypes the servers hold as they are; anything else that is a float travels as float32.
# PSTrainer.state_dict()'s entry for the error-feedback residuals of a compressed job.
RESIDUALS = "compression_residuals"
_NATIVE = tuple(getattr(torch, dtypes.info(name).torch_name) for name in dtypes.PARAM_DTYPES)


def param_specs(model: nn.Module, mode: str = "sync", buffers: str | None = None) -> list[ParamSpec]:
    """What PSTrainer declares for `model` in a job of `mode` with its `buffers` policy: every parameter
    that requires gradients, then the buffers that travel (pshard.worker.buffers), bf16 as float32."""
    tensors = [*((k, p) for k, p in model.named_parameters() if p.requires_grad),
               *buffer_policy.synced(model, buffer_policy.resolve(buffers, mode)).items()]
    return [ParamSpec(key, dtypes.of_torch(_declared_dtype(t)).name, tuple(t.shape)) for key, t in tensors]


class PSTrainer(torch.optim.Optimizer):
    """Keeps a model's parameters on the parameter servers and its clock in step with them.

    Construction declares the parameters (the first worker's initial values win; every
    worker loads what the servers hold) and picks up the clock where the servers are, so
    a worker that restarts or joins late continues rather than replaying clock 0.

    A torch.optim.Optimizer whose update runs on the servers: `param_groups` shows the job's
    hyper-parameters, and a `torch.optim.lr_scheduler` given the trainer sets the lr that each
    step's pushes carry (pshard.worker.hyper). `state_dict()` holds the param groups (the
    optimizer's state lives on the servers, and in their checkpoints) and, in a job that compresses
    gradients with error feedback, this worker's residuals ("compression_residuals").
    """

    def __init__(self, model: nn.Module, client: PSClient | None = None, job: JobConfig | None = None, *,
                 device: torch.device | str | None = None,
                 local_optimizer: torch.optim.Optimizer | None = None, clock: int | None = None,
                 overlap: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES, priority: bool = False,
                 buffers: str | None = None, session: ClusterSession | None = None) -> None:
        """`priority` (with `overlap`): pushes by layer priority, pulls apart (pshard.worker.priority); every
        worker of a sync job must set it alike (a FIFO worker's fused calls can wait on a priority peer's).
        `buffers`: how the model's floating-point buffers follow the job, "average" (sync's default)
        or "local" (async's and SSP's); see pshard.worker.buffers. `client` None: join the cluster
        through `session` (default: the one the environment describes,
        `ClusterSession.from_environment()`); the trainer then owns the session."""
        warn_if_fork_unsafe()
        if priority and not overlap:
            raise InvalidArgumentError("priority: got True with overlap False; layer priority orders the "
                                       "overlapped buckets, so set overlap=True too")
        if job is None:
            raise InvalidArgumentError("job: got None, expected a JobConfig (the consistency mode and the "
                                       "server-side optimizer)")
        self.session: ClusterSession | None = None
        if client is None:
            self.session = session or ClusterSession.from_environment()
            job = self.session.job_of(job)
            try:
                client = self.session.join(param_specs(model, job.mode, buffers))
            except BaseException:
                self.session.close()
                raise
        self.model = model
        self.client = client
        self.job = job
        self.aggregate = job.optimizer.name == "aggregate"
        if self.aggregate and local_optimizer is None:
            raise InvalidArgumentError("local_optimizer: aggregate mode needs a torch optimizer over the "
                                       "model's parameters (the servers only average the gradients)")
        if not self.aggregate and local_optimizer is not None:
            raise InvalidArgumentError(f"local_optimizer: given, but the servers run "
                                       f"{job.optimizer.name!r}; use optimizer 'aggregate' for a local one")
        self.local_optimizer = local_optimizer
        self.tables = attach_tables(model, client)  # PSEmbedding modules: their rows live in sparse tables
        if device is not None:
            model.to(select_device(device) if isinstance(device, str) else device)
        self.params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise InvalidArgumentError("model: has no parameters that require gradients")
        self.buffer_policy = buffer_policy.resolve(buffers, job.mode)
        self.synced_buffers = buffer_policy.synced(model, self.buffer_policy)
        if self.synced_buffers:  # the servers hold them as slices that average the pushes
            self.job = job = dataclasses.replace(job, averaged=tuple(self.synced_buffers))
        self._buffer_landing: dict[str, np.ndarray] = {}
        super().__init__(list(self.params.values()), hyper.defaults(job.optimizer))
        self._stamped_lr: float | None = None  # the lr this step's pushes carry (None: the job's)
        first = next(iter(self.params.values()))
        self.device = first.device
        self._staging = HostStaging(self.device)
        self._buffers: dict[str, np.ndarray] = {}
        self._zeros: dict[str, torch.Tensor] = {}
        self.last_result: PushResult | None = None
        try:
            self._clock = self._join() if clock is None else clock
        except BaseException:
            if self.session is not None:
                self.session.leave_quietly()
                self.session.close()
            raise
        self._pending: list[Future[PushResult]] = []  # overlap: the last step's buckets in flight
        self._overlap = BackwardOverlap(
            model, self.params, client, self._staging, self._settle, self._host_buffers,
            self._load_overlapped, self._zero_grad_of, bucket_bytes, priority) if overlap else None

    # ---- the training-loop API ----

    @property
    def rank(self) -> int:
        """This worker's data-parallel rank in the job (chief first); 0 with a client of your own."""
        return self.session.rank if self.session is not None else 0

    @property
    def world_size(self) -> int:
        """Trainers in the job as TF_CONFIG lists them; 1 with a client of your own."""
        return self.session.spec.world_size if self.session is not None else 1

    @property
    def is_chief(self) -> bool:
        """The worker that saves and evaluates: the chief, else worker 0 (TensorFlow's rule)."""
        return self.session.is_chief if self.session is not None else True

    @property
    def clock(self) -> int:
        """Steps this worker has taken in the job (sync: the version the servers are at).

        With overlap this waits for the last step's replies (not for its weights to land)."""
        return self._settle()

    def synchronize(self) -> None:
        """With overlap: wait for the last step and load all of its weights into the parameters.

        Forward does this layer by layer by itself; call it before reading the weights otherwise
        (saving, evaluating under torch.no_grad() without a forward of the model, ...)."""
        self._settle()
        if self._overlap is not None:
            self._overlap.land()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._take_lr()  # with overlap, this step's pushes leave during backward
        if not set_to_none:
            self._settle()  # the last step's pushes read the gradients that zero_() would clear
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's, plus the error-feedback residuals of a compressed job, per parameter: what
        compression has not sent yet, which a worker restarted from this state does not lose."""
        state = super().state_dict()
        encoder = self.client.compression
        if encoder is not None and encoder.error_feedback:
            state[RESIDUALS] = {k: torch.from_numpy(v) for k, v in encoder.state().items()}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch.optim's, and the residuals `state_dict()` saved (refused whole, naming the parameter,
        when this job does not compress it or its size differs)."""
        state = dict(state_dict)
        residuals = state.pop(RESIDUALS, None)
        if residuals:
            encoder = self.client.compression
            if encoder is None:
                raise InvalidArgumentError(f"{RESIDUALS}: got residuals of {sorted(residuals)[:4]}, but this "
                                           "job compresses no gradient")
            encoder.load_state({k: v.detach().cpu().numpy() for k, v in residuals.items()})
        super().load_state_dict(state)

    def step(self, closure: None = None) -> PushResult | None:  # type: ignore[override]
        """Push the gradients of this clock, pull the weights of the next one (into the parameters).

        With overlap, returns None without waiting (see the module docstring)."""
        if closure is not None:
            raise InvalidArgumentError("closure: PSTrainer.step takes none (the update runs on the servers, "
                                       "once per backward)")
        self._take_lr()
        if self._overlap is not None:
            self._overlapped_step()
            return None
        push_table_grads(self.tables, self._clock)  # the tables' rows first: each table has its own mode
        grads = self._grads_on_host()
        grads.update(self._buffers_on_host())  # sync: the servers return their mean with the weights
        out = self._landing()
        out.update(self._buffers_landing())
        self.client.push_pull(grads, self._clock, out=out, lr=self._stamped_lr)
        result = self.client.last_result
        assert result is not None  # push_pull always records what it did
        self.last_result = result
        # Sync: the servers' version is the clock (a late push jumps to it); otherwise one step each.
        self._advance(result)
        self._load_buffers(out)
        if self.aggregate:
            self._load(out, grads=True)
            assert self.local_optimizer is not None
            self.local_optimizer.step()
        else:
            self._load(out)
        self._report()
        return result

    def pull(self) -> None:
        """Fetch the weights as of the current clock into the parameters."""
        self.synchronize()
        if self.aggregate:
            raise InvalidArgumentError("pull: in aggregate mode the servers hold the mean gradient, not the "
                                       "weights; the weights are the ones in your model")
        out = self._landing()
        out.update(self._buffers_landing())
        self.client.pull(self._clock, out=out)
        self._load(out)
        self._load_buffers(out)

    def close(self) -> None:
        """Finish the last step, then close the client (the trainer owns it from construction on).

        Joined through a session: leave the job at this clock boundary (the sync quorum shrinks and the
        others go on); a chief hosting the scheduler first waits until the other workers are done."""
        try:
            if self._overlap is not None:
                self.synchronize()
            if self.session is not None:
                if self.session.hosted_scheduler is not None:
                    self.session.await_peers()
                self.session.leave()
        finally:
            if self._overlap is not None:
                self._overlap.close()
            self.client.close()
            if self.session is not None:
                self.session.close()

    def __enter__(self) -> PSTrainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None and self.session is not None:
            self.session.leave_quietly()  # the failure is the exception: leaving must not mask it
        self.close()

    # ---- internals ----

    def _join(self) -> int:
        """Declare (naming the servers that do not answer), then the start barrier and full quorum."""
        session = self.session
        if session is None:
            return self._declare()
        layout = self.client.layout
        assert layout is not None  # session.join connected on a layout
        with session.waiting_for_servers(layout):
            clock = self._declare()
        session.await_start(clock, wait_for_quorum=self.job.mode != "async")  # async waits for nobody
        return clock

    def _report(self) -> None:
        if self.session is not None:
            with contextlib.suppress(PSError):  # progress for `pshard status`; the heartbeat still runs
                self.session.report_clock(self._clock)

    def _take_lr(self) -> None:
        """The lr this step's pushes carry: param_groups' as a scheduler left it (checked once here)."""
        self._stamped_lr = hyper.stamped_lr(self.param_groups, self.job.optimizer)
        if self._overlap is not None:
            self._overlap.step_lr = self._stamped_lr

    def _advance(self, result: PushResult) -> None:
        # Sync: the servers' version is the clock (a late push jumps to it); otherwise one step each.
        self._clock = max(result.min_version, self._clock + 1) if self.job.mode == "sync" else self._clock + 1

    def _overlapped_step(self) -> None:
        assert self._overlap is not None
        clock = self._overlap.step_clock()
        push_table_grads(self.tables, clock)  # rows first, as without overlap
        self._pending = self._overlap.finish_step()
        self._exchange_buffers(clock)
        if self.aggregate:  # the local optimizer needs the mean gradients now
            self._settle()
            out = self._host_buffers(self.params)
            self._load(out, grads=True)
            assert self.local_optimizer is not None
            self.local_optimizer.step()
            self._overlap.discard()  # what was pulled are gradients, loaded just above

    def _settle(self) -> int:
        """Wait for the last overlapped step's replies and advance the clock by them."""
        if self._pending:
            futures, self._pending = self._pending, []
            result = merge_results(self.client.wait(f) for f in futures)
            self.last_result = result
            self._advance(result)
            self._report()
        return self._clock

    def _host_buffers(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Host arrays the pulled values of `keys` land in, allocated once (never the parameters)."""
        return {key: self._host_buffer(key) for key in keys}

    def _host_buffer(self, key: str) -> np.ndarray:
        """CUDA: the key's pinned staging buffer where its dtype allows (no host copy before the H2D
        copy; it waits for the GPU to have read the last step's values), else an array of our own."""
        p = self.params[key]
        dtype = _numpy_dtype(_declared_dtype(p))
        pinned = self._staging.landing(key, p.detach())
        if pinned is not None and pinned.dtype == dtype:
            self._buffers[key] = pinned
            return pinned
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = np.empty(tuple(p.shape), dtype)
        return buf

    def _load_overlapped(self, out: Mapping[str, np.ndarray]) -> None:
        self._staging.to_device(out, {k: self.params[k].detach() for k in out})

    def _zero_grad_of(self, key: str) -> torch.Tensor:
        grad = self._zeros.get(key)
        if grad is None:
            p = self.params[key]
            grad = self._zeros[key] = torch.zeros_like(p, dtype=_declared_dtype(p))
        return grad

    def _declare(self) -> int:
        """Declare the parameters, load what the servers hold, return the clock to continue from."""
        values = self._staging.to_host({k: _declared(p.detach()) for k, p in self.params.items()})
        values.update(self._buffers_on_host())
        held = self.client.declare(values, self.job)
        self._load_buffers(held)
        held = {k: held[k] for k in self.params}
        stats = [s for s in self.client.stats() if s.slices]
        started = any(s.max_version > 0 for s in stats)
        if self.aggregate and started:
            # The slices hold the last mean gradient by now: the weights exist only on the workers.
            log.warning("aggregate mode: the job is under way, keeping this model's own initial weights")
        else:
            self._staging.to_device(held, {k: p.detach() for k, p in self.params.items()})
            if started and self.session is None and not self.job.job_id:
                log.warning("the servers' job is under way (clock %d): this worker continues it with their "
                            "weights, not this model's initial values. If this is a new run, name each run "
                            "(JobConfig(job_id=...)): a new job on servers holding another is then refused",
                            max(s.max_version for s in stats))
        self._say_residuals_lost(stats)
        if self.job.mode == "sync":
            return min((s.min_version for s in stats), default=0)
        # Async/SSP: the servers drop pushes at or below a worker's last clock (at-most-once).
        return 1 + max((s.worker_clocks.get(self.client.worker_id, -1) for s in stats), default=-1)

    def _say_residuals_lost(self, stats: Sequence[pb.GetStatsResponse]) -> None:
        """A worker the servers have had pushes from before is a restart: with error feedback, what its
        compression had not sent yet died with it. Said once; training goes on (load_state_dict puts
        saved residuals back)."""
        encoder = self.client.compression
        me = self.client.worker_id
        if encoder is None or not encoder.error_feedback or not any(me in s.worker_clocks for s in stats):
            return
        log.warning("worker %s restarted in a job that compresses gradients with error feedback: the "
                    "residuals of what earlier steps did not send are lost (at most a few steps' worth of "
                    "small gradient entries); training goes on. PSTrainer.state_dict() holds them, "
                    "load_state_dict() puts them back", me)

    def _buffers_on_host(self) -> dict[str, np.ndarray]:
        """Copies of the synced buffers' values (the pulled mean may land in the buffers themselves)."""
        if not self.synced_buffers:
            return {}
        host = self._staging.to_host({k: _declared(b.detach()) for k, b in self.synced_buffers.items()})
        return {k: np.array(a, copy=True) for k, a in host.items()}

    def _buffers_landing(self) -> dict[str, np.ndarray]:
        for key, b in self.synced_buffers.items():
            if key not in self._buffer_landing:
                self._buffer_landing[key] = np.empty(tuple(b.shape), _numpy_dtype(_declared_dtype(b)))
        return dict(self._buffer_landing)

    def _load_buffers(self, out: Mapping[str, np.ndarray]) -> None:
        if self.synced_buffers:
            self._staging.to_device({k: out[k] for k in self.synced_buffers}, self.synced_buffers)

    def _exchange_buffers(self, clock: int) -> None:
        """With overlap: the buffers' push of `clock` and the pull of their mean, after backward's buckets
        (a push and a pull of their own: the fused call's reply is the overlap's to read)."""
        if not self.synced_buffers:
            return
        # Not before this step's buckets have had their replies. A fast path carries one request at a
        # time per server and a sync pull holds it while the server waits for the other workers: our
        # buffer pull would then keep our last bucket's push unsent while a peer's last bucket waits
        # for that push and holds the path its buffer push needs, each worker waiting for the other
        # until the deadline. (Their results stay pending for `_settle`.)
        wait(self._pending, timeout=self.client.timeout_s)
        self.client.wait(self.client.push(self._buffers_on_host(), clock, lr=self._stamped_lr))
        out = self._buffers_landing()
        self.client.pull(clock + 1, keys=list(out), out=out)
        self._load_buffers(out)

    def _grads_on_host(self) -> dict[str, np.ndarray]:
        tensors: dict[str, torch.Tensor] = {}
        for key, p in self.params.items():
            grad = p.grad
            if grad is None:
                # An unused parameter still owes its slice a gradient, or a sync clock never completes.
                grad = self._zero_grad_of(key)
            if grad.is_sparse:
                raise InvalidArgumentError(f"param {key!r}: sparse gradients are not supported")
            tensors[key] = _declared(grad.detach())
        return self._staging.to_host(tensors)

    def _landing(self) -> dict[str, np.ndarray]:
        """Where the pulled values land: CPU weights straight in the parameters, else a host buffer."""
        out: dict[str, np.ndarray] = {}
        for key, p in self.params.items():
            if not self.aggregate and _writable_in_place(p):
                out[key] = p.detach().numpy()
                continue
            out[key] = self._host_buffer(key)
        return out

    def _load(self, out: dict[str, np.ndarray], grads: bool = False) -> None:
        if grads:
            targets = {}
            for key, p in self.params.items():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                targets[key] = p.grad
            self._staging.to_device(out, targets)
            return
        staged = {k: a for k, a in out.items() if a is self._buffers.get(k)}
        if staged:
            self._staging.to_device(staged, {k: self.params[k].detach() for k in staged})


def _declared_dtype(p: torch.Tensor) -> torch.dtype:
    return p.dtype if p.dtype in _NATIVE else torch.float32


def _declared(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in _NATIVE else t.float()


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return dtypes.of_torch(dtype).numpy


def _writable_in_place(p: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype in _NATIVE and p.is_contiguous()
