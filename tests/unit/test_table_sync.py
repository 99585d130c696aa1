"""Sync clocks per row partition (ps_server/tables/sync.py): what a failover's heir relies on."""

from __future__ import annotations

import numpy as np
from pshard.ps_server.tables.sync import OWN, PartitionClocks

QUORUM = {"a", "b"}
G = np.ones((3, 2), np.float32)


def test_a_push_counts_in_every_partition_served_an_empty_part_too() -> None:
    clocks = PartitionClocks()
    ids, part = np.array([1, 2, 3]), np.array([0, 0, 2])
    assert clocks.push(4, "a", ids, G, part, {0, 2}, QUORUM) == []
    updates = clocks.push(4, "b", ids[:1], 3 * G[:1], part[:1], {0, 2}, QUORUM)  # nothing for partition 2
    assert [(u[0].tolist(), u[1][:, 0].tolist(), u[2]) for u in updates] == [
        ([1, 2], [2.0, 0.5], 4), ([3], [0.5], 4)]  # one update per partition, each the mean of both
    assert clocks.applied() == {0: 5, 2: 5}
    assert clocks.behind(5, {0, 2}) is None and clocks.behind(6, {2}) == (2, 5)


def test_partitions_apply_their_clocks_on_their_own() -> None:
    clocks = PartitionClocks()
    for w in ("a", "b"):
        clocks.push(0, w, np.array([7]), G[:1], 0, {0}, QUORUM)
    clocks.push(1, "a", np.array([7]), G[:1], 0, {0}, QUORUM)
    # A failover brings partition 1 at its replicated clock 1: clock 0 there was applied, and the
    # resent pushes of it are dropped; clock 1 waits for both workers in partition 1 only.
    clocks.adopt({1: 1})
    assert clocks.behind(1, {0, 1}) is None and clocks.behind(2, {1}) == (1, 1)
    assert clocks.push(0, "a", np.array([5, 7]), G[:2], np.array([1, 0]), {0, 1}, QUORUM) == []
    assert clocks.waiting_for(1, 1, QUORUM) == ["a", "b"]
    # b's push of clock 1 completes it in both partitions (a had pushed it to partition 0 before).
    updates = clocks.push(1, "b", np.array([5]), G[:1], np.array([1]), {0, 1}, QUORUM)
    assert sorted(u[2] for u in updates) == [1]  # partition 0's clock 1 (a's partition-1 part is missing)
    assert clocks.behind(2, {0}) is None and clocks.behind(2, {1}) == (1, 1)
    assert clocks.waiting_for(1, 1, QUORUM) == ["a"]
    (ids, mean, clock), = clocks.push(1, "a", np.array([5]), G[:1], np.array([1]), {0, 1}, QUORUM)
    assert (ids.tolist(), mean[:, 0].tolist(), clock) == ([5], [1.0], 1)
    assert clocks.applied() == {0: 2, 1: 2}


def test_clocks_kept_before_the_layout_named_the_partition_become_its() -> None:
    clocks = PartitionClocks()
    clocks.push(3, "a", np.array([1]), G[:1], OWN, (OWN,), QUORUM)
    assert clocks.applied() == {}  # no partition number to replicate it under yet
    clocks.number_own(2)
    clocks.push(3, "b", np.array([1]), G[:1], 2, {2}, QUORUM)
    assert clocks.applied() == {2: 4}
