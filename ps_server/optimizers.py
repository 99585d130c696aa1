"""Server-side optimizers with per-slice state, numerically matching torch.optim.

SKELETON: the interface is fixed; the full set (momentum, Nesterov, Adam, AdamW,
Adagrad, aggregate) is being written.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ps_common.job import OptimizerConfig

# Per-slice optimizer state: named arrays (same shape as the slice) and scalars such as the step count.
# Plain data, so a checkpoint can store it with np.savez and JSON (never pickle).
SliceState = dict[str, "np.ndarray | float | int"]


class Optimizer(Protocol):
    config: OptimizerConfig

    def init_state(self, param: np.ndarray) -> SliceState:
        """Fresh state for one slice (called once, when the slice is declared)."""
        ...

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        """Update `param` in place with `grad` (already averaged), advancing `state`."""
        ...


class SGD:
    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config

    def init_state(self, param: np.ndarray) -> SliceState:
        return {}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        param -= np.asarray(self.config.lr, dtype=param.dtype) * grad


def make_optimizer(config: OptimizerConfig) -> Optimizer:
    if config.name == "sgd":
        return SGD(config)
    raise NotImplementedError(config.name)
