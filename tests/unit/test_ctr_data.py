"""The CTR demo's click log (pshard.worker.ctr_data): deterministic, Zipf-distributed, a ceiling where real
CTR data sits, and an AUC that agrees with scikit-learn's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.worker.ctr_data import CHUNK, ClickLog, CtrSpec, auc
from sklearn.metrics import roc_auc_score

SMALL = CtrSpec(num_ids=50_000, train_samples=8 * CHUNK, test_samples=20_000)


@pytest.fixture(scope="module")
def small() -> ClickLog:
    return ClickLog(SMALL)


def test_a_chunk_is_a_pure_function_of_seed_split_and_index(small: ClickLog) -> None:
    again = ClickLog(SMALL).chunk("train", 3)
    first = small.chunk("train", 3)

    assert np.array_equal(first.ids, again.ids)
    assert np.array_equal(first.labels, again.labels)
    assert np.array_equal(first.prob, again.prob)
    assert not np.array_equal(first.ids, small.chunk("train", 4).ids)
    assert not np.array_equal(first.ids, small.chunk("test", 3).ids)


def test_another_seed_is_another_log(small: ClickLog) -> None:
    other = ClickLog(CtrSpec(seed=1, num_ids=SMALL.num_ids, train_samples=SMALL.train_samples,
                             test_samples=SMALL.test_samples))

    assert not np.array_equal(small.chunk("train", 0).ids, other.chunk("train", 0).ids)
    assert not np.allclose(small.test_set.prob, other.test_set.prob)


def test_shards_partition_the_training_chunks(small: ClickLog) -> None:
    shards = [[c.ids for c in small.shard(rank, 3)] for rank in range(3)]

    assert [len(s) for s in shards] == [3, 3, 2]
    assert sum(small.shard_size(rank, 3) for rank in range(3)) == SMALL.train_chunks * CHUNK
    every = np.concatenate([ids for s in shards for ids in s])
    alone = np.concatenate([c.ids for c in small.shard(0, 1)])
    assert np.array_equal(np.sort(every, axis=0), np.sort(alone, axis=0))
    assert len(list(small.shard(1, 3, epochs=2))) == 6


def test_ids_are_int64_and_no_two_fields_share_one(small: ClickLog) -> None:
    ids = small.chunk("train", 0).ids

    assert ids.dtype == np.int64 and ids.shape == (CHUNK, SMALL.fields)
    assert (ids >= 0).all()
    per_field = [set(np.unique(ids[:, f]).tolist()) for f in range(SMALL.fields)]
    assert sum(len(s) for s in per_field) == len(set().union(*per_field))


def test_ids_follow_each_fields_zipf_law(small: ClickLog) -> None:
    ids = np.concatenate([c.ids for c in small.shard(0, 1)])  # 131,072 impressions
    for field in (SMALL.fields - 1, SMALL.fields // 2):
        counts = np.sort(np.unique(ids[:, field], return_counts=True)[1])[::-1]
        ranks = np.arange(1, 65)
        # P(rank r) ~ r^-s; the generator's continuous law puts rank r's mass near r + 0.5.
        slope = np.polyfit(np.log(ranks + 0.5), np.log(counts[:64]), 1)[0]
        assert slope == pytest.approx(-SMALL.exponents[field], abs=0.12), field
    # The head is heavy and the tail long: the top id of the biggest field is common, most ids are rare.
    big = np.unique(ids[:, -1], return_counts=True)[1]
    assert big.max() > 0.05 * len(ids) and np.median(big) <= 2


def test_the_default_log_has_millions_of_ids_and_a_ceiling_where_real_ctr_data_sits() -> None:
    spec = CtrSpec()
    log = ClickLog(spec)
    test = log.test_set

    assert spec.fields == 26 and sum(spec.vocab_sizes) >= 3_000_000
    assert len(test) == spec.test_samples
    ceiling = auc(test.labels, test.prob)
    assert 0.70 <= ceiling <= 0.85
    assert 0.1 < test.labels.mean() < 0.4  # a click rate, not a coin
    # Labels are drawn from the planted probability: their rate matches its mean.
    assert test.labels.mean() == pytest.approx(test.prob.mean(), abs=0.01)


def test_auc_agrees_with_scikit_learn_ties_included() -> None:
    rng = np.random.default_rng(0)
    labels = rng.random(5000) < 0.3
    for scores in (rng.random(5000), np.round(rng.random(5000), 1), labels + rng.normal(0, 1, 5000)):
        assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert auc(np.array([0, 1]), np.array([0.2, 0.9])) == 1.0
    assert auc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5
    assert math.isnan(auc(np.ones(4), np.arange(4.0)))


def test_bad_specs_and_splits_are_refused(small: ClickLog) -> None:
    with pytest.raises(InvalidArgumentError, match="fields"):
        CtrSpec(fields=1)
    with pytest.raises(InvalidArgumentError, match="num_ids"):
        CtrSpec(num_ids=10)
    with pytest.raises(InvalidArgumentError, match="train_samples"):
        CtrSpec(train_samples=100)
    with pytest.raises(InvalidArgumentError, match="split"):
        small.chunk("validation", 0)
