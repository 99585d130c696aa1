"""More table row partitions than servers (issue 20): the unit a join, a drain or a rebalance moves.

A layout may hash table ids into P >= servers row partitions, partition p first on server p mod n;
the client splits ids by their partition's server, a global checkpoint restores each server's rows
by the same rule (from a checkpoint of any partitioning: it holds ids), and a failover or a move
carries whole partitions. One partition per server stays what every older layout was."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from pshard.client.tables import _Split
from pshard.common.checkpoint_store import Checkpoint, FileEntry
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.moves import plan_join
from pshard.common.cluster.replicas import fail_over
from pshard.common.cluster.view import ManualClock
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig, server_of
from pshard.ps_server.checkpoints import guard
from pshard.ps_server.checkpoints.global_part import restore_tables
from pshard.ps_server.replication.table_rows import all_ids
from pshard.ps_server.tables.files import save_tables
from pshard.ps_server.tables.table import SparseTable
from pshard.scheduler.__main__ import main as scheduler_main
from pshard.scheduler.membership import Membership

PARAMS = [ParamSpec("w", "float32", (64, 4))]
SERVERS = ("a:1", "b:1", "c:1")
IDS = np.arange(-500, 2500, 3, dtype=np.int64)


def test_a_layout_of_more_row_partitions_puts_partition_p_on_server_p_mod_n():
    layout = plan_layout(PARAMS, SERVERS, row_partitions=12)
    assert layout.partition_count == 12 and layout.row_owners == tuple(p % 3 for p in range(12))
    assert layout.partitions_on(1) == layout.home_partitions(1) == (1, 4, 7, 10)
    assert plan_layout(PARAMS, SERVERS, row_partitions=3).row_owners == ()  # one per server: as before
    old = plan_layout(PARAMS, SERVERS)
    assert old.row_owners == () and old.partition_count == 3 and old.home_partitions(2) == (2,)
    with pytest.raises(InvalidArgumentError, match=r"row_partitions: got 2, expected 3 \(one per server\)"):
        plan_layout(PARAMS, SERVERS, row_partitions=2)


def test_the_client_splits_ids_by_their_partitions_server():
    owners = np.array([p % 3 for p in range(12)], np.int64)
    split = _Split(IDS, 3, owners)
    partition = server_of(IDS, 12)
    assert split.partitions == set(np.unique(partition).tolist())
    for s in range(3):
        ids = split.ids[split.part(s)]
        assert set(ids.tolist()) == set(IDS[owners[partition] == s].tolist())
        assert np.all(np.diff(ids) > 0)  # ascending within a server, as the servers check
    # Hashed into 12 partitions, not 3: an id goes where its partition's server is.
    assert not np.array_equal(owners[partition], server_of(IDS, 3))


def test_a_checkpoint_restores_by_partition_owner_whatever_partitioning_wrote_it(tmp_path: Path):
    config = TableConfig("emb", 4, optimizer="sgd", lr=1.0)
    parts = [SparseTable(config), SparseTable(config)]  # written by 2 servers, one partition each
    for number, part in enumerate(parts):
        mine = IDS[server_of(IDS, 2) == number]
        part.push(mine, np.full((len(mine), 4), number + 1, np.float32))
        save_tables(tmp_path, f"part{number}", [part])
    files = tuple(FileEntry(f"part{n}.tables.json", "", 0) for n in range(2))
    checkpoint = Checkpoint(tmp_path, 0, 0.0, JobConfig(), {}, files, servers=2)
    owners = (0, 1, 2, 0, 1, 2, 2, 2)  # 8 partitions on 3 servers, as a move left them
    held = [restore_tables(checkpoint, s, 3, SparseTable, owners)[0] for s in range(3)]
    for s, table in enumerate(held):
        expected = IDS[np.asarray(owners)[server_of(IDS, 8)] == s]
        assert sorted(all_ids(table).tolist()) == sorted(expected.tolist())
    assert sum(len(t) for t in held) == len(IDS)
    whole = SparseTable(config)
    for n in range(2):
        mine = IDS[server_of(IDS, 2) == n]
        whole.push(mine, np.full((len(mine), 4), n + 1, np.float32))
    for table in held:
        ids = all_ids(table)
        np.testing.assert_array_equal(table.pull(ids), whole.pull(ids))


def test_a_restore_refuses_an_owner_outside_the_servers():
    guard.check_servers(1, 3, (0, 1, 2, 2))
    with pytest.raises(InvalidArgumentError, match=r"row_owners\[2\]: 3 is not an index among servers=3"):
        guard.check_servers(1, 3, (0, 1, 3))


def test_the_scheduler_plans_its_row_partitions_per_server_and_restores_such_layouts():
    members = Membership(10.0, row_partitions_per_server=4)
    layout = members.plan(PARAMS, SERVERS, 4096)
    assert layout.partition_count == 12
    assert Membership(10.0).plan(PARAMS, SERVERS, 4096).row_owners == ()
    with pytest.raises(InvalidArgumentError, match=r"row_partitions_per_server: got 0, expected 1 to 4096"):
        Membership(10.0, row_partitions_per_server=0)
    # More than a layout may carry for three servers: the proposal is refused, naming both values.
    says = r"row_partitions: got 6000, expected 3 \(one per server\) to 4096"
    with pytest.raises(InvalidArgumentError, match=says):
        Membership(10.0, row_partitions_per_server=2000).plan(PARAMS, SERVERS, 4096)


def test_a_failover_moves_every_partition_of_the_dead_server_to_its_heir():
    layout = plan_layout(PARAMS, SERVERS, replicas=1, row_partitions=9)
    after, _ = fail_over(layout, 1, {0, 2})
    assert after.partitions_on(1) == () and after.partitions_on(2) == (1, 2, 4, 5, 7, 8)
    assert after.partition_count == 9


def test_a_join_takes_whole_partitions_and_keeps_their_count():
    layout: Layout = plan_layout([], SERVERS, row_partitions=12)
    plan = plan_join(layout, "d:1", [1000] * 12)
    assert plan.after.partition_count == 12 and len(plan.after.servers) == 4
    assert len(plan.after.partitions_on(3)) == 3  # a quarter of the rows, one partition from each
    assert {m.source for m in plan.moves} == {0, 1, 2}
    assert json.dumps(plan.after.row_owners)  # plain ints: it travels as the layout's row_owners


def test_a_restarted_scheduler_is_given_back_a_layout_of_more_partitions_and_refuses_a_bad_owner():
    layout = dataclasses.replace(plan_layout(PARAMS, SERVERS, 4096, 1, row_partitions=12), version=2)
    fresh = Membership(heartbeat_timeout_s=5, clock=ManualClock())
    for address in SERVERS:
        reg = fresh.register("ps", address)
        fresh.heartbeat(reg.node_id, reg.generation, in_sync_layout=2)
    before = fresh.view()
    beyond = dataclasses.replace(layout, row_owners=(*layout.row_owners[:-1], 3))
    with pytest.raises(InvalidArgumentError, match=r"restored layout version 2: 3 servers"):
        fresh.restore_layout(beyond)
    assert fresh.layout() is None and fresh.view() == before
    assert fresh.restore_layout(layout) == (layout, True)


def test_the_scheduler_command_refuses_too_many_row_partitions_before_it_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        scheduler_main(["--row-partitions-per-server", "5000", "--bind", "127.0.0.1:0"], environ={})
    assert exit_.value.code == 2
    assert "--row-partitions-per-server: got 5000, expected at most 4096" in capsys.readouterr().err
