"""A synthetic click log for the CTR demo, with labels drawn from a planted, seeded ground-truth model.

Each impression has `fields` categorical features. Field f draws a rank from a bounded Zipf law
(P(rank r) ~ r^-s over 1..vocab_f) and the id is a 63-bit hash of (seed, field, rank): arbitrary
int64 keys, as real feature ids are, distinct across fields. The field sizes are log-spaced, from a
handful of values (device, weekday) to millions (user, ad), and sum to about `num_ids`.

The planted model is logistic:

    logit = bias + sum_f sigma_f * w_f[rank_f] + sum_{(f, g) in PAIRS} <v_f[rank_f], v_g[rank_g]>

with standard normal per-id weights w and latent vectors v derived from hashes, so they need no
storage beyond one table per field computed once. A label is Bernoulli(sigmoid(logit)). That
probability scores the test set as well as anything can: its AUC is the ceiling a trained model
is measured against (between 0.70 and 0.85 for the default spec, as real CTR data sits).

The log is generated on the fly in chunks: chunk i of a split is a pure function of (seed, split, i),
so every worker, run and machine sees the same impressions, and worker `rank` of `world` trains on
chunks rank, rank + world, ... (its shard) without anything being written to disk.

Pure: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from pshard.common.errors import InvalidArgumentError
from pshard.common.sparse import mix64

CHUNK = 16_384  # impressions per generated chunk; batch sizes that divide it use every impression
SPLITS = {"train": 1, "test": 2}
_LATENT = 4  # rank of the planted pairwise term
_SIZE_SPREAD = 5.0  # the largest field has about 10^5 times the values of the smallest


@dataclass(frozen=True)
class CtrSpec:
    """What the click log looks like; equal specs give equal logs."""

    seed: int = 0
    num_ids: int = 4_000_000  # distinct ids over all fields (the id space, not all of it is seen)
    fields: int = 26
    train_samples: int = 2_000_000
    test_samples: int = 100_000
    zipf_low: float = 1.05  # Zipf exponents run from this (largest field) ...
    zipf_high: float = 1.35  # ... to this (smallest): big vocabularies have flatter heads
    weight_scale: float = 0.3  # std of a field's per-id weight over its traffic
    head_focus: float = 0.4  # how fast per-id effects fade down a field's tail (0: they do not)
    pair_scale: float = 0.7  # std of the pairwise term
    bias: float = -1.2  # about 25 % clicks

    def __post_init__(self) -> None:
        def bad(name: str, got: object, expected: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"ctr spec: {name}: got {got!r}, expected {expected}")

        if not 2 <= self.fields <= 256:
            raise bad("fields", self.fields, "2 to 256")
        if self.num_ids < 4 * self.fields:
            raise bad("num_ids", self.num_ids, f">= {4 * self.fields} (4 per field)")
        if self.train_samples < CHUNK or self.test_samples < 1:
            raise bad("train_samples/test_samples", (self.train_samples, self.test_samples),
                      f">= {CHUNK} and >= 1")
        if not 1.0 < self.zipf_low <= self.zipf_high < 4.0:
            raise bad("zipf_low/zipf_high", (self.zipf_low, self.zipf_high), "1 < low <= high < 4")
        if not 0 <= self.seed < 1 << 62:
            raise bad("seed", self.seed, "0 to 2**62-1")

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        """Values per field, log-spaced from small to large, summing to about num_ids."""
        shares = [10 ** (_SIZE_SPREAD * f / (self.fields - 1)) for f in range(self.fields)]
        total = sum(shares)
        return tuple(max(4, round(self.num_ids * s / total)) for s in shares)

    @property
    def exponents(self) -> tuple[float, ...]:
        lo, hi = self.zipf_low, self.zipf_high
        return tuple(hi - (hi - lo) * f / (self.fields - 1) for f in range(self.fields))

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """Field pairs that interact: each field with the one half the fields away (user x ad)."""
        half = self.fields // 2
        return tuple((f, f + half) for f in range(half))

    @property
    def train_chunks(self) -> int:
        return self.train_samples // CHUNK


@dataclass(frozen=True)
class Clicks:
    """A slice of the log: ids (n, fields) int64, labels (n,) float32 in {0, 1}, and the planted
    click probability (n,) float64."""

    ids: np.ndarray
    labels: np.ndarray
    prob: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _normals(key: int, ranks: np.ndarray, columns: int = 1) -> np.ndarray:
    """Standard normals (len(ranks), columns), a pure function of (key, rank, column): Box-Muller on the
    two 32-bit halves of one hash."""
    at = np.asarray(ranks, np.uint64)[:, None] * np.uint64(columns) + np.arange(columns, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = mix64(at + np.uint64(key))
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0 ** -32
    u2 = (h & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0 ** -32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def _key(seed: int, field: int, what: int) -> int:
    return int(mix64(np.array([(seed << 16) ^ (field << 4) ^ what], np.uint64))[0])


class ClickLog:
    """The log of one spec: chunks of impressions, the test set, and the planted model."""

    def __init__(self, spec: CtrSpec) -> None:
        self.spec = spec
        self._vocab = spec.vocab_sizes
        self._exp = spec.exponents
        # Per-id effects shrink down each field's tail: popular ids have distinctive click rates, rare
        # ones sit near the average (as in real logs, where the signal of a rare id cannot be told from
        # noise). Each field's weights have variance weight_scale**2 under its own traffic; without the
        # tail damping the ceiling would be out of reach of any learner that sees an id a few times.
        self._scales = [self._rank_scales(v, s) for v, s in zip(self._vocab, self._exp, strict=True)]
        # One table per field, indexed by rank - 1: computed once (8 bytes per id, 16 more if paired).
        self._weights = [spec.weight_scale * self._scales[f]
                         * _normals(_key(spec.seed, f, 1), np.arange(v))[:, 0]
                         for f, v in enumerate(self._vocab)]
        paired = {f for pair in spec.pairs for f in pair}
        # Each pair's dot product has variance _LATENT * sigma**4: the whole term's std is pair_scale.
        pair_sigma = (spec.pair_scale**2 / (len(spec.pairs) * _LATENT)) ** 0.25
        self._latent = {f: (pair_sigma * self._scales[f][:, None] * _normals(
            _key(spec.seed, f, 2), np.arange(self._vocab[f]), _LATENT)).astype(np.float32)
            for f in sorted(paired)}
        self._id_keys = [np.uint64(_key(spec.seed, f, 3)) for f in range(spec.fields)]

    def _rank_scales(self, vocab: int, s: float) -> np.ndarray:
        """rank^-(head_focus * s), normalised to mean square 1 under the field's Zipf traffic."""
        ranks = np.arange(1, vocab + 1, dtype=np.float64)
        traffic = ranks ** -s
        damp = ranks ** -(self.spec.head_focus * s)
        return damp / math.sqrt(float((traffic * damp**2).sum() / traffic.sum()))

    @cached_property
    def test_set(self) -> Clicks:
        return self._concat([self.chunk("test", i) for i in range(math.ceil(self.spec.test_samples / CHUNK))],
                            self.spec.test_samples)

    def chunk(self, split: str, index: int) -> Clicks:
        """Chunk `index` of `split` ("train" or "test"): CHUNK impressions."""
        if split not in SPLITS:
            raise InvalidArgumentError(f"split: got {split!r}, expected one of {tuple(SPLITS)}")
        rng = np.random.default_rng(np.random.SeedSequence([self.spec.seed, SPLITS[split], index]))
        ranks = np.empty((CHUNK, self.spec.fields), np.int64)
        for f, (vocab, s) in enumerate(zip(self._vocab, self._exp, strict=True)):
            ranks[:, f] = _zipf_ranks(rng.random(CHUNK), vocab, s)
        prob = self.probability(ranks)
        labels = (rng.random(CHUNK) < prob).astype(np.float32)
        return Clicks(self.ids_of(ranks), labels, prob)

    def shard(self, rank: int, world: int, epochs: int = 1) -> Iterator[Clicks]:
        """Worker `rank` of `world`: its training chunks (every world-th), `epochs` times over."""
        for _ in range(epochs):
            for i in range(rank, self.spec.train_chunks, world):
                yield self.chunk("train", i)

    def shard_size(self, rank: int, world: int) -> int:
        return len(range(rank, self.spec.train_chunks, world)) * CHUNK

    def probability(self, ranks: np.ndarray) -> np.ndarray:
        """The planted model's click probability for (n, fields) ranks (1-based)."""
        logit = np.full(len(ranks), self.spec.bias)
        for f, table in enumerate(self._weights):
            logit += table[ranks[:, f] - 1]
        for f, g in self.spec.pairs:
            logit += np.einsum("ij,ij->i", self._latent[f][ranks[:, f] - 1], self._latent[g][ranks[:, g] - 1])
        return 1.0 / (1.0 + np.exp(-logit))

    def ids_of(self, ranks: np.ndarray) -> np.ndarray:
        """Feature ids: a 63-bit hash of (seed, field, rank): arbitrary int64s, no two fields share one."""
        ids = np.empty(ranks.shape, np.int64)
        for f, key in enumerate(self._id_keys):
            ids[:, f] = (mix64(ranks[:, f].astype(np.uint64) ^ key) >> np.uint64(1)).astype(np.int64)
        return ids

    @staticmethod
    def _concat(parts: list[Clicks], n: int) -> Clicks:
        return Clicks(*(np.concatenate([getattr(p, a) for p in parts])[:n]
                        for a in ("ids", "labels", "prob")))


def _zipf_ranks(u: np.ndarray, vocab: int, s: float) -> np.ndarray:
    """Ranks 1..vocab with P(r) ~ r^-s: the inverse CDF of the continuous power law on [1, vocab + 1),
    floored (exact enough for the tail, no per-rank table)."""
    top = (vocab + 1.0) ** (1.0 - s)
    x = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - s))
    return np.clip(x.astype(np.int64), 1, vocab)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half); NaN without both classes."""
    labels = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise InvalidArgumentError(f"auc: {labels.shape[0]} labels and {scores.shape[0]} scores")
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Average ranks over ties: each run of equal scores gets the mean of its 1-based positions.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))
