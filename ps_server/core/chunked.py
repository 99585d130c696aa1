"""A slice's optimizer step and sync sums run over a ChunkPool (pshard.common.chunks).

Every optimizer here is element-wise: element i of the new value and state depends only on element i
of the old ones, the gradient and the scalars (step count, learning rate). So a step applied chunk by
chunk, each chunk with its own view of the state's arrays and its own copy of the scalars, gives the
same bits as one step over the whole slice, and every chunk advances the scalars alike.
"""

from __future__ import annotations

import numpy as np
from pshard.common.chunks import ChunkPool
from pshard.ps_server.core.optimizers import SGD, Optimizer, SliceState


def _chunkable(param: np.ndarray, arrays: list[np.ndarray], pool: ChunkPool) -> bool:
    # Flat views of the value and state need C order; anything else (never made by the store) runs whole.
    return (pool.splits(param.size) and param.flags.c_contiguous
            and all(a.shape == param.shape and a.flags.c_contiguous for a in arrays))


def step(pool: ChunkPool, optimizer: Optimizer, param: np.ndarray, grad: np.ndarray,
         state: SliceState) -> None:
    """`optimizer.step(param, grad, state)`, chunk by chunk over `pool`."""
    if pool.threads == 1 or not pool.splits(param.size):  # a pool of one, or a small slice: as it is
        optimizer.step(param, grad, state)
        return
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    if not _chunkable(param, [*arrays.values(), grad], pool):
        optimizer.step(param, grad, state)
        return
    scalars = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    flat = {k: a.reshape(-1) for k, a in arrays.items()}
    p, g = param.reshape(-1), grad.reshape(-1)
    pieces: dict[int, SliceState] = {}

    def one(lo: int, hi: int) -> None:
        piece: SliceState = {**scalars, **{k: a[lo:hi] for k, a in flat.items()}}
        pieces[lo] = piece
        optimizer.step(p[lo:hi], g[lo:hi], piece)

    pool.run(one, param.size)
    # Every chunk started from the same scalars and advanced them alike (the step count).
    state.update({k: v for k, v in pieces[0].items() if k in scalars})


def step_scaled(pool: ChunkPool, optimizer: SGD, param: np.ndarray, grad_sum: np.ndarray,
                scale: float) -> None:
    """`optimizer.step_scaled(param, grad_sum, scale)`, chunk by chunk over `pool`."""
    if not _chunkable(param, [grad_sum], pool):
        optimizer.step_scaled(param, grad_sum, scale)
        return
    p, g = param.reshape(-1), grad_sum.reshape(-1)
    pool.run(lambda lo, hi: optimizer.step_scaled(p[lo:hi], g[lo:hi], scale), param.size)


def accumulate(pool: ChunkPool, total: np.ndarray, grad: np.ndarray, first: bool) -> None:
    """total = grad (the clock's first gradient) or total += grad, in place."""
    if not _chunkable(total, [grad], pool):
        if first:
            np.copyto(total, grad)
        else:
            np.add(total, grad, out=total)
        return
    t, g = total.reshape(-1), grad.reshape(-1)
    if first:
        pool.run(lambda lo, hi: np.copyto(t[lo:hi], g[lo:hi]), total.size)
    else:
        pool.run(lambda lo, hi: np.add(t[lo:hi], g[lo:hi], out=t[lo:hi]), total.size)


def divide(pool: ChunkPool, total: np.ndarray, count: int) -> None:
    """total /= count, in place."""
    if not _chunkable(total, [], pool):
        total /= count
        return
    t = total.reshape(-1)

    def one(lo: int, hi: int) -> None:
        t[lo:hi] /= count

    pool.run(one, total.size)
