"""Server-side optimizers with per-slice state, numerically matching torch.optim.

Each optimizer reproduces torch 2.13's single-tensor algorithm (foreach=False,
maximize=False, capturable=False, differentiable=False) with the operations in
torch's order and every Python-float hyper-parameter rounded to the param's dtype
where torch's CPU kernels round it. What numpy cannot copy is fusion: torch's
vectorised `add(alpha=)`, `addcmul` and `lerp` use one fused multiply-add (one
rounding) where numpy rounds the product and then the sum, so results differ from
torch by about one ulp per such operation (tests/unit/test_optimizers.py bounds it).

State is plain data, named as in torch's optimizer state, so a checkpoint stores it
with np.savez + JSON (never pickle) and it maps onto a torch state_dict:

    sgd        {} without momentum;
               {"step": int, "momentum_buffer": array} with momentum
    adam/adamw {"step": int, "exp_avg": array, "exp_avg_sq": array}
               + {"max_exp_avg_sq": array} with amsgrad
    adagrad    {"step": int, "sum": array}
    aggregate  {}

Arrays have the slice's shape and dtype; "step" counts the updates applied.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, cast

import numpy as np
from pshard.common.errors import DTypeMismatchError
from pshard.common.job import OptimizerConfig
from pshard.common.wire.dtypes import MASTER_DTYPES

# Per-slice optimizer state: named arrays (same shape as the slice) and scalars such as the step count.
# Plain data, so a checkpoint can store it with np.savez and JSON (never pickle).
SliceState = dict[str, "np.ndarray | float | int"]

# The dtypes optimizers compute in: the masters of every parameter dtype (pshard.common.wire.dtypes).
PARAM_DTYPES = tuple(np.dtype(name) for name in MASTER_DTYPES)


class Optimizer(Protocol):
    config: OptimizerConfig

    def init_state(self, param: np.ndarray) -> SliceState:
        """Fresh state for one slice (called once, when the slice is declared)."""
        ...

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        """Update `param` in place with `grad` (already averaged), advancing `state`."""
        ...


def fold_scale(optimizer: Optimizer) -> bool:
    """Whether `SGD.step_scaled(param, sum, 1/n)` may replace dividing the sum first."""
    return (isinstance(optimizer, SGD) and optimizer.config.momentum == 0
            and optimizer.config.weight_decay == 0)


# Slices up to this size take fresh temporaries: malloc serves them from memory it already holds,
# faster than the pool's locked hand-out (which exists for multi-MiB slices' page faults).
_SMALL_BYTES = 64 * 1024


class _ScratchPool:
    """Reusable scratch arrays, shared by all threads that apply updates.

    Allocating a fresh 4 MiB temporary per operation costs page faults on every step;
    a pool (rather than one buffer per thread) keeps memory proportional to the number
    of updates running at once, not to the size of the server's thread pool.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    @contextmanager
    def borrow(self, like: np.ndarray, count: int) -> Iterator[list[np.ndarray]]:
        """`count` uninitialised arrays with the shape and dtype of `like`."""
        raw = [self._take(like.nbytes) for _ in range(count)]
        try:
            yield [buf[: like.nbytes].view(like.dtype).reshape(like.shape) for buf in raw]
        finally:
            with self._lock:
                self._free.extend(raw)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
            if self._free:
                # Replace a too-small buffer instead of adding one, so the pool holds
                # at most as many buffers as were ever borrowed at the same time.
                self._free.pop()
        # Round up so slices of slightly different sizes share buffers.
        return np.empty(max(4096, 1 << (nbytes - 1).bit_length()), dtype=np.uint8)


def _check_dtype(param: np.ndarray) -> None:
    if param.dtype not in PARAM_DTYPES:
        raise DTypeMismatchError(
            f"optimizer state: got a {param.dtype} slice, expected float32 or float64 "
            f"(the store keeps float32 master copies of half-precision parameters)"
        )


def _array(state: SliceState, key: str) -> np.ndarray:
    return cast(np.ndarray, state[key])


