"""The GPU check's diagnostic: where a PSTrainer step's time goes (bench.gpu_check, line "profile").

The training figures say how much slower than local torch.optim a step is; this says why. One worker,
2 servers over shared memory, a few steps with and without overlap, each timed phase by phase. Only
here, the steps are cut by `torch.cuda.synchronize()` between phases, so each phase's figure holds its
own GPU work (and these steps are slower than the training figures' steps, which are not cut).

How the phases are measured: the trainer's own objects are wrapped, per instance, in timers that
add up the time spent in them (no copy of the trainer's logic that could drift from it):

- `HostStaging.to_host` (gradients to the host, the wait for the copies included) and `to_device`
  (weights to the device; a synchronize follows it, so its copies are inside the figure);
- `PSClient.push_pull`, and within it, per server, each fast path's `_send` (writing the request
  into shared memory and ringing), its inbox's `frame_head` (waiting for the reply: the server's
  work and the wake-up) and the rest of `_receive` (copying the reply out of shared memory);
- with overlap: `PSClient.wait` (forward's pre-hooks and settle waiting for a bucket's reply),
  the trainer's per-bucket load (H2D) and the communication thread's `_exchange`.

The servers run on other threads of their own processes: the figures per server are summed over
the servers (they run in parallel, so they may add up to more than push_pull's wall time).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from bench.gpu_models import build
from bench.gpu_runs import Shape, _sync, _trainer, synthetic

PROFILE_STEPS = 12
PROFILE_WARMUP = 3
SMALL_BUCKET_BYTES = 256 * 1024  # the overlap variant with many small buckets (the default before 4 MiB)


class Phases:
    """Seconds and calls per named phase, added up from any thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.items: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float, items: int = 0) -> None:
        with self._lock:
            self.seconds[name] += seconds
            self.calls[name] += 1
            self.items[name] += items

    def reset(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.calls.clear()
            self.items.clear()

    def timed(self, name: str, fn: Callable[..., Any], count: Callable[..., int] | None = None,
              after: Callable[[], None] | None = None) -> Callable[..., Any]:
        """`fn` that adds its time to `name` (with `after`, e.g. a synchronize, inside the time)."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if after is not None:
                    after()
                self.add(name, time.perf_counter() - began, count(*args, **kwargs) if count else 0)
        return wrapper


def _first_len(*args: Any, **_: Any) -> int:
    return len(args[0])


def _instrument(trainer: Any, phases: Phases, device: torch.device) -> None:
    """Wrap the trainer's staging, client and fast paths (instance attributes shadow the methods)."""
    staging = trainer._staging
    staging.to_host = phases.timed("d2h", staging.to_host, count=_first_len)
    staging.to_device = phases.timed("h2d", staging.to_device, count=_first_len, after=lambda: _sync(device))
    client = trainer.client
    client.push_pull = phases.timed("push_pull", client.push_pull)
    client.wait = phases.timed("wait_reply", client.wait)
    for fast in client.connections.sessions():
        if fast is None:
            continue
        fast._send = phases.timed("shm_request_copy", fast._send)
        _split_receive(fast, phases)
    overlap = trainer._overlap
    if overlap is not None:
        overlap._exchange = phases.timed("comm_thread_exchange", overlap._exchange)


def _split_receive(fast: Any, phases: Phases) -> None:
    """A fast path's reply time, split: waiting for the reply's head (the server's work and the
    wake-up) and the rest (copying the reply out of shared memory). Per path: one request at a time."""
    waited = [0.0]
    head, receive = fast._inbox.frame_head, fast._receive

    def head_timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return head(*args, **kwargs)
        finally:
            spent = time.perf_counter() - began
            waited[0] += spent
            phases.add("server_and_wakeup", spent)

    def receive_timed(*args: Any, **kwargs: Any) -> Any:
        before, began = waited[0], time.perf_counter()
        try:
            return receive(*args, **kwargs)
        finally:
            phases.add("shm_reply_copy", time.perf_counter() - began - (waited[0] - before))

    fast._inbox.frame_head = head_timed
    fast._receive = receive_timed


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # no accelerator to ask
        return False


def _buffers_state(trainer: Any) -> dict[str, Any]:
    staging = trainer._staging
    up, down = list(staging._up.values()), list(staging._down.values())
    landing = list(trainer._buffers.values())
    return {"staging_up_buffers": len(up), "staging_up_pinned": bool(up) and all(_pinned(b) for b in up),
            "staging_down_buffers": len(down),
            "staging_down_pinned": bool(down) and all(_pinned(b) for b in down),
            # The host arrays the pulled weights land in (shared memory -> these -> staging -> device).
            "landing_buffers": len(landing),
            "landing_buffers_pinned": bool(landing) and all(
                _pinned(torch.from_numpy(np.asarray(a))) for a in landing)}


def profile_run(shape: Shape, device: torch.device, addresses: list[str], overlap: bool,
                bucket_bytes: int | None = None, steps: int = PROFILE_STEPS,
                warmup: int = PROFILE_WARMUP) -> dict[str, Any]:
    """Mean ms per step of each phase of `steps` steps of worker w0 (after `warmup` untimed ones).

    The servers at `addresses` (sync, quorum w0) may have trained before: the trainer continues
    at their clock, as a restarted worker does."""
    trainer = _trainer(shape, device, addresses, "w0", overlap, bucket_bytes)
    model = trainer.model
    batches = synthetic(shape, device, seed=1)
    phases = Phases()
    try:
        for i in range(warmup):
            trainer.zero_grad()
            F.cross_entropy(model(batches[i % len(batches)][0]), batches[i % len(batches)][1]).backward()
            trainer.step()
        trainer.synchronize()
        _sync(device)
        _instrument(trainer, phases, device)
        phases.reset()
        began = time.perf_counter()
        for i in range(steps):
            forward, backward, step = _split_step(model, *batches[i % len(batches)], trainer.zero_grad,
                                                  trainer.step, device)
            phases.add("forward", forward)
            phases.add("backward", backward)
            phases.add("step_call", step)
        trainer.synchronize()
        _sync(device)
        total = time.perf_counter() - began
        state = _buffers_state(trainer)
        buckets = len(trainer._overlap.buckets) if trainer._overlap is not None else None
        transports = list(trainer.client.transports)
    finally:
        trainer.close()
    per_step = {f"{name}_ms": round(1000 * s / steps, 3) for name, s in sorted(phases.seconds.items())}
    return {"overlap": overlap, "bucket_bytes": bucket_bytes if overlap else None, "buckets": buckets,
            "steps": steps, "step_ms": round(1000 * total / steps, 3), **per_step,
            "d2h_copies_per_step": phases.items["d2h"] / steps,
            "h2d_copies_per_step": phases.items["h2d"] / steps,
            "d2h_calls_per_step": phases.calls["d2h"] / steps,
            "h2d_calls_per_step": phases.calls["h2d"] / steps,
            "push_pull_calls_per_step": phases.calls["push_pull"] / steps,
            **state, "transports_used": transports}


def _split_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, zero_grad: Callable[[], object],
                step: Callable[[], object], device: torch.device) -> tuple[float, float, float]:
    """One training step cut by synchronize: (forward, backward, step) seconds. zero_grad counts with
    forward, as both loops always did."""
    t0 = time.perf_counter()
    zero_grad()
    loss = F.cross_entropy(model(x), y)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    step()
    _sync(device)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def local_phases(shape: Shape, device: torch.device, steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """The same split for local torch.optim: forward, backward, optimizer step."""
    model = build(shape.model, shape.image, shape.classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = synthetic(shape, device, seed=1)
    spent = [0.0, 0.0, 0.0]
    for i in range(PROFILE_WARMUP + steps):
        times = _split_step(model, *batches[i % len(batches)], optimizer.zero_grad, optimizer.step, device)
        if i >= PROFILE_WARMUP:
            for k, d in enumerate(times):
                spent[k] += d
    return {"forward_ms": round(1000 * spent[0] / steps, 3), "backward_ms": round(1000 * spent[1] / steps, 3),
            "optimizer_ms": round(1000 * spent[2] / steps, 3)}


def bandwidth(nbytes: int, device: torch.device, repeat: int = 3) -> dict[str, Any]:
    """What the model's bytes cost to move once, as one flat copy: the floor the phases compare to."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    got: dict[str, Any] = {"model_mb": round(nbytes / 1e6, 1), "host_memcpy_ms": round(1000 * best, 3)}
    if device.type == "cuda":
        pinned = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
        on_gpu = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

        def d2h() -> None:
            pinned.copy_(on_gpu, non_blocking=True)
            _sync(device)

        def h2d() -> None:
            on_gpu.copy_(pinned, non_blocking=True)
            _sync(device)

        d2h()
        h2d()
        got["d2h_pinned_ms"] = round(1000 * min(_timed(d2h) for _ in range(repeat)), 3)
        got["h2d_pinned_ms"] = round(1000 * min(_timed(h2d) for _ in range(repeat)), 3)
    return got


def _timed(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began
