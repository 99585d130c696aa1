"""A sparse table applies each scheduled call's push once (ps_server/tables/scheduled.py), through the table
handlers as both transports call them: a re-dispatched call's push is dropped whichever worker sends it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from pshard.common import checkpoint_store as ckpt
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig, server_of
from pshard.ps_server.checkpoints.global_part import capture_part, restore_tables, write_image
from pshard.ps_server.core.store import ShardSnapshot
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.replication.table_rows import ReplicaTables, capture, install, merge
from pshard.ps_server.replication.table_wire import batch_from_proto, batch_to_proto
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.scheduled import KEPT, ScheduledPushes
from pshard.ps_server.tables.table import SparseTable


def test_a_push_number_is_repeated_once_applied_and_every_push_of_a_finished_call_is() -> None:
    record = ScheduledPushes()
    assert not record.repeated(10, 0, 0)
    record.record(10, 0)
    assert record.repeated(10, 0, 0)
    assert not record.repeated(10, 1, 0)  # the call's next push
    assert not record.repeated(11, 0, 0)  # another call
    assert record.repeated(10, 5, 11)  # below the floor: finished, any push of it is a late repeat
    assert not record.repeated(11, 0, 0)  # the floor only rises


def test_the_record_forgets_finished_calls_once_it_holds_many() -> None:
    record = ScheduledPushes()
    for schedule in range(1, KEPT + 2):
        record.record(schedule, 0)
    record.repeated(KEPT + 2, 0, KEPT + 1)
    record.record(KEPT + 2, 0)
    assert sorted(record.last) == [KEPT + 1, KEPT + 2]


def _ids(*ids: int) -> bytes:
    return np.array(ids, np.int64).tobytes()


def _grads(n: int, step: float) -> bytes:
    return np.full((n, 2), -step, np.float32).tobytes()


def test_a_scheduled_push_sent_again_by_another_worker_counts_once() -> None:
    async def main() -> None:
        handlers = TableHandlers(ServerSettings())
        await handlers.declare(TableConfig("emb", 2, initializer="zeros", lr=1.0))
        assert await handlers.push("emb", _ids(1, 2), _grads(2, 1.0), worker="worker-0",
                                   schedule=(7, 0, 7)) == 2
        assert await handlers.push("emb", _ids(1, 2), _grads(2, 1.0), worker="worker-1",
                                   schedule=(7, 0, 7)) == 0
        stored, rows = await handlers.push_pull("emb", _ids(1), _grads(1, 2.0), _ids(1, 2),
                                                worker="worker-1", schedule=(7, 1, 7))
        assert stored == 1
        again, rows = await handlers.push_pull("emb", _ids(1), _grads(1, 2.0), _ids(1, 2),
                                               worker="worker-0", schedule=(7, 1, 7))
        assert again == 0
        assert rows.tolist() == [[3.0, 3.0], [1.0, 1.0]]
        assert await handlers.push("emb", _ids(1), _grads(1, 1.0), worker="worker-0") == 1  # unscheduled
    asyncio.run(main())


def test_a_sync_table_refuses_a_scheduled_push_and_stays_unchanged() -> None:
    async def main() -> None:
        handlers = TableHandlers(ServerSettings())
        await handlers.declare(TableConfig("s", 2, initializer="zeros", mode="sync"))
        handlers.set_quorum({"worker-0": 0})
        with pytest.raises(InvalidArgumentError, match="schedule_id: worker 'worker-0' pushed for scheduled "
                                                       "call 7 to sync table 's'"):
            await handlers.push("s", _ids(1), _grads(1, 1.0), worker="worker-0", schedule=(7, 0, 7))
        assert (await handlers.pull("s", _ids(1))).tolist() == [[0.0, 0.0]]
    asyncio.run(main())


def test_a_restored_server_drops_a_scheduled_push_its_checkpoint_holds_and_an_older_one_loads(
        tmp_path: Path) -> None:
    """The record is saved with the table (the server's own checkpoint): a call re-dispatched after a
    restart counts once. A checkpoint from before the record loads, with an empty one."""
    async def main() -> None:
        settings = ServerSettings(checkpoint_dir=str(tmp_path), shard_name="server-0")
        handlers = TableHandlers(settings)
        await handlers.declare(TableConfig("emb", 2, initializer="zeros", lr=1.0))
        assert await handlers.push("emb", _ids(1, 2), _grads(2, 1.0), worker="worker-0",
                                   schedule=(7, 0, 5)) == 2
        assert await handlers.checkpoint() is not None
        restored = TableHandlers(settings)
        assert await restored.push("emb", _ids(1, 2), _grads(2, 1.0), worker="worker-1",
                                   schedule=(7, 0, 5)) == 0
        assert await restored.push("emb", _ids(1), _grads(1, 1.0), worker="worker-1",
                                   schedule=(7, 1, 5)) == 1  # the call's next push
        assert (await restored.pull("emb", _ids(1, 2))).tolist() == [[2.0, 2.0], [1.0, 1.0]]
        for meta in tmp_path.glob("server-0.tables-*/t0/table.json"):  # as an older server wrote it
            saved = json.loads(meta.read_text())
            del saved["scheduled"]
            meta.write_text(json.dumps(saved))
        older = TableHandlers(settings)
        assert await older.push("emb", _ids(1), _grads(1, 1.0), worker="worker-1", schedule=(7, 0, 5)) == 1
    asyncio.run(main())


def _global_checkpoint(root: Path, sources: list[TableHandlers], partition_count: int = 0) -> ckpt.Checkpoint:
    """A committed global checkpoint of `sources`' tables, part i written by server i."""
    job = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1), job_id="sched")
    directory = ckpt.new_directory(root, 1)
    parts = [write_image(directory, capture_part(i, ShardSnapshot(job, (), {}, None, (), {}), {}, h.tables(),
                                                 partition_count=partition_count))
             for i, h in enumerate(sources)]
    ckpt.commit(directory, 1, job, {}, parts)
    return ckpt.load_manifest(directory, verify=True)


