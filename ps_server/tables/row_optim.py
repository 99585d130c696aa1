"""Per-row optimizers of sparse tables, matching torch's sparse path step for step.

`nn.Embedding(sparse=True)` hands torch's optimizers a coalesced sparse gradient: only the rows
present are read and written. These functions do the same to the rows of a table
(ps_server.tables.table), with torch's operations in torch's order:

    sgd        row -= lr * g                                   (torch.optim.SGD)
    adagrad    sum += g*g; row -= lr * g / (sqrt(sum) + eps)   (torch.optim.Adagrad, lr_decay 0)
    adam       torch.optim.SparseAdam: moments of the rows present only, bias correction by the
               table's one step count (the number of pushes applied to it)
    lazy_adam  the same update, but bias-corrected by each row's own step count, so a rare row's
               first update is as large as a frequent row's first update

A table runs sgd and adagrad through compiled in-place loops (ps_server.tables.kernels) that compute
exactly this, in this order; these functions are their reference (tests/unit/test_kernels.py).

`rows` and `grads` are (n, dim) arrays of the table's dtype; `state` maps a state name to the
(n, dim) gathered state of the same rows. Each function returns the new rows and updates `state`
in place; the caller scatters both back.
"""

from __future__ import annotations

import math

import numpy as np
from pshard.common.sparse import TableConfig

STATE_NAMES = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq"),
               "lazy_adam": ("exp_avg", "exp_avg_sq")}


def initial_state(config: TableConfig, name: str) -> float:
    return config.initial_accumulator_value if name == "sum" else 0.0


def apply(config: TableConfig, rows: np.ndarray, grads: np.ndarray, state: dict[str, np.ndarray],
          step: int | np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """New values of `rows` after one update with `grads`; `step` counts this update (from 1):
    the table's step for adam, each row's own (an (n,) array) for lazy_adam. `rows` is the caller's
    gathered copy and may be updated in place; `scratch`, an array like `rows` the caller keeps
    between requests, holds sgd's and adagrad's temporaries (fresh ones would cost page faults)."""
    dt = rows.dtype.type
    lr = dt(config.lr)
    tmp = scratch
    if config.optimizer == "sgd":
        rows -= np.multiply(grads, lr, out=tmp)
        return rows
    if config.optimizer == "adagrad":
        acc = state["sum"]
        acc += np.multiply(grads, grads, out=tmp)
        std = np.sqrt(acc, out=tmp)
        std += dt(config.eps)
        rows -= np.multiply(np.divide(grads, std, out=tmp), lr, out=tmp)  # rows - lr * (grads / std)
        return rows
    beta1, beta2 = config.betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    old_m, old_v = m.copy(), v.copy()
    m_update = (grads - old_m) * dt(1 - beta1)
    m += m_update
    v_update = (grads * grads - old_v) * dt(1 - beta2)
    v += v_update
    numer = m_update + old_m
    denom = np.sqrt(v_update + old_v)
    denom += dt(config.eps)
    if isinstance(step, np.ndarray):  # lazy_adam: one step size per row
        s = step.astype(np.float64)
        size = (config.lr * np.sqrt(1 - beta2 ** s) / (1 - beta1 ** s)).astype(rows.dtype)[:, None]
    else:
        size = dt(config.lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step))
    return rows + (-size) * (numer / denom)
