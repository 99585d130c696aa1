"""A vectorised open-addressing hash index: int64 ids -> dense row numbers.

Every operation takes a whole batch of ids. Lookups, the hot path of every table request, run as
one compiled loop (ps_server.tables.kernels.lookup, linear probing with the slots and ids prefetched);
so do insertions and deletions (kernels.insert, kernels.delete: a disk tier moves thousands of rows in
and out of an index per request, where numpy's probe rounds cost a millisecond a call). `_probe`, the
numpy probe (each round advances all still-unresolved ids by a window of slots), is their reference in
the tests. All find an id's home slot the same way (`_home`: mix64 of the id, its top bits).

Memory is what the issue's 0.3x budget allows: the probe table holds only an int32 per slot
(0 empty, -1 a tombstone left by a deletion, r+1 for row r); the id of row r lives once, in
`ids[r]`, and a probe compares against it. Rows freed by deletions are reused (a free list), so
row numbers stay below the peak number of live ids. The table is rehashed when live ids plus
tombstones pass 60% of its slots: doubled when the live ids alone need it, same size otherwise
(that only clears tombstones). Row numbers fit int32: at most 2**31 - 2 rows per index.

Not thread-safe: the owner (ps_server.tables.table) serialises access.
"""

from __future__ import annotations

import numpy as np
from pshard.common.errors import QuotaExceededError
from pshard.common.sparse import mix64

_EMPTY = 0
_TOMB = -1
_MIN_SLOTS = 1 << 10
_MAX_LOAD = 0.6
MAX_ROWS = 2**31 - 2  # row + 1 must fit the int32 slots
_RECENT, _RECENT_IDS = 4, 1 << 16  # lookups remembered (IdIndex._recent), of at most this many ids
_FIRST_WINDOW, _WINDOW = 4, 16  # slots a probe round reads per id: the first round, the next ones
_STEPS = np.arange(_WINDOW)


