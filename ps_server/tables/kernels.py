"""Compiled loops for the hot path of sparse tables: checks, id lookup, row gather, SGD/Adagrad updates.

A table request of a few thousand ids is bound by random reads (a table's rows lie all over
hundreds of MB), and numpy paid for them in passes: a lookup was a dozen array operations per
probe round over temporaries, a pull gathered its rows and then wrote their touch stamps in a
second random pass, and a push gathered the rows, updated the copy and scattered it back. These
loops do each row once, compiled by numba (LLVM) to machine code, and ask the memory for the rows
AHEAD of the current one (llvm.prefetch), so that their cache misses overlap. Measured in-process
on a table of 500,000 rows of 64 float32, 2,048 distinct ids per request: a pull and a push
516 -> 266 us; in the sparse bench the servers' CPU per step fell by a third.

Every kernel computes exactly what the numpy code it replaces computes, bit for bit: the same
float operations in the same order and precision (no fastmath, so LLVM neither reassociates nor
contracts a*b+c into an FMA); tests/unit/test_kernels.py checks each against its numpy reference.
They trust their inputs (no bounds checks): row numbers come from the table's own index, and
requests are validated before they reach a table (ps_server.handlers.tables).

numba compiles a kernel at its first call for each new combination of argument types (about 4 s
for every kernel and both dtypes) and caches the machine code next to this file or in
NUMBA_CACHE_DIR, so later processes load it in a fraction of a second. `warm(dtype)` makes those
first calls on tiny arrays when a table is created (TableHandlers.declare, on a thread), so no
request waits for a compilation. Importing numba takes 0.3 s and ~50 MB of anonymous memory, so
only servers that hold a table import this module (ps_server.tables.table does, lazily).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types, uint64
from numba.core import cgutils
from numba.extending import intrinsic

log = logging.getLogger("pshard.ps")


def _jit(function: Callable[..., Any]) -> Any:
    """numba.njit, cached on disk; no fastmath (results must equal numpy's bit for bit); the GIL
    released (nogil), so the process's other threads run while a kernel does.

    numba uses a cache directory only if it may write there, even to load what it holds (NUMBA_CACHE_DIR,
    else beside this file, else the user's cache): under a read-only root file system with none of them
    writable it refuses to decorate at all. Then each process compiles the kernels for itself (seconds, at
    its first table), and says so once."""
    try:
        return njit(cache=True, nogil=True, boundscheck=False, fastmath=False)(function)
    except RuntimeError as err:  # "cannot cache function ...: no locator available"
        global _uncached
        if not _uncached:
            _uncached = True
            log.warning("numba has no cache directory it may write (%s): this process compiles the table "
                        "kernels itself, a few seconds at its first table; set NUMBA_CACHE_DIR to a "
                        "writable directory to keep them", err)
        return njit(cache=False, nogil=True, boundscheck=False, fastmath=False)(function)


_uncached = False


# Rows ahead that a loop asks the memory for (llvm.prefetch) while it works on the current one: one
# at a time, each row costs a whole memory latency; asked for early, they arrive together. Measured
# on a pull and a push of 2,048 rows (500,000 x 64 float32): 370 -> 270 us with prefetching.
AHEAD = 16
# Each loop spells its prefetches out: a shared helper for them, even inlined by numba, made a pull
# and a push 25% slower (measured, interleaved; the loop around it compiled worse). sgd and adagrad
# share one push loop, branching on a flag fixed for the call: measured as fast as a loop each.
_LINE_BYTES = 64

_GOLDEN = uint64(0x9E3779B97F4A7C15)
_M1 = uint64(0xBF58476D1CE4E5B9)
_M2 = uint64(0x94D049BB133111EB)


def _prefetch_codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
    """llvm.prefetch of the element of array args[0] at index args[1:]: a read (0), kept in every
    cache level (3), of data (1). No fault and no result: a hint the memory starts on at once."""
    array_type = sig.args[0]
    view = context.make_array(array_type)(context, builder, args[0])
    where = cgutils.get_item_pointer(context, builder, array_type, view, list(args[1:]), wraparound=False)
    bytes_ptr = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [bytes_ptr, i32, i32, i32]), "llvm.prefetch.p0")
    builder.call(prefetch, [builder.bitcast(where, bytes_ptr), i32(0), i32(3), i32(1)])
    return context.get_dummy_value()


@intrinsic
def _prefetch(typingctx, array, i):  # type: ignore[no-untyped-def]
    """Ask the memory for the cache line of array[i] (1-D)."""
    return types.void(array, i), _prefetch_codegen


@intrinsic
def _prefetch2(typingctx, array, i, j):  # type: ignore[no-untyped-def]
    """Ask the memory for the cache line of array[i, j] (2-D)."""
    return types.void(array, i, j), _prefetch_codegen


@_jit
def _prefetch_row(values, r):  # type: ignore[no-untyped-def]
    """Every cache line of row r of a 2-D array."""
    for j in range(0, values.shape[1], max(1, _LINE_BYTES // values.itemsize)):
        _prefetch2(values, r, j)


@_jit
def _mix64(x):  # type: ignore[no-untyped-def]
    """pshard.common.sparse.mix64 of one uint64 (splitmix64's finaliser); uint64 arithmetic wraps."""
    z = x + _GOLDEN
    z ^= z >> uint64(30)
    z *= _M1
    z ^= z >> uint64(27)
    z *= _M2
    z ^= z >> uint64(31)
    return z


@_jit
def lookup(slots, row_ids, query, shift, out):  # type: ignore[no-untyped-def]
    """out[i] = the row of query[i] in an IdIndex (ps_server.tables.rowhash), -1 where absent.

    `slots`: the index's int32 probe table (0 empty, -1 a tombstone, r + 1 for row r), its length a
    power of two; `row_ids`: the id of each row; `shift`: 64 - log2(len(slots)), so that an id's
    home slot is mix64(id) >> shift, as IdIndex._home computes it. Linear probing: a query is
    settled by the slot holding its id or by an empty slot; tombstones and other ids are passed.
    The index keeps empty slots (load <= 60%), so every probe ends.

    Three passes, so that each one's random reads are all in flight together: the home slots
    (prefetched as they are computed), the ids of the rows they name (prefetched), then the
    comparisons, probing on from home only where the home slot holds another id (a few percent
    at this load). `out` holds the home slots' contents between the passes."""
    mask = len(slots) - 1
    keys = query.view(np.uint64)
    n = len(query)
    home = np.empty(n, np.int64)
    for i in range(n):
        p = np.int64(_mix64(keys[i]) >> uint64(shift))
        home[i] = p
        _prefetch(slots, p)
    for i in range(n):
        s = slots[home[i]]
        out[i] = s
        if s > 0:
            _prefetch(row_ids, s - 1)
    for i in range(n):
        s = out[i]
        q = query[i]
        if s > 0 and row_ids[s - 1] == q:
            out[i] = s - 1
            continue
        row = -1
        p = home[i]
        while s != 0:  # a tombstone or another id: probe on, to the id or an empty slot
            p = (p + 1) & mask
            s = slots[p]
            if s > 0 and row_ids[s - 1] == q:
                row = s - 1
                break
        out[i] = row


@_jit
def insert(slots, row_ids, ids, rows, shift):  # type: ignore[no-untyped-def]
    """Place each ids[i] (distinct, absent, and row_ids[rows[i]] == ids[i] already) in an IdIndex's
    probe table as row rows[i]: at the first tombstone on its linear probe path from home, else at the
    empty slot that ends it, where `lookup` finds it. Returns the tombstones reused, or -1 if an id is
    found present (the caller's bug: the ids before it are placed). The index keeps empty slots (load
    <= 60%), so every probe ends. One pass in order, so ids that share a path take successive slots."""
    mask = len(slots) - 1
    keys = ids.view(np.uint64)
    reused = 0
    for i in range(len(ids)):
        q = ids[i]
        p = np.int64(_mix64(keys[i]) >> uint64(shift))
        free = np.int64(-1)
        s = slots[p]
        while s != 0:
            if s < 0:
                if free < 0:
                    free = p
            elif row_ids[s - 1] == q:
                return -1
            p = (p + 1) & mask
            s = slots[p]
        if free >= 0:
            p = free
            reused += 1
        slots[p] = rows[i] + 1
    return reused


@_jit
def delete(slots, row_ids, rows, shift):  # type: ignore[no-untyped-def]
    """Tombstone (-1) the slot of each of `rows` (live, distinct) in an IdIndex's probe table, found from
    its id's home; False if one is not there (the caller's bug: the rows before it are removed)."""
    mask = len(slots) - 1
    keys = row_ids.view(np.uint64)
    for i in range(len(rows)):
        r = rows[i]
        p = np.int64(_mix64(keys[r]) >> uint64(shift))
        s = slots[p]
        while s != r + 1:
            if s == 0:
                return False
            p = (p + 1) & mask
            s = slots[p]
        slots[p] = -1
    return True


@_jit
def gather_touch(values, touch, rows, now, out):  # type: ignore[no-untyped-def]
    """out[i] = values[rows[i]] and touch[rows[i]] = now: a pull of rows that all exist."""
    dim, n = values.shape[1], len(rows)
    for i in range(n):
        if i + AHEAD < n:
            ahead = rows[i + AHEAD]
            _prefetch_row(values, ahead)
            _prefetch(touch, ahead)
        r = rows[i]
        for j in range(dim):
            out[i, j] = values[r, j]
        touch[r] = now


@_jit
def push_touch(values, acc, touch, count, rows, grads, lr, eps, now):  # type: ignore[no-untyped-def]
    """row_optim.apply's sgd, or its adagrad when `acc` (the sums) has rows, in place and element by
    element in its order: sgd row -= g * lr (the product rounded to the table's dtype, then
    subtracted); adagrad acc += g*g, std = sqrt(acc) + eps, row -= (g / std) * lr. Also
    touch[rows] = now and count[rows] += 1. `rows` distinct; sgd passes an `acc` of no rows."""
    dim, n = values.shape[1], len(rows)
    adagrad = acc.shape[0] > 0
    for i in range(n):
        if i + AHEAD < n:
            ahead = rows[i + AHEAD]
            _prefetch_row(values, ahead)
            if adagrad:
                _prefetch_row(acc, ahead)
            _prefetch(touch, ahead)
            _prefetch(count, ahead)
        r = rows[i]
        if adagrad:
            for j in range(dim):
                g = grads[i, j]
                a = acc[r, j] + g * g
                acc[r, j] = a
                std = np.sqrt(a) + eps
                values[r, j] -= (g / std) * lr
        else:
            for j in range(dim):
                values[r, j] -= grads[i, j] * lr
        touch[r] = now
        count[r] += 1


@_jit
def ascending(ids):  # type: ignore[no-untyped-def]
    """Whether every id is above the one before it: strictly ascending, so distinct (clients send each
    server's ids so); one pass, where numpy compared into a temporary first."""
    for i in range(1, len(ids)):  # noqa: SIM110 (numba compiles this loop; all() of a generator it would not)
        if ids[i] <= ids[i - 1]:
            return False
    return True


@_jit
def _finite_bits(bits, exponent):  # type: ignore[no-untyped-def]
    """No number whose exponent bits are all ones (NaN or Inf), over the numbers' bit patterns: an
    integer OR over the whole array, which LLVM vectorises (a float sum in order it cannot)."""
    bad = 0
    for i in range(len(bits)):
        bad |= (bits[i] & exponent) == exponent
    return bad == 0


_EXPONENT = {np.dtype(np.float32): (np.uint32, np.uint32(0x7F800000)),
             np.dtype(np.float64): (np.uint64, np.uint64(0x7FF0000000000000))}


def all_finite(a: np.ndarray) -> bool:
    """No NaN and no Inf in the C-contiguous float32 or float64 array `a` (numpy's isfinite, all)."""
    view, exponent = _EXPONENT[a.dtype]
    return bool(_finite_bits(a.reshape(-1).view(view), exponent))


# The dtypes whose tables use the kernels (pshard.common.sparse.TABLE_DTYPES).
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_warmed: set[np.dtype] = set()


def warm(dtype: np.dtype) -> None:
    """Compile (or load from numba's cache) every kernel for tables of `dtype`, once per process."""
    dtype = np.dtype(dtype)
    if dtype in _warmed:
        return
    ids = np.array([7], np.int64)
    rows = np.zeros(1, np.int64)
    slots = np.zeros(16, np.int32)
    lookup(slots, ids, ids, 60, rows)
    # Ids and gradients reach a table as read-only views of gRPC's bytes: numba types those apart.
    frozen = ids.copy()
    frozen.flags.writeable = False
    lookup(slots, ids, frozen, 60, rows)
    insert(np.zeros(16, np.int32), ids, ids, rows, 60)
    delete(slots, ids, rows, 60)
    ascending(ids)
    ascending(frozen)
    values = np.zeros((1, 2), dtype)
    count = np.zeros(1, np.int32)
    one = dtype.type(1)
    grads = np.zeros((1, 2), dtype)
    frozen_grads = grads.copy()
    frozen_grads.flags.writeable = False
    all_finite(grads)
    all_finite(frozen_grads)
    no_sums = values[:0]
    for touch in touches():
        gather_touch(values, touch, rows, 0.0, np.empty_like(values))
        for g in (grads, frozen_grads):
            push_touch(values, values.copy(), touch, count, rows, g, one, one, 0.0)
            push_touch(values, no_sums, touch, count, rows, g, one, one, 0.0)
    _warmed.add(dtype)


def touches() -> tuple[np.ndarray, np.ndarray]:
    """A table's last-touch array as the kernels get it: kept (contiguous float64), or not kept (a sink:
    one float64 at stride 0, ps_server.tables.table), which numba compiles apart (not contiguous: of two
    elements, as numpy calls any array of one element contiguous)."""
    return np.zeros(1, np.float64), np.lib.stride_tricks.as_strided(np.zeros(1, np.float64), (2,), (0,))


if __name__ == "__main__":  # compile into numba's cache ahead of time (docker/Dockerfile.server)
    for _dtype in DTYPES:
        warm(_dtype)