def _next_step(state: SliceState) -> int:
    # int(): a step restored from a checkpoint's JSON may come back as a float.
    step = int(state["step"]) + 1
    state["step"] = step
    return step


def _l2_grad(param: np.ndarray, grad: np.ndarray, weight_decay: float, out: np.ndarray) -> np.ndarray:
    """torch's `grad.add(param, alpha=weight_decay)`: a new array; the caller's grad stays untouched."""
    if weight_decay == 0:
        return grad
    np.multiply(param, param.dtype.type(weight_decay), out=out)
    out += grad
    return out


def _lerp_(start: np.ndarray, end: np.ndarray, weight: float, scratch: np.ndarray) -> None:
    """torch's `start.lerp_(end, weight)`, including its switch of formula at weight 0.5."""
    w = start.dtype.type(weight)
    np.subtract(end, start, out=scratch)
    if abs(w) < 0.5:
        scratch *= w
        start += scratch
    else:
        # Anchored at `end` so that weight 1 (beta1 = 0) gives exactly `end`, as in torch.
        scratch *= w - start.dtype.type(1)
        np.add(end, scratch, out=start)


class SGD:
    """torch.optim.SGD: momentum (torch's form: the first step's buffer is the gradient, undamped),
    dampening, Nesterov, L2 weight decay."""

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config
        self._scratch = _ScratchPool()

    def init_state(self, param: np.ndarray) -> SliceState:
        _check_dtype(param)
        if self.config.momentum == 0:
            return {}
        return {"step": 0, "momentum_buffer": np.zeros_like(param)}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        c = self.config
        if not (c.momentum or c.weight_decay) and param.nbytes <= _SMALL_BYTES and grad.dtype == param.dtype:
            # The same two operations on a small slice, whose temporary costs less than borrowing.
            param += np.multiply(grad, param.dtype.type(-c.lr))
            return
        with self._scratch.borrow(param, 2) as (decayed, update):
            d_p = _l2_grad(param, grad, c.weight_decay, out=decayed)
            if c.momentum != 0:
                d_p = self._momentum(d_p, state, out=update)
            # torch: param.add_(d_p, alpha=-lr)
            np.multiply(d_p, param.dtype.type(-c.lr), out=update)
            param += update

    def step_scaled(self, param: np.ndarray, grad_sum: np.ndarray, scale: float) -> None:
        """Plain SGD on the mean `grad_sum * scale` in two passes instead of three: the sync
        aggregate's division folds into the learning rate (`fold_scale` says when). The rounding
        differs from dividing first by at most an ulp or so per element."""
        np.multiply(grad_sum, param.dtype.type(-self.config.lr * scale), out=grad_sum)
        param += grad_sum

    def _momentum(self, d_p: np.ndarray, state: SliceState, out: np.ndarray) -> np.ndarray:
        """Advance the momentum buffer; return the direction to step along (the buffer or `out`)."""
        c = self.config
        buf = _array(state, "momentum_buffer")
        m = buf.dtype.type(c.momentum)
        if _next_step(state) == 1:
            np.copyto(buf, d_p)
        else:
            buf *= m
            if c.dampening == 0:
                buf += d_p  # torch's alpha=1 multiplies exactly: the same single rounding
            else:
                np.multiply(d_p, buf.dtype.type(1 - c.dampening), out=out)
                buf += out
        if not c.nesterov:
            return buf
        # torch: d_p.add(buf, alpha=momentum)
        np.multiply(buf, m, out=out)
        out += d_p
        return out


