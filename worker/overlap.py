"""Push/pull overlapped with backward and with the next forward (`PSTrainer(overlap=True)`).

Without overlap a step is compute, then one fused push+pull of every gradient: the network waits
for backward, and the next forward waits for the network. Here, as in BytePS's priority
scheduling:

* Parameters are grouped into buckets in reverse registration order, which is roughly the order
  backward produces their gradients (last layer first). A bucket closes once it holds
  `bucket_bytes`, so a model is a few exchanges, not one per tensor.
* A post-accumulate-grad hook on every parameter notes its gradient. When a bucket's last gradient
  arrives, the bucket's fused push+pull is queued on one communication thread, while backward goes
  on with the earlier layers. One thread keeps the buckets in order: the last layer's bucket, which
  is ready first, also travels first. The order must be the same on every worker: in sync mode a
  bucket's fused push+pull waits for the other workers' pushes of that bucket, so a worker that
  sent the first layers' bucket ahead of its turn (BytePS's priority, tried) waits for a peer whose
  one thread waits for it in turn.
* Layer priority (`priority=True`, ByteScheduler's) therefore splits the exchange: pushes go on one
  thread, the queued bucket nearest the model's input first (pshard.worker.priority), and pulls on
  another, in one fixed order, the first layers' bucket first. A sync push never waits for the other
  workers; a bucket's pull is sent after this worker's push of it. That cannot deadlock, even where a
  fast path carries one request at a time per server and a waiting pull holds it from the pushes:
  when this worker waits in its pull of bucket k, a peer either still has to push k (its pushes wait
  for nothing but a pull of its own, which precedes k in the fixed order and so completes, since
  this worker pulled it) or has already pulled k, so k's clock is complete. Pulls start when backward
  ends (the first layer's gradient is its last), so priority pays where the link, not compute,
  bounds a step.
* `finish_step` (PSTrainer.step) queues what backward did not complete (unused parameters owe
  their slice a zero gradient, or a sync clock never completes) and returns without waiting.
* The pulled weights land in host buffers, not in the parameters. A forward pre-hook on each module
  waits for the buckets of that module's own parameters and copies them in just before the module
  runs: the next forward waits only for the layers it has reached. Parameters therefore change
  only when their module is about to use them (or at `settle`), never under a running backward.

Sync semantics are unchanged: every slice still receives exactly one gradient per worker and clock
(the servers keep at-most-once bookkeeping per slice, so a step split in buckets is the same step).
The clock of the next step is known only when every bucket's reply is in; `settle` waits for them.

Requires one backward per step (the hook pushes the gradient as accumulated at that moment), which
is what `PSTrainer.step()` after each `backward()` means anyway.

CUDA: a hook runs on the autograd thread and only records an event on the current stream; the
communication thread makes a dedicated copy stream wait for that event and copies the gradients into
pinned host buffers there, so backward's kernels are never synchronised by the push.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from pshard.client.ps_client import PSClient, PushResult
from pshard.worker.device import HostStaging
from pshard.worker.priority import PushQueue, take_one
from torch import nn

# A bucket is one exchange with every server, about 1.3 ms of fixed cost each (GPU check, ResNet-18 on an
# H200: 17 buckets of 256 KiB took 56 ms of exchanges a step, 5 of 8 MiB 35 ms); the client's slice size.
DEFAULT_BUCKET_BYTES = 4 * 2**20


# A gradient as a hook saw it, with the CUDA event after which it is complete (None on the CPU).
_Grad = tuple[torch.Tensor, "torch.cuda.Event | None"]


@dataclass
class _Bucket:
    index: int
    keys: tuple[str, ...]
    # This step's gradients so far: key -> (tensor, CUDA event or None).
    grads: dict[str, _Grad] = field(default_factory=dict)
    sent: bool = False  # this step's exchange is queued
    # The last exchange whose pulled weights are not in the parameters yet (with priority: its pull).
    inflight: Future[PushResult] | None = None
    pushed: Future[PushResult] | None = None  # with priority: this step's push, until its pull is queued


def plan_buckets(params: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[tuple[str, ...]]:
    """Keys in reverse registration order, cut into buckets of at least `bucket_bytes` (the last may
    be smaller)."""
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for key in reversed(list(params)):
        p = params[key]
        current.append(key)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    return buckets


class BackwardOverlap:
    """The hooks, buckets and communication thread of one PSTrainer (see the module docstring).

    `next_clock()` gives the clock a step pushes for (the trainer settles the previous step's replies
    to know it); `landing(keys)` the host buffers the pulled weights land in, the same every step;
    `load(arrays)` copies them into the parameters; `zeros(key)` is the gradient of a parameter that
    backward left without one. `priority`: pushes by layer priority and pulls apart (the module docstring).
    """

    def __init__(self, model: nn.Module, params: Mapping[str, torch.Tensor], client: PSClient,
                 staging: HostStaging, next_clock: Callable[[], int],
                 landing: Callable[[Iterable[str]], dict[str, np.ndarray]],
                 load: Callable[[Mapping[str, np.ndarray]], None],
                 zeros: Callable[[str], torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 priority: bool = False) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: got {bucket_bytes}, expected > 0")
        self._params = dict(params)
        self._client = client
        self.step_lr: float | None = None  # the lr the step's pushes carry (a schedule's; None: the job's)
        self._staging = staging
        self._next_clock = next_clock
        self._landing = landing
        self._load = load
        self._zeros = zeros
        self.buckets = [_Bucket(i, keys) for i, keys in enumerate(plan_buckets(params, bucket_bytes))]
        self._bucket_of = {key: b for b in self.buckets for key in b.keys}
        self._lock = threading.Lock()  # hooks run on autograd's threads, the rest on the caller's
        self._clock: int | None = None  # the clock this backward pushes for; None between steps
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pshard-overlap")
        self.priority = priority
        self._queue: PushQueue[Callable[[], None]] = PushQueue()
        self._pulls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pshard-overlap-pull") \
            if priority else None
        self._cuda = staging.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(staging.device) if self._cuda else None
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready(key))
                         for key, p in self._params.items()]
        owners: dict[nn.Module, list[_Bucket]] = {}
        for module in model.modules():
            own = {id(p) for p in module.parameters(recurse=False)}
            mine = [b for b in self.buckets if any(id(self._params[k]) in own for k in b.keys)]
            if mine:
                owners[module] = mine
        self._handles += [m.register_forward_pre_hook(self._pre_forward(bs)) for m, bs in owners.items()]

    # ---- the step, as PSTrainer drives it ----

    def step_clock(self) -> int:
        """The clock of the step under way (its first gradient, or this call, starts it)."""
        with self._lock:
            return self._begin()

    def finish_step(self) -> list[Future[PushResult]]:
        """Queue every bucket backward did not complete; the futures of the whole step."""
        with self._lock:
            clock = self._begin()
            for bucket in self.buckets:
                if not bucket.sent:
                    for key in bucket.keys:
                        if key not in bucket.grads:
                            grad = self._params[key].grad
                            bucket.grads[key] = (grad.detach() if grad is not None else self._zeros(key),
                                                 self._event())
                    self._send(bucket)
            if self._pulls is not None:
                self._queue_pulls(clock)
            futures = [b.inflight for b in self.buckets if b.inflight is not None]
            for bucket in self.buckets:
                bucket.sent = False
            self._clock = None
        return futures

    def land(self, buckets: Iterable[_Bucket] | None = None) -> None:
        """Copy the pulled weights of `buckets` (default: all) into the parameters, waiting for them."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.inflight is not None:
                self._client.wait(bucket.inflight)  # raises what the exchange raised
                self._load(self._landing(bucket.keys))
                bucket.inflight = None

    def discard(self) -> None:
        """Forget what the last step pulled (aggregate mode: mean gradients, loaded elsewhere)."""
        for bucket in self.buckets:
            bucket.inflight = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._comm.shutdown(wait=True)
        if self._pulls is not None:
            self._pulls.shutdown(wait=True)

    # ---- hooks ----

    def _begin(self) -> int:
        """(The lock is held.) By a step's first gradient the forward has waited for every bucket it
        used, so settling the previous step here rarely waits."""
        if self._clock is None:
            self._clock = self._next_clock()
        return self._clock

    def _grad_ready(self, key: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            with self._lock:
                if param.grad is None:
                    return
                self._begin()
                bucket = self._bucket_of[key]
                if bucket.sent:
                    return  # already sent this step: a second backward is not a step of its own
                bucket.grads[key] = (param.grad.detach(), self._event())
                if len(bucket.grads) == len(bucket.keys):
                    self._send(bucket)
        return hook

    def _pre_forward(self, buckets: list[_Bucket]) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            self.land(buckets)
        return hook

    # ---- the communication thread ----

    def _event(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._staging.device))
        return event

    def _send(self, bucket: _Bucket) -> None:
        """Queue the bucket's push+pull (the lock is held)."""
        assert self._clock is not None
        grads, clock = dict(bucket.grads), self._clock
        bucket.grads.clear()
        bucket.sent = True
        if not self.priority:
            bucket.inflight = self._comm.submit(self._exchange, bucket.keys, grads, clock, self.step_lr)
            return
        pushed: Future[PushResult] = Future()
        bucket.pushed = pushed
        keys, lr = bucket.keys, self.step_lr

        def send() -> None:
            if pushed.set_running_or_notify_cancel():
                try:
                    pushed.set_result(self._push(keys, grads, clock, lr))
                except BaseException as err:  # the pull that waits for it raises it
                    pushed.set_exception(err)

        self._queue.put(clock, bucket.index, send)
        self._comm.submit(take_one, self._queue)  # one take per put: the most urgent send at that time

    def _queue_pulls(self, clock: int) -> None:
        """(The lock is held.) The step's pulls, first layers first: the same order on every worker."""
        assert self._pulls is not None
        for bucket in reversed(self.buckets):
            if bucket.pushed is not None:
                bucket.inflight = self._pulls.submit(self._pull, bucket.keys, bucket.pushed, clock)
                bucket.pushed = None

    def _pull(self, keys: tuple[str, ...], pushed: Future[PushResult], clock: int) -> PushResult:
        push = self._client.wait(pushed)  # never before our own push of these keys (see the docstring)
        pulled = self._client.pull_into(clock + 1, keys, self._landing(keys))
        return PushResult(push.applied, push.dropped, pulled.min_version, pulled.max_version)

    def _push(self, keys: tuple[str, ...], grads: Mapping[str, _Grad], clock: int,
              lr: float | None) -> PushResult:
        return self._client.wait(self._client.push(self._to_host(grads), clock, lr=lr))

    def _to_host(self, grads: Mapping[str, _Grad]) -> dict[str, np.ndarray]:
        if self._copy_stream is not None:
            for tensor, event in grads.values():
                assert event is not None
                self._copy_stream.wait_event(event)
                # The caching allocator must not hand this memory out again before the copy is done:
                # with zero_grad(set_to_none=True) the trainer drops its last reference meanwhile.
                tensor.record_stream(self._copy_stream)
            with torch.cuda.stream(self._copy_stream):
                return self._staging.to_host({k: t for k, (t, _) in grads.items()})
        return self._staging.to_host({k: t for k, (t, _) in grads.items()})

    def _exchange(self, keys: tuple[str, ...], grads: Mapping[str, _Grad], clock: int,
                  lr: float | None) -> PushResult:
        host = self._to_host(grads)
        out = self._landing(keys)
        self._client.push_pull(host, clock, out=out, lr=lr)
        result = self._client.last_result
        assert result is not None  # push_pull records what it did; only this thread calls it
        return result


def merge_results(results: Iterable[PushResult]) -> PushResult:
    """One step's outcome from its buckets' outcomes."""
    results = list(results)
    versions = [r for r in results if r.max_version or r.min_version]
    return PushResult(sum(r.applied for r in results), sum(r.dropped for r in results),
                      min((r.min_version for r in versions), default=0),
                      max((r.max_version for r in versions), default=0))
