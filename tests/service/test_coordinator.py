"""ClusterCoordinator against a real scheduler, a real parameter server and serving workers on threads
(tests/service/coordinator_cluster.py): TensorFlow's sample, per-worker iterators, a raising function,
refusals before anything is sent, a worker cut off mid-call, no worker left, a coordinator that dies."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError, NoWorkersError, ScheduledFunctionError
from pshard.common.sparse import TableConfig

from tests.e2e.harness import wait_until
from tests.service import coordinator_functions as f
from tests.service.coordinator_cluster import WAIT_S, cluster
from tests.service.cuttable_link import CuttableLink

HEARTBEAT_TIMEOUT_S = 2.0
SLACK_S = 1.5  # beyond two heartbeat timeouts: the expiry sweep, the view's delivery, a loaded host


def test_tensorflows_sample_adds_one_to_five_on_the_servers() -> None:
    with cluster(workers=2) as c:
        for i in range(2):
            c.start_worker(i)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            added = [coordinator.schedule(f.add, args=(v, x)) for x in (1, 2, 3, 4, 5)]
            coordinator.join()

            assert [r.fetch() for r in added] == [1.0, 2.0, 3.0, 4.0, 5.0]
            assert v.read_value().tolist() == [15.0]
            assert {r.worker for r in added} <= {"worker-0", "worker-1"}
            assert coordinator.done()
    assert c.exits == {"worker-0": 0, "worker-1": 0}  # the coordinator left: its workers exit


def test_a_serving_worker_sets_torchs_threads_from_its_threads_flag_as_a_training_worker_does() -> None:
    import torch

    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    try:
        with cluster(workers=1) as c:
            c.start_worker(0, threads=wanted)  # on a thread: torch's threads are this process's
            with c.coordinator() as coordinator:
                coordinator.create_variable("v", np.zeros(1, np.float32))
                assert coordinator.schedule(f.torch_threads).fetch(WAIT_S) == wanted
    finally:
        torch.set_num_threads(before)


def test_a_workers_iterator_is_made_once_and_kept_between_calls() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            it = iter(coordinator.create_per_worker_dataset(f.count_to, 3))
            taken = [coordinator.schedule(f.add_next, args=(v, it)) for _ in range(3)]
            fresh = coordinator.schedule(f.add_next, args=(v, iter(coordinator.create_per_worker_dataset(
                "tests.service.coordinator_functions:count_to", 3))))
            coordinator.join()

            assert [r.fetch() for r in taken] == [1, 2, 3]
            assert fresh.fetch() == 1  # another iter(): another iterator on the worker
            assert v.read_value().tolist() == [7.0]


def test_a_workers_calls_run_in_the_order_scheduled_on_its_service_thread_itself() -> None:
    """Two calls in flight per worker on one Serve stream: run in the order sent, with no hop to a thread
    and back (the unary Run per call ran them on an executor thread, asyncio_N)."""
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            it = iter(coordinator.create_per_worker_dataset(f.count_to, 31))
            ran = [coordinator.schedule(f.thread_and_next, args=(it,)) for _ in range(30)]
            coordinator.join()

            assert [r.fetch()[1] for r in ran] == list(range(1, 31))
            assert {r.fetch()[0] for r in ran} == {f"worker-service-{c.workers[0]}"}
            # ... as on a thread of its own: a function may run a loop of its own (asyncio.run), and the
            # worker serves on after it.
            assert coordinator.schedule(f.run_a_loop_of_its_own, args=(21,)).fetch(WAIT_S) == [42, True]
            assert coordinator.schedule(f.thread_and_next, args=(it,)).fetch(WAIT_S)[1] == 31


def test_a_fused_push_pull_counts_once_and_its_weights_answer_the_workers_next_call() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            first = coordinator.schedule(f.add_fused, args=(2.0,)).fetch(WAIT_S)
            second = coordinator.schedule(f.add_fused, args=(3.0,)).fetch(WAIT_S)

            assert first == [0.0, 2.0, 2.0]
            assert second == [2.0, 5.0, 5.0]  # no pull: the weights its last step got back
            assert v.read_value().tolist() == [5.0]


def test_push_pull_lands_the_weights_in_the_arrays_given_and_latest_copies_them_only_elsewhere() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            first = coordinator.schedule(f.add_landing, args=(2.0,)).fetch(WAIT_S)
            second = coordinator.schedule(f.add_landing, args=(3.0,)).fetch(WAIT_S)

            assert first == [0.0, 2.0, True, 2.0]  # pulled into the worker's array, then landed there
            assert second == [2.0, 5.0, True, 5.0]
            assert v.read_value().tolist() == [5.0]


def test_a_raising_function_reaches_join_with_the_workers_traceback_and_changes_nothing() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.full(1, 2.0, np.float32))
            failed = coordinator.schedule(f.fail, args=("boom at step 3",))

            with pytest.raises(ScheduledFunctionError) as raised:
                coordinator.join()
            message = str(raised.value)
            assert (f"schedule {failed.schedule_id} (tests.service.coordinator_functions:fail) raised on "
                    "worker-0") in message
            assert "builtins.ValueError: boom at step 3" in message
            assert "the worker's traceback" in message and 'coordinator_functions.py", line' in message
            assert raised.value.facts["error_type"] == "builtins.ValueError"
            with pytest.raises(ScheduledFunctionError, match="boom at step 3"):
                failed.fetch()
            coordinator.join()  # handled: join raised it

            after = coordinator.schedule(f.add, args=(v, 1.0))  # the worker serves on
            assert after.fetch(WAIT_S) == 1.0
            assert v.read_value().tolist() == [3.0]


def test_the_next_schedule_raises_an_unhandled_error() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            failed = coordinator.schedule(f.fail, args=("first",))
            with pytest.raises(ScheduledFunctionError):
                failed.fetch(WAIT_S)

            with pytest.raises(ScheduledFunctionError, match="first"):
                coordinator.schedule(f.add, args=(v, 1.0))
            with pytest.raises(ScheduledFunctionError, match="first"):
                coordinator.join()
            assert v.read_value().tolist() == [0.0]


def test_an_unknown_function_or_an_unencodable_argument_is_refused_before_anything_is_sent() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.full(1, 4.0, np.float32))
            coordinator.schedule(f.noop).fetch(WAIT_S)

            with pytest.raises(InvalidArgumentError, match=r"'tests.service.coordinator_functions:nope'.*"
                                                           r"has nothing named 'nope'"):
                coordinator.schedule("tests.service.coordinator_functions:nope")
            with pytest.raises(InvalidArgumentError, match=r"schedule\(.*:add\): args\[1\]: got a "
                                                           r"builtins.object"):
                coordinator.schedule(f.add, args=(v, object()))
            with pytest.raises(InvalidArgumentError, match="module-level function"):
                coordinator.schedule(lambda: None)

            assert coordinator.done()
            assert v.read_value().tolist() == [4.0]
            assert coordinator.schedule(f.worker_id).fetch(WAIT_S) == "worker-0"  # and nothing else ran


def test_a_cut_off_workers_call_runs_elsewhere_and_its_late_push_counts_zero_times(tmp_path: Path) -> None:
    marker = str(tmp_path / "call")
    with cluster(workers=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as c, \
            CuttableLink(c.scheduler.address) as link:
        c.start_worker(0, scheduler=link.address)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            call = coordinator.schedule(f.hold_then_add, args=(v, 5.0, marker))
            wait_until(lambda: Path(marker).exists(), WAIT_S, "worker-0 to hold the call")
            c.start_worker(1)

            link.cut()  # worker-0 goes on running the call, but the scheduler declares it dead
            assert call.fetch(WAIT_S) == 5.0
            assert call.worker == "worker-1"
            assert coordinator.redispatched == 1

            link.heal()
            Path(marker + ".release").touch()  # the cut-off run goes on: its push arrives after the re-run's
            late = Path(marker + ".worker-0")
            wait_until(late.exists, WAIT_S, "worker-0's late run to push")

            assert late.read_text() == "applied=0"
            assert Path(marker + ".worker-1").read_text() == "applied=1"
            assert v.read_value().tolist() == [5.0]


def _rows_table(name: str = "emb") -> TableConfig:
    return TableConfig(name=name, dim=2, initializer="zeros", optimizer="sgd", lr=1.0)


def test_a_table_declared_through_the_coordinator_takes_scheduled_row_pushes() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            t = coordinator.create_table(_rows_table())
            with pytest.raises(InvalidArgumentError, match="expected 'async'"):
                coordinator.create_table(TableConfig(name="s", dim=2, mode="sync"))

            assert coordinator.schedule(f.push_rows, args=(t, [3, 7], 2.0)).fetch(WAIT_S) == [2.0, 2.0]
            assert coordinator.schedule(f.push_rows, args=(t, [7], 1.0)).fetch(WAIT_S) == [3.0]
            assert t.read_rows([3, 7, 9]).tolist() == [[2.0, 2.0], [3.0, 3.0], [0.0, 0.0]]
            with pytest.raises(InvalidArgumentError, match="create them before"):
                coordinator.create_table(_rows_table("late"))


def test_a_cut_off_workers_table_push_counts_once_when_its_call_runs_elsewhere(tmp_path: Path) -> None:
    marker = str(tmp_path / "call")
    with cluster(workers=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as c, \
            CuttableLink(c.scheduler.address) as link:
        c.start_worker(0, scheduler=link.address)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            t = coordinator.create_table(_rows_table())
            call = coordinator.schedule(f.hold_then_push_rows, args=(t, [4], 5.0, marker))
            wait_until(lambda: Path(marker).exists(), WAIT_S, "worker-0 to hold the call")
            c.start_worker(1)

            link.cut()  # worker-0 goes on running the call, but the scheduler declares it dead
            assert call.fetch(WAIT_S) == 5.0
            assert call.worker == "worker-1"

            link.heal()
            Path(marker + ".release").touch()  # the cut-off run's push of that row comes after
            late = Path(marker + ".worker-0")
            wait_until(late.exists, WAIT_S, "worker-0's late run to push")

            assert late.read_text() == "stored=0"
            assert Path(marker + ".worker-1").read_text() == "stored=1"
            assert t.read_rows([4]).tolist() == [[5.0, 5.0]]


def test_join_fails_within_two_heartbeat_timeouts_naming_the_calls_when_no_worker_is_left(
        tmp_path: Path) -> None:
    marker = str(tmp_path / "call")
    with cluster(workers=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as c, \
            CuttableLink(c.scheduler.address) as link:
        c.start_worker(0, scheduler=link.address)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            held = coordinator.schedule(f.hold_then_add, args=(v, 1.0, marker))
            wait_until(lambda: Path(marker).exists(), WAIT_S, "worker-0 to hold the call")

            link.cut()
            cut = time.monotonic()
            with pytest.raises(NoWorkersError) as raised:
                coordinator.join(timeout_s=WAIT_S)
            took = time.monotonic() - cut

            assert took <= 2 * HEARTBEAT_TIMEOUT_S + SLACK_S
            assert f"1 scheduled call(s) unfinished (schedule ids {held.schedule_id})" in str(raised.value)
            assert "workers seen: worker-0" in str(raised.value)
            link.heal()
            Path(marker + ".release").touch()


def test_a_coordinator_that_dies_ends_its_workers() -> None:
    with cluster(workers=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as c:
        threads = [c.start_worker(i) for i in range(2)]
        coordinator = c.coordinator()
        v = coordinator.create_variable("v", np.zeros(1, np.float32))
        coordinator.schedule(f.add, args=(v, 1.0)).fetch(WAIT_S)

        coordinator._session.close()  # as if killed: it stops heartbeating and never leaves
        died = time.monotonic()
        for thread in threads:
            thread.join(WAIT_S)

        assert not any(t.is_alive() for t in threads)
        assert time.monotonic() - died <= 2 * HEARTBEAT_TIMEOUT_S + SLACK_S
        assert c.exits == {"worker-0": 0, "worker-1": 0}


def test_a_coordinator_launched_again_on_the_same_servers_goes_on_from_their_values() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as first:
            v = first.create_variable("v", np.zeros(1, np.float32))
            for x in (1.0, 2.0, 3.0):
                first.schedule(f.add, args=(v, x))
            first.join()
        c.threads[0].join(WAIT_S)  # its worker exits with it

        with c.coordinator() as second:  # registered first: the worker started next serves it
            c.start_worker(0)
            v = second.create_variable("v", np.zeros(1, np.float32))  # the servers keep 6
            second.schedule(f.add, args=(v, 4.0)).fetch(WAIT_S)

            assert v.read_value().tolist() == [10.0]  # its calls are not taken for the first one's


def test_a_coordinator_refuses_what_it_cannot_run_naming_the_field_and_the_value() -> None:
    from pshard.common.job import JobConfig

    with cluster(workers=1) as c:
        with pytest.raises(InvalidArgumentError, match=r"job\.mode: got 'sync', expected 'async'"):
            c.coordinator(JobConfig(mode="sync"))
        c.start_worker(0)
        with c.coordinator() as coordinator:
            with pytest.raises(InvalidArgumentError, match="schedule: no variable declared"):
                coordinator.schedule(f.noop)
            with pytest.raises(InvalidArgumentError, match=r"create_variable\('ids'\): got dtype int64"):
                coordinator.create_variable("ids", np.zeros(2, np.int64))
            coordinator.create_variable("v", np.zeros(2, np.float32))
            with pytest.raises(InvalidArgumentError, match="create_variable: 'v' exists already"):
                coordinator.create_variable("v", np.ones(2, np.float32))

            coordinator.schedule(f.noop).fetch(WAIT_S)

            with pytest.raises(InvalidArgumentError, match=r"create_variable\('w'\): the variables are "):
                coordinator.create_variable("w", np.zeros(1, np.float32))
            assert coordinator.read("v").tolist() == [0.0, 0.0]


def test_a_coordinator_launched_again_on_fresh_servers_resumes_from_its_last_global_checkpoint(
        tmp_path: Path) -> None:
    from pshard.ps_server.settings import ServerSettings

    settings = ServerSettings(global_checkpoint_dir=str(tmp_path))
    with cluster(workers=1, settings=settings) as c:
        c.start_worker(0)
        with c.coordinator(checkpoint_dir=str(tmp_path)) as first:
            v = first.create_variable("v", np.zeros(2, np.float32))
            for x in (1.0, 2.0, 3.0):
                first.schedule(f.add, args=(v, x))
            saved = first.save_checkpoint()  # joins first: every call has landed
            first.schedule(f.add, args=(v, 4.0)).fetch(WAIT_S)  # after the checkpoint: lost with the servers
            assert first.restored_clock is None

    # A fresh scheduler, servers and worker; the coordinator registers before the worker starts.
    with cluster(workers=1, settings=settings) as c, c.coordinator(checkpoint_dir=str(tmp_path)) as second:
        c.start_worker(0)
        v = second.create_variable("v", np.zeros(2, np.float32))
        second.schedule(f.add, args=(v, 10.0)).fetch(WAIT_S)

        assert second.restored_clock == 3  # three updates of every slice when it was saved
        assert v.read_value().tolist() == [16.0, 16.0]
    assert Path(saved).parent == tmp_path


def test_save_checkpoint_without_a_directory_is_refused_naming_it() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            coordinator.schedule(f.noop).fetch(WAIT_S)  # the layout its worker waits for
            with pytest.raises(InvalidArgumentError, match="save_checkpoint: checkpoint_dir: got none"):
                coordinator.save_checkpoint()


def test_a_fast_worker_takes_more_shards_than_a_slow_one() -> None:
    with cluster(workers=2) as c:
        for i in range(2):
            c.start_worker(i)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            coordinator.schedule(f.noop).fetch(WAIT_S)  # the started workers are serving
            taken = coordinator.shard_queue("train", 12).schedule(f.shard_on, args=("worker-1", 0.3))
            coordinator.join()

            by = [r.fetch() for r in taken.values()]
            assert by.count("worker-0") > by.count("worker-1")


def test_a_restored_shard_queue_trains_each_shard_once_across_a_restart(tmp_path: Path) -> None:
    from pshard.ps_server.settings import ServerSettings

    settings = ServerSettings(global_checkpoint_dir=str(tmp_path))
    with cluster(workers=2, settings=settings) as c:
        for i in range(2):
            c.start_worker(i)
        with c.coordinator(checkpoint_dir=str(tmp_path)) as first:
            v = first.create_variable("v", np.zeros(1, np.float32))
            shards = first.shard_queue("train", 10)
            shards.schedule(f.add_shard, args=(v, [6, 7, 8, 9]))  # the run breaks at shard 6
            with pytest.raises(ScheduledFunctionError, match="poisoned"):
                first.join()
            first.save_checkpoint()
            assert shards.done() == [0, 1, 2, 3, 4, 5]

    with cluster(workers=2, settings=settings) as c, c.coordinator(checkpoint_dir=str(tmp_path)) as second:
        for i in range(2):
            c.start_worker(i)
        v = second.create_variable("v", np.zeros(1, np.float32))
        shards = second.shard_queue("train", 10)

        assert shards.pending() == [6, 7, 8, 9]
        shards.schedule(f.add_shard, args=(v, []))
        second.join()
        assert v.read_value().tolist() == [float(sum(range(1, 11)))]  # 55: every shard once


def test_a_shard_in_progress_at_a_checkpoint_resumes_at_its_offset_so_no_sample_counts_twice(
        tmp_path: Path) -> None:
    from pshard.ps_server.settings import ServerSettings

    settings = ServerSettings(global_checkpoint_dir=str(tmp_path))
    with cluster(workers=2, settings=settings) as c:
        for i in range(2):
            c.start_worker(i)
        with c.coordinator(checkpoint_dir=str(tmp_path)) as first:
            v = first.create_variable("v", np.zeros(1, np.float32))
            shards = first.shard_queue("train", 3)
            shards.schedule(f.train_shard_batches, args=(v, [1, 2]))  # shard 1 breaks after 2 batches
            with pytest.raises(ScheduledFunctionError, match="poisoned at sample 18"):
                first.join()
            first.save_checkpoint()
            assert shards.position()["offsets"]["1"] == 2

    with cluster(workers=2, settings=settings) as c, c.coordinator(checkpoint_dir=str(tmp_path)) as second:
        for i in range(2):
            c.start_worker(i)
        v = second.create_variable("v", np.zeros(1, np.float32))
        shards = second.shard_queue("train", 3)

        assert 1 in shards.pending() and shards.offset(1) == 2
        shards.schedule(f.train_shard_batches, args=(v, []))
        second.join()
        # Every sample id + 1 once: 666. Shard 1 trained from its start again would add 13 + ... + 18 = 93.
        assert v.read_value().tolist() == [float(sum(range(1, 37)))]
