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
from pshard.common.sparse import TableConfig
from pshard.ps_server.checkpoints.global_part import capture_part, restore_tables, write_image
from pshard.ps_server.core.store import ShardSnapshot
from pshard.ps_server.handlers.tables import TableHandlers
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


def test_a_global_checkpoint_part_restores_the_record_folded_over_servers(tmp_path: Path) -> None:
    """Each server's part holds its tables' records; a restore onto any server count folds them (each
    call's larger push number), so a re-dispatched push is dropped wherever its rows now live."""
    config = TableConfig("emb", 2, initializer="zeros", lr=1.0)
    job = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1), job_id="sched")
    tables = [SparseTable(config), SparseTable(config)]
    for i, (schedule, seq) in enumerate([(7, 1), (7, 0)]):  # push 1 of call 7 reached server 0 only
        tables[i].scheduled.repeated(schedule, seq, 3)
        tables[i].scheduled.record(schedule, seq, i)  # each server's own partition: not the restore's
    tables[1].scheduled.record(9, 2)
    directory = ckpt.new_directory(tmp_path / "root", 1)
    parts = [write_image(directory, capture_part(i, ShardSnapshot(job, (), {}, None, (), {}), {}, [t]))
             for i, t in enumerate(tables)]
    ckpt.commit(directory, 1, job, {}, parts)
    checkpoint = ckpt.load_manifest(directory, verify=True)
    [restored] = restore_tables(checkpoint, 0, 1, SparseTable)
    record = restored.scheduled
    assert (record.floor, record.last, record.parts) == (3, {7: 1, 9: 2}, {})  # over the partitions
    assert restored.scheduled.repeated(7, 1, 3) and not restored.scheduled.repeated(7, 2, 3)


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