class IdIndex:
    def __init__(self, expected: int = 0) -> None:
        self._slots = np.zeros(_slots_for(expected), np.int32)
        self.ids = np.zeros(max(expected, 16), np.int64)  # row -> id; meaningful for live rows only
        self._free = np.zeros(0, np.int64)  # freed rows, reused last-in first
        self.high = 0  # rows ever handed out: every live row is below it
        self.live = 0
        self._tombs = 0
        # Answers of the last few lookups, valid while no insertion or deletion happened (`_changes`):
        # a worker pushes the very ids it pulled a moment before (a forward's rows, then their
        # gradients), and several workers interleave their requests.
        self._changes = 0
        self._recent: list[tuple[int, np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        return self.live

    @property
    def row_capacity(self) -> int:
        return len(self.ids)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the probe table (an int32 a slot): what the index costs beyond `ids`."""
        return int(self._slots.nbytes)

    @property
    def _shift(self) -> int:
        """64 - log2(slots): an id's home slot is mix64(id) >> _shift (the kernels' argument)."""
        return 64 - (len(self._slots).bit_length() - 1)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        bits = len(self._slots).bit_length() - 1
        return (mix64(ids.view(np.uint64)) >> np.uint64(64 - bits)).astype(np.int64)

    def _probe(self, ids: np.ndarray, width: int = 0) -> np.ndarray:
        """Slot of each id, or -1 - (first free slot on its probe path) when it is absent.

        Each round reads a window of slots per unresolved id (a row of a 2-D gather: a cache line
        or two), so a probe path costs a round per window, not a round of a dozen numpy calls per
        slot: at 50-60% load linear probing has long tails. The first window is short: most ids
        sit within a few slots of home, and every slot read costs a random read of `ids`. `width`:
        the first window (an insertion's ids are absent: most stop at the first empty slot)."""
        mask = len(self._slots) - 1
        pos = self._home(ids)
        out = np.empty(len(ids), np.int64)
        first_free = np.full(len(ids), -1, np.int64)
        todo = np.arange(len(ids))
        width = width or _FIRST_WINDOW
        while len(todo):
            steps = _STEPS[:width]
            p = (pos[todo][:, None] + steps) & mask
            s = self._slots[p]
            hit = (s > 0) & (self.ids[np.maximum(s, 1) - 1] == ids[todo][:, None])
            stop = hit | (s == _EMPTY)
            ends = stop.any(axis=1)
            first = np.where(ends, stop.argmax(axis=1), width)
            tomb = (s == _TOMB) & (first[:, None] > steps)
            new_free = tomb.any(axis=1) & (first_free[todo] < 0)
            lines = np.flatnonzero(new_free)
            first_free[todo[lines]] = p[lines, tomb[lines].argmax(axis=1)]
            lines = np.flatnonzero(ends)
            at = p[lines, first[lines]]
            found = hit[lines, first[lines]]
            out[todo[lines[found]]] = at[found]
            missing = todo[lines[~found]]
            out[missing] = -1 - np.where(first_free[missing] >= 0, first_free[missing], at[~found])
            todo = todo[~ends]
            pos[todo] = (pos[todo] + width) & mask
            # Widen round by round (the ids left get few): a wide window over many ids is a large temporary.
            width = _FIRST_WINDOW if width < _FIRST_WINDOW else _WINDOW
        return out

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id (any order, repeats allowed), -1 where absent."""
        if len(ids) == 0:
            return np.zeros(0, np.int64)
        first, last = ids[0], ids[-1]
        for changes, seen, rows in self._recent:
            # Ends first: batches of equal length are common (a worker's batch split evenly), and a
            # whole comparison of each remembered batch costs a tenth of the lookup it would save.
            if (changes == self._changes and len(seen) == len(ids) and seen[0] == first and seen[-1] == last
                    and np.array_equal(seen, ids)):
                return rows.copy()
        rows = self._lookup(ids)
        if len(ids) <= _RECENT_IDS:
            self._recent = [(self._changes, ids.copy(), rows.copy()), *self._recent[:_RECENT - 1]]
        return rows

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        # One compiled pass (ps_server.tables.kernels.lookup): the numpy rounds of _probe cost four times
        # as much for a lookup of a few thousand ids, most of it in temporaries.
        from pshard.ps_server.tables import kernels

        rows = np.empty(len(ids), np.int64)
        # Contiguous int64, the layouts warm() compiled for: any other would compile mid-request.
        query = np.ascontiguousarray(ids, np.int64)
        kernels.lookup(self._slots, self.ids, query, 64 - (len(self._slots).bit_length() - 1), rows)
        return rows

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Rows for `ids`, which must be distinct and absent; may grow `row_capacity` (see `grew`)."""
        n = len(ids)
        if n == 0:
            return np.zeros(0, np.int64)
        if self.live + n > MAX_ROWS:
            raise QuotaExceededError(f"a hash index holds at most {MAX_ROWS} rows: {self.live} live, "
                                     f"{n} more asked for (spread the table over more servers, or cap it)")
        if (self.live + self._tombs + n) > _MAX_LOAD * len(self._slots):
            self._rehash(self.live + n)
        self._changes += 1
        rows = self._take_rows(n)
        self.ids[rows] = ids
        # One compiled pass (ps_server.tables.kernels.insert), as for lookups: the numpy rounds cost a
        # disk tier's fetch and spill of a few thousand rows a millisecond each (issue 22).
        from pshard.ps_server.tables import kernels

        reused = kernels.insert(self._slots, self.ids, self.ids[rows], rows, self._shift)
        if reused < 0:
            raise ValueError("IdIndex.insert: an id is already present")
        self._tombs -= reused
        self.live += n
        return rows

    def delete_rows(self, rows: np.ndarray) -> None:
        """Remove the ids of live `rows` (distinct); their rows go back to the free list."""
        if len(rows) == 0:
            return
        from pshard.ps_server.tables import kernels

        rows = np.ascontiguousarray(rows, np.int64)
        if not kernels.delete(self._slots, self.ids, rows, self._shift):
            raise ValueError("IdIndex.delete_rows: a row is not live")
        self._changes += 1
        self._tombs += len(rows)
        self.live -= len(rows)
        self._free = np.concatenate([self._free, rows])

    def live_rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The live rows in [start, stop), ascending (for streaming a table out a chunk at a time)."""
        stop = self.high if stop is None else min(stop, self.high)
        if start >= stop:
            return np.zeros(0, np.int64)
        dead = np.zeros(stop - start, bool)
        f = self._free[(self._free >= start) & (self._free < stop)]
        dead[f - start] = True
        return np.flatnonzero(~dead) + start

    def _take_rows(self, n: int) -> np.ndarray:
        reuse = min(n, len(self._free))
        rows = self._free[len(self._free) - reuse:][::-1].copy()
        self._free = self._free[: len(self._free) - reuse]
        fresh = np.arange(self.high, self.high + n - reuse, dtype=np.int64)
        self.high += n - reuse
        if self.high > len(self.ids):
            self.ids = _grown(self.ids, self.high)
        return np.concatenate([rows, fresh])

    def _rehash(self, need: int) -> None:
        size = _slots_for(need)
        if size < len(self._slots):
            size = len(self._slots)  # never shrink: a table that had many rows is likely to again
        rows = self.live_rows()
        self._slots = np.zeros(size, np.int32)
        self._tombs = 0
        mask = size - 1
        pos = self._home(self.ids[rows])
        todo = np.arange(len(rows))
        while len(todo):
            p = pos[todo]
            free = self._slots[p] == _EMPTY
            cand = todo[free]
            _, first = np.unique(p[free], return_index=True)
            winners = cand[first]
            self._slots[pos[winners]] = (rows[winners] + 1).astype(np.int32)
            placed = np.zeros(len(rows), bool)
            placed[winners] = True
            todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) & mask


def _slots_for(count: int) -> int:
    size = _MIN_SLOTS
    while size * _MAX_LOAD < count * 1.25:  # room to insert 25% more before the next rehash
        size *= 2
    return size


def _grown(a: np.ndarray, need: int) -> np.ndarray:
    """`a` with at least `need` rows; doubling, and new pages stay untouched (np.zeros is lazy)."""
    cap = max(need, 2 * len(a))
    out = np.zeros((cap, *a.shape[1:]), a.dtype)
    out[: len(a)] = a
    return out