class Adam:
    """torch.optim.Adam (L2 weight decay added to the gradient), or with `decoupled`
    torch.optim.AdamW (param *= 1 - lr * weight_decay before the Adam step)."""

    def __init__(self, config: OptimizerConfig, decoupled: bool = False) -> None:
        self.config = config
        self.decoupled = decoupled
        self._scratch = _ScratchPool()

    def init_state(self, param: np.ndarray) -> SliceState:
        _check_dtype(param)
        state: SliceState = {"step": 0, "exp_avg": np.zeros_like(param), "exp_avg_sq": np.zeros_like(param)}
        if self.config.amsgrad:
            state["max_exp_avg_sq"] = np.zeros_like(param)
        return state

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        c = self.config
        beta1, beta2 = c.betas
        dtype = param.dtype.type
        step = _next_step(state)
        exp_avg, exp_avg_sq = _array(state, "exp_avg"), _array(state, "exp_avg_sq")
        with self._scratch.borrow(param, 2) as (s1, s2):
            if self.decoupled:
                if c.weight_decay != 0:
                    param *= dtype(1 - c.lr * c.weight_decay)
                g = grad
            else:
                g = _l2_grad(param, grad, c.weight_decay, out=s1)
            _lerp_(exp_avg, g, 1 - beta1, scratch=s2)
            # torch: exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2); addcmul
            # computes (value * g) * g, in that order.
            exp_avg_sq *= dtype(beta2)
            np.multiply(g, dtype(1 - beta2), out=s2)
            s2 *= g
            exp_avg_sq += s2
            second = exp_avg_sq
            if c.amsgrad:
                second = _array(state, "max_exp_avg_sq")
                np.maximum(second, exp_avg_sq, out=second)
            # Bias corrections in Python floats (double), as torch computes them from step.item().
            step_size = c.lr / (1 - beta1**step)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            # torch: denom = (sqrt(v) / bias_correction2_sqrt).add_(eps); a true division, not
            # a multiplication by the reciprocal, which would round differently.
            denom = np.sqrt(second, out=s1)
            denom /= dtype(bias_correction2_sqrt)
            denom += dtype(c.eps)
            # torch: param.addcdiv_(exp_avg, denom, value=-step_size) = param + (value * exp_avg) / denom.
            np.multiply(exp_avg, dtype(-step_size), out=s2)
            s2 /= denom
            param += s2


class Adagrad:
    """torch.optim.Adagrad: lr decayed as lr / (1 + (step - 1) * lr_decay), L2 weight decay,
    accumulator starting at initial_accumulator_value."""

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config
        self._scratch = _ScratchPool()

    def init_state(self, param: np.ndarray) -> SliceState:
        _check_dtype(param)
        return {"step": 0, "sum": np.full_like(param, self.config.initial_accumulator_value)}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        c = self.config
        dtype = param.dtype.type
        step = _next_step(state)
        state_sum = _array(state, "sum")
        clr = c.lr / (1 + (step - 1) * c.lr_decay)
        with self._scratch.borrow(param, 2) as (s1, std):
            g = _l2_grad(param, grad, c.weight_decay, out=s1)
            np.multiply(g, g, out=std)
            state_sum += std
            np.sqrt(state_sum, out=std)
            std += dtype(c.eps)
            # torch: param.addcdiv_(g, std, value=-clr) = param + (value * g) / std.
            np.multiply(g, dtype(-clr), out=s1)
            s1 /= std
            param += s1


class Aggregate:
    """Aggregate-only mode: the slice holds the mean gradient; the worker runs its own optimizer."""

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config

    def init_state(self, param: np.ndarray) -> SliceState:
        _check_dtype(param)
        return {}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        np.copyto(param, grad)


_FACTORIES: dict[str, Callable[[OptimizerConfig], Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": lambda config: Adam(config, decoupled=True),
    "adagrad": Adagrad,
    "aggregate": Aggregate,
}


def make_optimizer(config: OptimizerConfig) -> Optimizer:
    """The optimizer named by `config.name` (OptimizerConfig has already checked the name)."""
    return _FACTORIES[config.name](config)


def at_lr(optimizer: Optimizer, lr: float | None) -> Optimizer:
    """`optimizer` stepping with learning rate `lr` (a push's stamp; None = its own). The state is the
    slice's, not the optimizer's, so a copy with another lr takes the very same step otherwise."""
    if lr is None or lr == optimizer.config.lr or isinstance(optimizer, Aggregate):
        return optimizer
    return _with_lr(optimizer.config, lr)


@functools.lru_cache(maxsize=32)  # a schedule revisits few values per stretch; each copy holds a scratch pool
def _with_lr(config: OptimizerConfig, lr: float) -> Optimizer:
    return make_optimizer(dataclasses.replace(config, lr=lr))
