"""A server joining a running job takes table row partitions from its donor (issue 20, item 1): it is the
donor's backup, so it holds their rows; at the switch (the scheduler's plan_join, weighted by the
partitions' bytes) it serves them from its replica, with a sync table's applied clocks of those
partitions only, the donor refuses them, the clients re-route to the new server, and training goes on
exactly. Real servers over gRPC; the layouts are made by hand here, as the scheduler would make them
(tests/e2e/test_join_table.py runs the whole join through the scheduler)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from pshard.common.cluster.moves import plan_join
from pshard.common.sparse import server_of
from pshard.ps_server.replication.table_rows import all_ids

from tests.e2e.harness import wait_until
from tests.service.test_row_partitions import SYNC_SETTINGS, Published, _applied, _layout, _train
from tests.service.test_table_replication import WAIT_S, _replicated, _rows
from tests.service.test_table_replication_sync import CLOCKS, PENDING, TABLE, _expected
from tests.service.test_table_replication_sync import IDS as SYNC_IDS


def test_a_joiner_takes_sync_partitions_of_its_donor_with_their_clocks_and_training_goes_on_exactly(
        start_server, new_client) -> None:
    """Servers 0 and 1 serve six partitions each; server 2 is server 1's backup, outside the layout (a
    joiner catching up). The grown layout gives it some of server 1's partitions: it serves their rows
    and clocks, server 1 the rest, and the clients that knew two servers re-route to the third."""
    servers, layout = _replicated(start_server, lambda addresses: _layout(addresses[:2]),
                                  settings=SYNC_SETTINGS)
    joiner = servers[2].address
    layouts = Published(layout)
    clients = [new_client(servers[:2], f"w{w}", layout=layout, relayout=layouts.relayout,
                          reroute_wait_s=WAIT_S, retry_budget_s=0.5, transport="grpc") for w in (0, 1)]
    for c in clients:
        c.declare_table(TABLE)
    with ThreadPoolExecutor(2) as pool:
        _train(pool, clients, range(PENDING))
        wait_until(lambda: _rows(servers[2]).replicas.clocks(servers[1].address).get(TABLE.name)
                   == _applied(servers[1]), WAIT_S, "the joiner's replica of server 1 holding its clocks")
        # Partitions 5 and 11 (server 2's "home" ones, p mod 3) weigh nothing: it takes others only, which
        # its backup refused from it as from a failed-over server (none of its home partitions its own).
        sizes = [0 if p in (5, 11) else 100 for p in range(layout.partition_count)]
        plan = plan_join(layout, joiner, sizes, live={1})
        taken = {m.item for m in plan.moves if isinstance(m.item, int)}
        assert taken and taken < set(layout.partitions_on(1)) and {m.source for m in plan.moves} == {1}
        grown = plan.after
        assert not taken & set(grown.home_partitions(2))
        for server in servers:
            server.call(lambda server=server: _rows(server).on_layout(grown))
        servers[2].call(lambda: _rows(servers[2]).set_backups([servers[0].address]))
        layouts.publish(grown)
        assert _applied(servers[2]) == {p: PENDING for p in taken}  # theirs only, from the copy
        _train(pool, clients, range(PENDING, CLOCKS))
    np.testing.assert_array_equal(clients[0].pull_rows(TABLE.name, SYNC_IDS, clock=CLOCKS), _expected(CLOCKS))
    assert all(c.layout is grown for c in clients)
    table = servers[2].running.tables.find(TABLE.name)
    assert table is not None
    mine = SYNC_IDS[np.isin(server_of(SYNC_IDS, layout.partition_count), sorted(taken))]
    assert len(mine) and set(all_ids(table).tolist()) == set(mine.tolist())
    assert _applied(servers[2]) == {p: CLOCKS for p in taken}
    kept = _applied(servers[1])  # it keeps the moved partitions' old clocks, as a rebalance's source does
    assert {p: kept[p] for p in grown.partitions_on(1)} == {p: CLOCKS for p in grown.partitions_on(1)}
