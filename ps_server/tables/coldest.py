"""Which rows are the coldest: the selection behind a table's spills to its disk tier and its max_rows
evictions (ps_server.tables.table).

A table's scores are its rows' last touches (clocks, or seconds) or update counts, so most of them are
ties: after a fill, 97,000 of a disk-tier server's 125,000 RAM rows had touch 0. numpy's argpartition
(introselect) degrades on ties: 22 ms for those 125,000 scores, 3.8 s for 10 M with 8 M equal, where a
sort of the same scores takes 2 ms and 0.2 s. So the selection sorts a copy of the scores for the
threshold (the excess-th lowest), then takes every score below it and the first positions equal to it.
"""

from __future__ import annotations

import numpy as np


def coldest(score: np.ndarray, excess: int) -> np.ndarray:
    """Positions of the `excess` lowest finite scores (fewer if fewer are finite), ascending positions.
    `score`: float64, no NaN (an infinite score is a row that must stay)."""
    if excess <= 0:
        return np.zeros(0, np.int64)
    if excess >= len(score):
        return np.flatnonzero(np.isfinite(score))
    threshold = np.sort(score)[excess - 1]
    if not np.isfinite(threshold):  # fewer finite scores than the excess: all of them
        return np.flatnonzero(np.isfinite(score))
    below = np.flatnonzero(score < threshold)
    tied = np.flatnonzero(score == threshold)[: excess - len(below)]
    return np.sort(np.concatenate([below, tied]))
