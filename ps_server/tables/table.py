"""One sparse embedding table on one server: rows, per-row optimizer state and metadata, admission, eviction.

Rows live in flat numpy arrays indexed by the row numbers of an `IdIndex` (ps_server.tables.rowhash):
`values` (rows, dim), one (rows, dim) array per optimizer state, and per row its last touch
(a clock or a time, float64), its count of updates, and for lazy Adam its step count. Arrays
grow by doubling into fresh zeroed memory, whose untouched pages cost no RSS. Only the fields a
table reads take memory (issue 22: int8 rows of dim 64 are 72 bytes, so 12 bytes of stamps are a
tenth of a row): the last touch is kept where ttl, max_rows or a disk tier read it, the change
stamps from the table's first checkpoint capture on (`track_changes`); until then each is a sink,
one element at stride 0 that every row's write lands on, so the code and the compiled loops that
write them per row run unchanged.

A row that does not exist yet has a deterministic initial value, a function of (seed, table
name, id, column) only (`initial_rows`), so any server, restart or replica makes the same row.

Reads never create state: a pull of an id that is not a row returns its initial value and inserts
nothing, so only pushes make rows. Admission (`admit_after` > 1 or `admit_prob` < 1): a push of an
id that is not a row is counted as a sighting, and once an id has `admit_after` sightings, each
further sighting admits it with probability `admit_prob` (a seeded generator), the admitting push
then being applied to the fresh row. Without admission a push creates the rows it touches.
Sightings are counted in `admit_memory_mb` whatever the id stream: a count-min sketch with decay
(ps_server.tables.admission), which may admit an id early, never late, and forgets old sightings.
It keeps counting an admitted id, so a row evicted while its counts last comes back at its next push.

Eviction: with a TTL, a row whose last touch is more than `ttl` ago (clocks: the clock passed to
`push`/`pull`; seconds: the injected `now`) is treated as absent from then on and freed by a sweep;
with `max_rows`, a request that leaves more rows evicts the least recently touched (lru) or the
least often updated (lfu) rows, never the ones this request touched, down to the cap minus 1/64
of it, so that a full table pays the O(rows) selection once per many requests, not on each.
Evicted ids are counted and handed to `on_evict`.

Changes, for incremental checkpoints (ps_server.checkpoints.images): every row a request writes or
touches is stamped with the table's `epoch`, and every eviction is logged with it, so the rows changed
since a checkpoint taken at epoch e are the live rows stamped after e plus the ids removed after e.
`token` names this table object: stamps mean nothing to another one (a restart, a table dropped and
declared again). `before_write`, while a checkpoint copies the table in the background, is told the rows
a request is about to change, before it changes them (copy-on-write).

Narrow rows (`row_dtype` float16, bfloat16 or int8, issue 22): `values` holds each row in its stored form,
opaque bytes (TableConfig.row_layout); a push decodes the rows it touches to float32, applies the optimizer
there with its float32 state, and encodes them once (ps_server.tables.rowcodec; int8 rounds stochastically
with draws of the seed, the id and the row's update count, so a backup or a restart rounds alike); sgd and
adagrad do all three in one compiled pass (ps_server.tables.narrow_kernels), the same bytes as that numpy.
Pulls return the stored bytes as they are, which the client decodes (common.wire.sparse_codec.decode_rows).

A disk tier (`memory_mb`, issue 22): given a store directory, a table keeps at most `ram_rows` rows
(memory_mb over a row's bytes in RAM) in its arrays. After each request the coldest rows beyond that, by
cap_policy's stamps and never the ones the request touched, spill to ps_server.tables.disktier (down to
an eighth below the budget); a request fetches the spilled rows it names back first, stamps
as they were, so the arithmetic and the values are those of an all-RAM table. ttl and max_rows count
and evict rows on both tiers; `len()` and the streams out (`chunks` then `spilled_chunks`) cover both.

Not thread-safe: ps_server.handlers.tables serialises requests per table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from pshard.common.errors import CheckpointError, InvalidArgumentError, QuotaExceededError
from pshard.common.sparse import TableConfig, mix64, put_rows, table_hash, take_rows
from pshard.common.wire.sparse_codec import decode_rows
from pshard.ps_server.tables import row_optim, rowcodec
from pshard.ps_server.tables.admission import CountMinSketch
from pshard.ps_server.tables.coldest import coldest
from pshard.ps_server.tables.disktier import DIRECTORY_BYTES, DiskTier, RecordLayout, TierStats
from pshard.ps_server.tables.rowhash import IdIndex
from pshard.ps_server.tables.scheduled import ScheduledPushes

log = logging.getLogger("pshard.ps")

# Rows per chunk when a table is streamed out (checkpoint, export): bounds the temporary memory.
CHUNK_ROWS = 1 << 16
# Fraction of ram_rows a spill frees below it (1/64 made a spill at nearly every request of the disk tier's
# bench, each paying a selection over the RAM rows and the store's write: 1/8 spills every ~10th).
SPILL_SLACK = 1 / 8
# Numbers (rows x dim) up to which a push's temporaries live in buffers the table keeps (4 MB of float32).
_BUFFER_NUMBERS = 1 << 20
_UNIT = float(2**-53)
# Evicted ids logged for incremental checkpoints at most (8 bytes each): past it, the next one is full.
REMOVED_LOG_IDS = 1 << 22
# Optimizers whose push updates rows in place in one compiled pass (ps_server.tables.kernels, narrow rows
# ps_server.tables.narrow_kernels); adam's two moments and bias correction stay with row_optim's numpy.
_IN_PLACE = ("sgd", "adagrad")


def initial_rows(config: TableConfig, ids: np.ndarray) -> np.ndarray:
    """The initial value of each id's row: counter-based random numbers, (len(ids), dim)."""
    dt = config.np_dtype
    if config.initializer == "zeros" or len(ids) == 0:
        return np.zeros((len(ids), config.dim), dt)
    key = np.uint64(table_hash(config.name)) ^ mix64(np.array([config.seed], np.uint64))[0]
    base = mix64(ids.astype(np.int64).view(np.uint64) ^ key)[:, None]
    cols = np.arange(config.dim, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        u1 = ((mix64(base + cols * np.uint64(2)) >> np.uint64(11)).astype(np.float64) + 0.5) * _UNIT
        if config.initializer == "uniform":
            return (config.init_scale * (2.0 * u1 - 1.0)).astype(dt)
        u2 = (mix64(base + cols * np.uint64(2) + np.uint64(1)) >> np.uint64(11)).astype(np.float64) * _UNIT
    return (config.init_scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)).astype(dt)