async def _call_7_half_pushed(ids: np.ndarray) -> tuple[list[TableHandlers], list[int]]:
    """Two servers, each with its rows of `ids`: call 5 pushed every row, push 0 of call 7 has reached
    server 0 and not yet server 1. (The servers, the rows each of those three pushes stored.)"""
    home = server_of(ids, 2)
    sources = [TableHandlers(ServerSettings()) for _ in range(2)]
    stored = []
    for i, h in enumerate(sources):
        await h.declare(TableConfig("emb", 2, initializer="zeros", lr=1.0))
        mine = ids[home == i]
        stored.append(await h.push("emb", mine.tobytes(), _grads(len(mine), 1.0), worker="worker-0",
                                   schedule=(5, 0, 3)))
    mine = ids[home == 0]
    stored.append(await sources[0].push("emb", mine.tobytes(), _grads(len(mine), 1.0), worker="worker-1",
                                        schedule=(7, 0, 3)))
    return sources, stored


def _restore(checkpoint: ckpt.Checkpoint, servers: list[TableHandlers]) -> list[TableHandlers]:
    """`servers`, server s of them given its rows of every table of `checkpoint`."""
    for s, h in enumerate(servers):
        for table in restore_tables(checkpoint, s, len(servers), h.make):
            h.add(table)
    return servers


async def _redispatched(servers: list[TableHandlers], ids: np.ndarray, *calls: int) -> list[float]:
    """Push 0 of each of `calls` sent again, to each of `servers` with its rows of `ids`: then every row's
    first value, server by server."""
    now = server_of(ids, len(servers))
    for s, h in enumerate(servers):
        mine = ids[now == s]
        for call in calls:
            await h.push("emb", mine.tobytes(), _grads(len(mine), 1.0), worker="worker-2",
                         schedule=(call, 0, 3))
    rows = [(await h.pull("emb", ids[now == s].tobytes()))[:, 0] for s, h in enumerate(servers)]
    return np.concatenate(rows).tolist()