class SparseTable:
    def __init__(self, config: TableConfig, now: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[np.ndarray], None] | None = None, expected_rows: int = 0,
                 store: Path | None = None) -> None:
        """`store`: the directory of the disk tier of a table with memory_mb (wiped); None: all in RAM."""
        self.config = config
        self._now = now
        self._on_evict = on_evict
        self.index = IdIndex(expected_rows)
        cap = self.index.row_capacity
        dtype, width = config.row_layout  # (np_dtype, dim), or a narrow row's bytes
        self.values = np.zeros((cap, width), dtype)
        self.state = {name: np.zeros((cap, config.dim), config.np_dtype)
                      for name in row_optim.STATE_NAMES[config.optimizer]}
        # The last touch is read only by ttl, max_rows and the disk tier, the change stamps only once a
        # checkpoint capture tracks changes: until then each is a sink (_sink), 12 bytes a row not spent.
        self.keeps_touch = config.ttl > 0 or config.max_rows > 0 or config.memory_mb > 0
        self.touch = np.zeros(cap, np.float64) if self.keeps_touch else _sink(cap, np.float64)
        self.count = np.zeros(cap, np.int32)
        self.row_step = np.zeros(cap if config.optimizer == "lazy_adam" else 0, np.int32)
        self.stamp = _sink(cap, np.int32)  # the epoch of each row's last write or touch (track_changes)
        self.epoch = 1  # advanced by each checkpoint's capture
        self.token = uuid.uuid4().hex
        # (epoch, evicted ids) since the first capture, pruned by later ones; None: not tracked (no capture
        # yet, or more logged than REMOVED_LOG_IDS: the next capture is then a full one).
        self.removed: list[tuple[int, np.ndarray]] | None = None
        self.removed_ids = 0
        self.removed_since = 0  # the log holds every eviction of the epochs after this one
        self.before_write: Callable[[np.ndarray], None] | None = None
        self.step = 0  # pushes applied (adam's bias correction)
        self.clock = 0.0  # newest clock seen (ttl in clocks)
        self.evicted = 0
        self.admitted = 0  # rows created by requests (restored ones are not admissions)
        # Scheduled calls' pushes applied (pshard.coordinator): replicated and checkpointed with the rows.
        self.scheduled = ScheduledPushes()
        # Sightings of ids that are not rows yet (admission by count): bounded memory, None without.
        self.admission = (CountMinSketch(int(config.admit_memory_mb * 2**20), config.admit_after, config.seed)
                          if config.admit_after > 1 else None)
        self._rng = np.random.default_rng(config.seed)
        self._next_sweep = 0.0
        self._buffers: dict[str, np.ndarray] = {}
        # The compiled loops of the hot path (ps_server.tables.kernels), imported with the first table: a
        # server that holds none never loads numba. Compiled (or loaded from numba's cache) here, so
        # that no request waits for a compilation.
        from pshard.ps_server.tables import kernels
        kernels.warm(config.np_dtype)
        self.kernels = kernels
        if config.narrow and config.optimizer in _IN_PLACE:
            from pshard.ps_server.tables import narrow_kernels
            narrow_kernels.warm(config.row_dtype)
            self.narrow_kernels = narrow_kernels
        self.state_none = np.zeros((0, config.dim), np.float32)  # sgd's sums: an array of no rows
        self._int8_key = mix64(np.array([config.seed], np.uint64))[0]  # rowcodec's draws: mix64(seed)
        # Told the ids of every eviction too (ps_server/replication/tables.py: backups drop them).
        self.evict_hook: Callable[[np.ndarray], None] | None = None
        self._held: list[np.ndarray] | None = None  # evictions whose evict_hook waits (hooks_held)
        self.disk: DiskTier | None = None
        self._spill_refused = False  # the last spill found no room (logged once)
        self.ram_rows = 0  # rows the arrays may keep (memory_mb); 0: all of them
        layout = RecordLayout.of(self.columns())
        self._ram_row_bytes = layout.record_bytes + 4 + 8 * self.keeps_touch  # and its count and touch
        if store is not None and config.memory_mb > 0:
            # A RAM row costs its record, its stamps (touch 8, count 4) and its place in the index (8 + ~7).
            self.ram_rows = max(1, int(config.memory_mb * 2**20) // (layout.record_bytes + DIRECTORY_BYTES))
            self.disk = DiskTier(store, layout)

    def _buffer(self, name: str, n: int) -> np.ndarray:
        """An (n, dim) array for a push's temporaries, kept between requests: a fresh one of a few
        hundred KB comes from pages the allocator gave back, a page fault every 4 KB (as much CPU as
        the arithmetic). Large requests get a fresh array, so the buffers stay small."""
        if n * self.config.dim > _BUFFER_NUMBERS:
            return np.empty((n, self.config.dim), self.config.np_dtype)
        buffer = self._buffers.get(name)
        if buffer is None or len(buffer) < n:
            size = max(n, 2 * len(buffer)) if buffer is not None else n
            buffer = self._buffers[name] = np.empty((size, self.config.dim), self.config.np_dtype)
        return buffer[:n]

    @property
    def _filtered(self) -> bool:
        return self.config.admit_after > 1 or self.config.admit_prob < 1.0

    def __len__(self) -> int:
        """Rows on both tiers."""
        return len(self.index) + (len(self.disk) if self.disk is not None else 0)

    def _time(self, clock: float | None) -> float:
        if self.config.ttl_unit == "seconds":
            return self._now()
        if clock is None:
            clock = self.clock
        self.clock = max(self.clock, clock)
        return self.clock

    # ---- requests ----

    def pull(self, ids: np.ndarray, clock: float | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of `ids` (distinct int64), (len(ids), dim): a copy, written into `out` when given (a
        fast-path reply region: the rows then need no second copy). Reads create nothing: an id
        that is not a row reads as its initial value (a pure function of seed, table and id), so an
        evaluator's or a hostile caller's pulls leave the table's rows and memory as they were."""
        now = self._time(clock)
        rows = self._live(ids, now)
        missing = rows < 0
        if self.before_write is not None:
            self.before_write(rows[~missing])
        if out is None:
            out = np.empty((len(ids), self.values.shape[1]), self.values.dtype)
        if missing.any():
            found = ~missing
            rows = rows[found]
            out[found] = self.values[rows]
            out[missing] = self._initial(ids[missing])
            self.touch[rows] = now
        elif self.config.narrow:  # stored bytes, sent as they are (the kernels know float rows only)
            take_rows(self.values, rows, out)
            self.touch[rows] = now
        else:  # every id a row (the common case): one pass gathers them and stamps their touch
            self.kernels.gather_touch(self.values, self.touch, rows, float(now), out)
        self.stamp[rows] = self.epoch  # a touch is a change: an incremental checkpoint restores it
        if self.disk is not None:
            self._spill(rows)
        return out

    def push(self, ids: np.ndarray, grads: np.ndarray, clock: float | None = None) -> int:
        """Apply `grads` (len(ids), dim) to the rows of `ids` (distinct); returns how many were stored
        (the rest only counted, admission)."""
        now = self._time(clock)
        rows = self._live(ids, now)
        missing = rows < 0
        if missing.any():
            admit = self._admit(ids[missing]) if self._filtered else np.ones(int(missing.sum()), bool)
            where = np.flatnonzero(missing)
            rows[where[admit]] = self._create(ids[where[admit]])
            self.admitted += int(admit.sum())
            stored = rows >= 0
            rows, grads = rows[stored], grads[stored]
        r, g, n = rows, grads, len(rows)
        if n == 0:
            return 0
        if self.before_write is not None:
            self.before_write(r)
        self.step += 1
        # One compiled pass updates rows where they are (narrow ones decoded, updated and encoded in it).
        if self.config.optimizer in _IN_PLACE and self.config.narrow:
            self._push_narrow(r, np.ascontiguousarray(g, np.float32), now)
        elif self.config.optimizer in _IN_PLACE:
            self._push_in_place(r, np.ascontiguousarray(g), now)
        else:
            self._push_gathered(r, g, now)
        self.stamp[r] = self.epoch
        self._enforce_cap(r, now)
        if self.disk is not None:
            self._spill(r)
        return len(r)

    def _push_in_place(self, rows: np.ndarray, grads: np.ndarray, now: float) -> None:
        """row_optim.apply's sgd or adagrad on the rows where they are, with their touch and count
        (ps_server.tables.kernels: the same arithmetic, bit for bit)."""
        dt = self.config.np_dtype.type
        sums = self.state["sum"] if self.config.optimizer == "adagrad" else self.values[:0]  # sgd: none
        # dtype scalars and a float: the types warm() compiled for, so no compilation here
        self.kernels.push_touch(self.values, sums, self.touch, self.count, rows, grads, dt(self.config.lr),
                                dt(self.config.eps), float(now))

    def _push_narrow(self, rows: np.ndarray, grads: np.ndarray, now: float) -> None:
        """sgd or adagrad on narrow rows where they are (ps_server.tables.narrow_kernels: decode, update and
        encode of _push_gathered's numpy, bit for bit). An int8 update that an int8 row cannot hold (not
        finite, or past its float16 scale and offset) is refused with nothing changed, as in _encode."""
        sums = self.state["sum"] if self.config.optimizer == "adagrad" else self.state_none
        lr, eps = np.float32(self.config.lr), np.float32(self.config.eps)
        if self.config.row_dtype != "int8":
            self.narrow_kernels.push16(self.values.view("<u2"), sums, self.touch, self.count, rows, grads, lr,
                                       eps, float(now), self.config.row_dtype == "bfloat16")
            return
        n = len(rows)
        new_sums = self._buffer("sums", n) if self.config.optimizer == "adagrad" else self.state_none
        bad = self.narrow_kernels.push_int8(self.values, sums, self.touch, self.count, rows, self.index.ids,
                                            grads, lr, eps, float(now), self._int8_key,
                                            self._buffer("scratch", n), new_sums)
        if bad >= 0:
            self.step -= 1
            raise self._not_finite(int(self.index.ids[rows[bad]]))

    def _push_gathered(self, r: np.ndarray, g: np.ndarray, now: float) -> None:
        """row_optim.apply on gathered copies of the rows and their state, scattered back (adam's)."""
        n = len(r)
        # Gathers into buffers kept between requests; rows move as whole items (sparse.take_rows).
        state = {name: take_rows(a, r, self._buffer(name, n)) for name, a in self.state.items()}
        step: int | np.ndarray = self.step
        if self.config.optimizer == "lazy_adam":  # stored once the push cannot be refused any more
            step = self.row_step[r] + 1
        if self.config.narrow:  # decoded to float32, updated there, rounded once
            current = decode_rows(self.config, take_rows(self.values, r))
        else:
            current = take_rows(self.values, r, self._buffer("values", n))
        updated = row_optim.apply(self.config, current, g, state, step, self._buffer("scratch", n))
        versions = self.count[r] + 1
        if self.config.narrow:
            updated = self._encode(r, updated, versions)
        if self.config.optimizer == "lazy_adam":
            self.row_step[r] = step
        put_rows(self.values, r, updated)
        for name, a in self.state.items():
            put_rows(a, r, state[name])
        self.touch[r] = now
        self.count[r] = versions

    # ---- rows ----

    def _live(self, ids: np.ndarray, now: float) -> np.ndarray:
        """Rows of `ids` (-1: absent); rows past their TTL are evicted first, so they read as absent."""
        rows = self.index.lookup(ids)
        if self.disk is not None and len(self.disk):
            rows = self._fetch(ids, rows)
        if self.config.ttl > 0:
            found = rows >= 0
            old = found & (self.touch[np.maximum(rows, 0)] < now - self.config.ttl)
            if old.any():
                self._evict(rows[old])
                rows[old] = -1
            if now >= self._next_sweep:
                self._next_sweep = now + self.config.ttl / 8
                stale = self.index.live_rows()
                self._evict(stale[self.touch[stale] < now - self.config.ttl])
                if self.disk is not None:
                    slots = self.disk.index.live_rows()
                    self._evict_spilled(slots[self.disk.touch[slots] < now - self.config.ttl])
        return rows

    def _create(self, ids: np.ndarray) -> np.ndarray:
        rows = self._allocate(ids)
        if self.before_write is not None:
            self.before_write(rows)
        self.values[rows] = self._initial(ids)
        for name, a in self.state.items():
            a[rows] = row_optim.initial_state(self.config, name)
        self.count[rows] = 0
        if len(self.row_step):
            self.row_step[rows] = 0
        self.stamp[rows] = self.epoch
        return rows

    def _allocate(self, ids: np.ndarray) -> np.ndarray:
        """Rows for `ids` (distinct, absent), contents unset; the arrays grown to the index's capacity."""
        rows = self.index.insert(ids)
        cap = self.index.row_capacity
        if len(self.values) < cap:
            self.values = _grow(self.values, cap)
            self.state = {name: _grow(a, cap) for name, a in self.state.items()}
            self.touch = _grow(self.touch, cap)
            self.count = _grow(self.count, cap)
            self.stamp = _grow(self.stamp, cap)
            if len(self.row_step):
                self.row_step = _grow(self.row_step, cap)
        return rows

    def _encode(self, r: np.ndarray, updated: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """The stored form of rows `r`'s float32 `updated` values. An int8 row cannot hold a NaN or an
        infinity (an overflow of the update): the push is refused before any row or state changes."""
        try:
            return rowcodec.encode_rows(self.config, updated, self.index.ids[r], versions)
        except ValueError:
            self.step -= 1
            raise self._not_finite(int(self.index.ids[r][~rowcodec.representable(updated)][0])) from None

    def _not_finite(self, bad: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"push of table {self.config.name!r}: the update of id {bad} is not finite, or leaves a value "
            "below -65504 or a range past 255 x 65504, which an int8 row (float16 scale and offset) cannot "
            "hold (lower lr, or clip the gradients)")

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        """The initial rows of `ids` in the stored form (narrow: rounded as update count 0)."""
        rows = initial_rows(self.config, ids)
        if not self.config.narrow:
            return rows
        return rowcodec.encode_rows(self.config, rows, ids, np.zeros(len(ids), np.int64))

    def decoded(self, rows: np.ndarray) -> np.ndarray:
        """The values of `rows` (row numbers) as float32 (n, dim), or in the table's dtype if not narrow."""
        return decode_rows(self.config, self.values[rows])

    def _admit(self, ids: np.ndarray) -> np.ndarray:
        """Count a sighting of each id (not rows yet); which of them are admitted now."""
        if self.admission is None:
            admit = np.ones(len(ids), bool)
        else:
            admit = self.admission.add(ids) >= self.config.admit_after
        if self.config.admit_prob < 1.0:
            admit &= self._rng.random(len(ids)) < self.config.admit_prob
        return admit

    def _evict(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        ids = self.index.ids[rows].copy()
        self.index.delete_rows(rows)
        self._gone(ids)

    def _evict_spilled(self, slots: np.ndarray) -> None:
        if len(slots) and self.disk is not None:
            self._gone(self.disk.drop(slots))

    def _gone(self, ids: np.ndarray) -> None:
        """Count and announce the eviction of `ids`, and log it for incremental checkpoints."""
        self.evicted += len(ids)
        if self.removed is not None:
            self.removed.append((self.epoch, ids))
            self.removed_ids += len(ids)
            if self.removed_ids > REMOVED_LOG_IDS:
                self.removed, self.removed_ids = None, 0
        if self._on_evict is not None:
            self._on_evict(ids)
        if self._held is not None:
            self._held.append(ids)
        elif self.evict_hook is not None:
            self.evict_hook(ids)

    @contextlib.contextmanager
    def hooks_held(self) -> Iterator[None]:
        """Within: evictions reach `evict_hook` only at the exit, in order. A request run on a worker
        thread (ps_server.handlers.tables) is entered and left on the event loop, where the hook
        (replication's bookkeeping and events) must run."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if self.evict_hook is not None:
                for ids in held:
                    self.evict_hook(ids)

    def _enforce_cap(self, keep: np.ndarray, now: float) -> None:
        cap = self.config.max_rows
        if cap == 0 or len(self) <= cap:
            return
        live = self.index.live_rows()
        score = self._score(self.touch, self.count, live)
        score[np.isin(live, keep)] = np.inf
        if self.disk is None:
            self._evict(live[coldest(score, len(live) - (cap - cap // 64))])
            return
        # Both tiers compete on the same stamps: spilled rows first in line, as the colder ones.
        slots = self.disk.index.live_rows()
        both = np.concatenate([self._score(self.disk.touch, self.disk.count, slots), score])
        out = coldest(both, len(both) - (cap - cap // 64))
        self._evict_spilled(slots[out[out < len(slots)]])
        self._evict(live[out[out >= len(slots)] - len(slots)])

    def _score(self, touch: np.ndarray, count: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """How warm each of `rows` is by cap_policy (lru: its last touch, lfu: its updates), float64."""
        return (touch[rows] if self.config.cap_policy == "lru" else count[rows]).astype(np.float64)

    # ---- the disk tier ----

    def _fetch(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """`rows` (of `ids`, -1 where not in RAM) with the spilled ones among them back in RAM, every
        column and stamp as it was spilled."""
        assert self.disk is not None
        missing = np.flatnonzero(rows < 0)
        if len(missing) == 0:
            return rows
        slots = self.disk.slots(ids[missing])
        back = slots >= 0
        if not back.any():
            return rows
        back_ids, columns = self.disk.take(slots[back])
        new = self._allocate(back_ids)
        if self.before_write is not None:
            self.before_write(new)
        own = self.columns()
        for name, values in columns.items():
            if values.ndim == 2:
                put_rows(own[name][0], new, values)
            else:
                own[name][0][new] = values
        rows[missing[back]] = new
        return rows

    def _spill(self, keep: np.ndarray) -> None:
        """Past `ram_rows`, move the coldest rows but `keep` (this request's) to the disk tier, down to
        SPILL_SLACK below it: the O(rows) choice and the store's write transaction are paid once per
        many requests (a request of a zipf stream brings back rows by the thousand)."""
        assert self.disk is not None
        budget = self.ram_rows
        if len(self.index) <= budget:
            return
        live = self.index.live_rows()
        score = self._score(self.touch, self.count, live)
        kept = np.zeros(self.index.high, bool)  # a mask, not np.isin: that sorts both
        kept[keep[keep >= 0]] = True
        score[kept[live]] = np.inf
        out = live[coldest(score, len(live) - (budget - int(budget * SPILL_SLACK)))]
        if len(out) == 0:
            return
        # Written before the rows leave RAM. A refused write (a full disk) fails neither this request, which
        # is applied already (its client would retry it, and apply it twice), nor any later one: the rows
        # stay in RAM, over the budget, and the server says so once until a spill goes through again.
        try:
            self.disk.put(self.index.ids[out], self.disk.layout.pack(self.columns(), out), self.touch[out],
                          self.count[out])
        except QuotaExceededError as err:
            if not self._spill_refused:
                log.warning("table %r keeps %d rows in RAM, over its memory_mb %g: %s", self.config.name,
                            len(self.index), self.config.memory_mb, err)
            self._spill_refused = True
            return
        self._spill_refused = False
        self.index.delete_rows(out)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """RAM rows of `ids` (-1: no row), fetching spilled ones, their stamps unchanged (a restore)."""
        rows = self.index.lookup(ids)
        if self.disk is not None and len(self.disk):
            rows = self._fetch(ids, rows)
        return rows

    def spilled(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(those of `ids` on the disk tier, their columns as `columns()` names them), read where they are:
        nothing moves (replication's capture)."""
        if self.disk is None or len(self.disk) == 0:
            return ids[:0], {}
        slots = self.disk.slots(ids)
        on = slots >= 0
        return ids[on], self.disk.read(slots[on])

    def spilled_chunks(self) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """(ids, columns as `columns()` names them) of the rows on the disk tier, CHUNK_ROWS at a time:
        with `chunks()`, every row of the table."""
        if self.disk is not None:
            for slots, ids in self.disk.chunks(CHUNK_ROWS):
                yield ids.copy(), self.disk.read(slots)

    def tiers(self) -> TierStats:
        """Rows and bytes in RAM and on the disk tier, rows spilled and fetched (metrics)."""
        ram = TierStats(len(self.index), len(self.index) * self._ram_row_bytes)
        if self.disk is None:
            return ram
        return dataclasses.replace(ram, disk_rows=len(self.disk), disk_bytes=self.disk.bytes,
                                   spilled=self.disk.spilled, fetched=self.disk.fetched)

    # ---- streaming out ----

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(rows, ids) of the live rows, CHUNK_ROWS row numbers at a time, ascending."""
        for start in range(0, self.index.high, CHUNK_ROWS):
            rows = self.index.live_rows(start, start + CHUNK_ROWS)
            if len(rows):
                yield rows, self.index.ids[rows]

    def columns(self) -> dict[str, tuple[np.ndarray, tuple[int, ...]]]:
        """Every per-row array a checkpoint saves: name -> (array over row numbers, row shape); the last
        touch only where the table keeps it (an older checkpoint's touch.npy is then not read)."""
        cols = {"values": self.values, "touch": self.touch, "count": self.count}
        if not self.keeps_touch:
            del cols["touch"]
        cols.update({f"state_{name}": a for name, a in self.state.items()})
        if len(self.row_step):
            cols["row_step"] = self.row_step
        return {name: (a, a.shape[1:]) for name, a in cols.items()}

    def restore_rows(self, ids: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        """Load a chunk saved by a checkpoint or sent by a primary: ids and their per-row arrays (names as
        `columns()`; a last touch this table does not keep is dropped, one it keeps and the chunk lacks is
        the restore's time)."""
        rows = self.rows_of(ids)
        rows[rows < 0] = self._create(ids[rows < 0])
        if self.before_write is not None:
            self.before_write(rows)
        own = self.columns()
        if "values" in columns and columns["values"].shape[1:] != own["values"][1]:
            columns = {**columns, "values": self._upgraded(ids, columns)}
        for name, values in columns.items():
            if name == "touch" and not self.keeps_touch:
                continue  # kept by the sender (a primary with a ttl or a disk tier), read by no one here
            own[name][0][rows] = values
        if self.keeps_touch and "touch" not in columns:
            self.touch[rows] = self._time(None)  # a sender that keeps none: touched by this restore
        self.stamp[rows] = self.epoch
        if self.disk is not None:
            self._spill(rows)

    def _upgraded(self, ids: np.ndarray, columns: dict[str, np.ndarray]) -> np.ndarray:
        """Rows saved in an older layout (int8 layout 1: float32 scale and offset) in this table's, rounded
        as their last push was (update count = the saved count); CheckpointError for any other width."""
        values, (_, width) = columns["values"], self.config.row_layout
        old_int8 = (self.config.dim + rowcodec.INT8_TAIL_BYTES_V1,)
        if self.config.row_dtype == "int8" and values.shape[1:] == old_int8:
            versions = columns.get("count", np.zeros(len(ids), np.int32))
            try:
                return rowcodec.upgrade_int8(self.config, values, ids, versions)
            except ValueError as err:
                raise CheckpointError(f"table {self.config.name!r}: int8 rows of layout 1 (float32 scale and "
                                      f"offset): {err}") from None
        raise CheckpointError(
            f"table {self.config.name!r}: rows of shape {values.shape[1:]} ({values.dtype}), expected "
            f"({width},) for row_dtype {self.config.row_dtype!r} and dim {self.config.dim} (int8 rows: "
            "layout 2, a float16 scale and offset; layout 1, dim + 8 bytes, is re-rounded on load)")

    def track_changes(self) -> None:
        """Stamp changes from now on (the first checkpoint capture, ps_server.checkpoints.images): every row
        counts as unchanged (stamp 0, before any epoch) until a request writes or touches it."""
        if _is_sink(self.stamp):
            self.stamp = np.zeros(len(self.stamp), np.int32)

    # ---- admission state, for replicas (ps_server/replication/table_rows.py) ----

    def sightings(self, ids: np.ndarray) -> np.ndarray:
        """Estimated admission sightings of each of `ids` (int32; 0 without admission by count)."""
        if self.admission is None:
            return np.zeros(len(ids), np.int32)
        return self.admission.estimate(ids).astype(np.int32)

    @property
    def admit_epoch(self) -> int:
        """Halvings of the admission counts so far (a backup decays in step)."""
        return self.admission.epoch if self.admission is not None else 0

    def follow_sightings(self, epoch: int, ids: np.ndarray, counts: np.ndarray) -> None:
        """A backup: decay to its primary's `epoch`, then make each of `ids` count at least `counts`
        (the primary's estimates at capture). Its estimates of those ids then equal the primary's."""
        if self.admission is not None:
            self.admission.decay_to(epoch)
            self.admission.raise_to(ids, counts)

    @property
    def rng_state(self) -> dict[str, object]:
        """The admission generator's state (admit_prob < 1 draws from it)."""
        return dict(self._rng.bit_generator.state)

    @rng_state.setter
    def rng_state(self, state: dict[str, object]) -> None:
        self._rng.bit_generator.state = state


def _grow(a: np.ndarray, cap: int) -> np.ndarray:
    if _is_sink(a):
        return _sink(cap, a.dtype)
    out = np.zeros((cap, *a.shape[1:]), a.dtype)
    out[: len(a)] = a
    return out


def _sink(n: int, dtype: type[np.generic] | np.dtype) -> np.ndarray:
    """A per-row field the table does not keep: `n` elements that are one (stride 0), so that the code and
    the compiled loops that write it per row run as they are, each write landing on the same 8 bytes."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), (n,), (0,))


def _is_sink(a: np.ndarray) -> bool:
    return a.ndim == 1 and a.strides[0] == 0