async def _restored_after_call_7(root: Path, config: TableConfig, ids: np.ndarray) -> tuple[SparseTable, int]:
    """Call 7's push of every row of `ids` in a global checkpoint under `root`, and the table restored from
    it onto one server: (that table, the rows the push stored)."""
    source = TableHandlers(ServerSettings())
    await source.declare(config)
    stored = await source.push("emb", ids.tobytes(), _grads(len(ids), 1.0), worker="worker-0",
                               schedule=(7, 0, 3))
    (restored,) = restore_tables(_global_checkpoint(root, [source]), 0, 1,
                                 TableHandlers(ServerSettings()).make)
    return restored, stored


def test_a_push_that_reached_some_servers_at_a_global_checkpoint_lands_once_on_every_row_after_a_restore(
        tmp_path: Path) -> None:
    """Push 0 of call 7 had reached server 0 and not yet server 1 when the global checkpoint was taken.
    Re-dispatched after a restore onto the same two servers, onto one or onto three, it lands on the rows
    of server 1's part only: every row holds it once. (The parts' records folded into one dropped it
    there: an update lost.)"""
    ids = np.arange(1, 13, dtype=np.int64)

    async def main() -> None:
        sources, stored = await _call_7_half_pushed(ids)  # call 5 before: every row at 1
        assert all(n > 0 for n in stored)
        checkpoint = _global_checkpoint(tmp_path / "root", sources)
        assert ckpt.last_scheduled_call(checkpoint) == 7  # calls 5 and 7 (floor 3)
        for servers in (2, 1, 3):
            restored = _restore(checkpoint, [TableHandlers(ServerSettings()) for _ in range(servers)])
            rows = await _redispatched(restored, ids, 7, 5)  # call 5's push too: every row had it
            assert rows == [2.0] * len(ids), servers
    asyncio.run(main())


def test_a_parts_partition_records_hold_for_its_rows_of_each_partition_and_finished_calls_drop_them() -> None:
    record = ScheduledPushes()
    ids = np.arange(1, 41, dtype=np.int64)
    of = server_of(ids, 4)
    state = {"floor": 3, "last": {"8": 0}, "partitions": {"1": {"7": 1}, "2": {"7": 0}}, "partition_count": 4}
    record.restore_part(state, ids[(of == 1) | (of == 2)])  # an heir's part: partitions 1 and 2
    keep = record.fresh(7, 1, 3, -1, ids)
    assert keep is not None and keep.tolist() == (of != 1).tolist()  # push 1 had reached partition 1 only
    keep = record.fresh(8, 0, 3, -1, ids)
    assert keep is not None and keep.tolist() == ((of != 1) & (of != 2)).tolist()  # the part's every-row one
    assert record.fresh(9, 0, 3, -1, ids) is None  # a call it never saw
    assert record.fresh(7, 2, 3, -1, ids) is None and record.restored
    assert record.fresh(10, 0, 9, -1, ids) is None and not record.restored  # floor 9: 7 and 8 finished
    older = ScheduledPushes()
    older.restore_part({"floor": 3, "last": {}, "partitions": {"1": {"7": 1}}}, ids[:5])  # no count: its rows
    keep = older.fresh(7, 1, 3, np.zeros(len(ids), np.int64), ids)
    assert keep is not None and keep.tolist() == [False] * 5 + [True] * 35


def test_the_record_is_per_partition_and_a_push_spanning_partitions_keeps_the_rows_of_fresh_ones() -> None:
    record = ScheduledPushes()
    record.record(7, 0, np.array([2, 2, 2]))  # push 0 of call 7 reached partition 2 only
    partition = np.array([1, 2, 1, 2])
    keep = record.fresh(7, 0, 3, partition)
    assert keep is not None and keep.tolist() == [True, False, True, False]
    assert record.fresh(7, 1, 3, partition) is None  # the call's next push: new everywhere
    record.record(7, 0, partition)
    keep = record.fresh(7, 0, 3, partition)
    assert keep is not None and not keep.any()
    assert record.fresh(7, 0, 3, 1) is not None and record.fresh(7, 0, 3, 3) is None  # one partition served
    assert record.parts == {1: {7: 0}, 2: {7: 0}} and record.last == {}
    assert record.fresh(6, 9, 7, 3) is not None  # below the floor: finished, everywhere


def test_a_saved_record_loads_per_partition_an_older_one_everywhere_and_heirs_fold_nothing_across() -> None:
    record = ScheduledPushes()
    record.record(7, 2, 1)
    record.record(8, 0)  # before the layout was known: every partition's
    saved = json.loads(json.dumps(record.state()))
    loaded = ScheduledPushes()
    loaded.load(saved)
    assert (loaded.last, loaded.parts) == ({8: 0}, {1: {7: 2}})
    older = ScheduledPushes()
    older.load({"floor": 4, "last": {"7": 2}})  # from before partitions: applies to all of them
    keep = older.fresh(7, 2, 4, np.array([0, 5]))
    assert older.floor == 4 and keep is not None and not keep.any()
    heir = ScheduledPushes()
    heir.record(7, 5, 2)
    heir.merge(record.floor, record.last, record.parts)  # the dead primary's partition 1
    assert heir.parts == {1: {7: 2}, 2: {7: 5}}
    assert heir.repeated(7, 2, 0, 1) and not heir.repeated(7, 3, 0, 1)


def test_a_restored_record_reaches_a_backup_with_its_rows_and_an_heir_drops_the_re_dispatch(
        tmp_path: Path) -> None:
    """Call 7's push is in a global checkpoint. The restored primary's rows reach a backup in two batches
    (a new backup's copy, chunked), each with the record of its own rows; the heir that takes the replica
    over drops the call's re-dispatch on every restored row, and applies it to a row the checkpoint lacks."""
    ids = np.arange(1, 9, dtype=np.int64)
    config = TableConfig("emb", 2, initializer="zeros", lr=1.0)

    async def main() -> None:
        primary, stored = await _restored_after_call_7(tmp_path / "root", config, ids)
        assert stored == len(ids)
        replica = SparseTable(config)
        for rows in (ids[:3], ids[3:]):
            batch = batch_from_proto(batch_to_proto(capture(primary, rows)))
            assert [r.tolist() for r, _ in batch.restored] == [rows.tolist()]
            install(replica, batch)
        heir = TableHandlers(ServerSettings())
        await heir.declare(config)
        table = heir.find("emb")
        assert table is not None
        merge(table, replica)
        with_new = np.append(ids, 99)
        assert await heir.push("emb", with_new.tobytes(), _grads(len(with_new), 1.0), worker="worker-1",
                               schedule=(7, 0, 3)) == 1
        assert (await heir.pull("emb", with_new.tobytes()))[:, 0].tolist() == [1.0] * len(with_new)
    asyncio.run(main())


def test_a_moved_partition_takes_its_scheduled_records_to_its_new_server(tmp_path: Path) -> None:
    """A rebalance copies partition 1's rows from its primary's replica to the server taking it: call 7's
    push (in the global checkpoint the primary was restored from) and call 9's (applied since) go with them,
    so the call's re-dispatch to the new server applies nothing."""
    ids = np.arange(1, 13, dtype=np.int64)
    config = TableConfig("emb", 2, initializer="zeros", lr=1.0)

    async def main() -> None:
        primary, _ = await _restored_after_call_7(tmp_path / "root", config, ids)
        primary.push(ids, np.ones((len(ids), 2), np.float32))
        primary.scheduled.record(9, 0, 1)  # call 9's push, applied to partition 1's rows since
        replicas = ReplicaTables()
        replicas.apply("ps-0", [capture(primary, ids)])
        (part, _, _), = replicas.copy("ps-0", lambda rows: server_of(rows, 2) == 1, lambda: None)
        target = TableHandlers(ServerSettings())
        await target.declare(config)
        table = target.find("emb")
        assert table is not None
        merge(table, part)
        moved = ids[server_of(ids, 2) == 1]
        assert await target.push("emb", moved.tobytes(), _grads(len(moved), 1.0), worker="worker-1",
                                 schedule=(7, 0, 3)) == 0
        assert table.scheduled.repeated(9, 0, 3, 1)  # partition 1's own record
    asyncio.run(main())


def test_restored_records_join_by_record_hold_rows_once_and_go_once_their_calls_finished() -> None:
    record = ScheduledPushes()
    record.hold_restored([(np.array([5, 1, 3]), {7: 0}), (np.array([2]), {8: 1})])
    record.hold_restored([(np.array([3, 9]), {7: 0})])  # row 3 again (a push re-shipped it), row 9 new
    assert [(r.tolist(), k) for r, k in record.restored] == [([1, 3, 5, 9], {7: 0}), ([2], {8: 1})]
    over = record.restored_over(np.array([9, 2, 4]))
    assert [(r.tolist(), k) for r, k in over] == [([9], {7: 0}), ([2], {8: 1})]
    record.replace(9, {}, {})  # the primary's floor passed calls 7 and 8 (a backup's replica)
    record.hold_restored([(np.array([4]), {7: 0})])
    assert record.restored == []


def test_a_replica_batch_with_a_torn_restored_record_is_refused_naming_the_field() -> None:
    table = SparseTable(TableConfig("emb", 2, initializer="zeros"))
    table.scheduled.hold_restored([(np.array([1, 2]), {7: 0})])
    msg = batch_to_proto(capture(table, np.array([1, 2], np.int64)))
    msg.restored_scheduled[0].ids = msg.restored_scheduled[0].ids[:-3]
    with pytest.raises(InvalidArgumentError, match=r"'emb': restored_scheduled\[0\]\.ids: got 13 bytes, "
                                                   r"expected a multiple of 8"):
        batch_from_proto(msg)


def test_a_restored_record_goes_into_the_next_checkpoints_until_its_call_finishes(tmp_path: Path) -> None:
    """Call 7's push had reached server 0's rows only when checkpoint A was taken. Restored from A, the
    servers take global checkpoint B (and server 0 its own) before the call is re-dispatched: restored
    from B (onto two servers or three) or from its own, the re-dispatch still lands only on the rows that
    never had it, every row at 2. (B saved no restored record: server 0's rows got call 7 twice, at 3.)"""
    ids = np.arange(1, 13, dtype=np.int64)

    def own() -> list[TableHandlers]:  # two servers, each with a checkpoint of its own
        return [TableHandlers(ServerSettings(checkpoint_dir=str(tmp_path / f"own{s}"), shard_name="ps"))
                for s in range(2)]

    async def main() -> None:
        sources, _ = await _call_7_half_pushed(ids)
        first = _global_checkpoint(tmp_path / "a", sources)
        middle = _restore(first, own())
        for h in middle:
            assert await h.checkpoint() is not None  # the server's own table checkpoint
        second = _global_checkpoint(tmp_path / "b", middle)
        assert ckpt.last_scheduled_call(second) == 7  # a relaunched coordinator numbers its calls above
        restores = [own()]  # each loads its own checkpoint
        for servers in (2, 3):
            restores.append(_restore(second, [TableHandlers(ServerSettings()) for _ in range(servers)]))
        for restored in restores:
            got = await _redispatched(restored, ids, 7)
            assert got == [2.0] * len(ids), len(restored)
    asyncio.run(main())


def test_a_saved_restored_record_reloads_over_its_rows_and_a_finished_one_is_not_saved() -> None:
    record = ScheduledPushes()
    record.hold_restored([(np.array([1, 3, 5]), {7: 0}), (np.array([2]), {8: 1})])
    saved = json.loads(json.dumps(record.state(4)))
    part = ScheduledPushes()
    part.restore_part(saved, np.array([2, 3, 4, 5]))  # a restore takes rows 2 to 5 from this part
    assert [(r.tolist(), k) for r, k in part.restored] == [([3, 5], {7: 0}), ([2], {8: 1})]
    own = ScheduledPushes()
    own.load(saved)
    assert [(r.tolist(), k) for r, k in own.restored] == [([1, 3, 5], {7: 0}), ([2], {8: 1})]
    record.repeated(9, 0, 9)  # the floor passed calls 7 and 8
    assert "restored" not in record.state()
