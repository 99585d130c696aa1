"""A primary cut off from the cluster while its process lives (issue 24, item 3): fenced, then a backup.

Real parts: a scheduler, three parameter servers following it (replicas 1) and a worker, in this
process on 127.0.0.1, over real channels. Server 1 reaches the scheduler only through a link the
test cuts and heals (tests/service/cuttable_link.py); the worker still reaches every server, as a
call sent before a partition reaches the old primary when the link comes back. While cut, the
scheduler fails server 1 over; server 1 must take no write from then on (its lease ran out first),
then, once back, refuse the slices that moved and be copied to again as a backup. One worker, SGD,
integer values: the weights must equal the arithmetic exactly, so no update is lost or applied twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.cluster.view import NodeState
from pshard.common.errors import FencedError, PullTimeoutError, UnknownKeyError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.core.lease import FRACTION
from pshard.ps_server.follower import follow_scheduler
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.sync import OWN
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread

from tests.e2e.harness import wait_until
from tests.service.cuttable_link import CuttableLink

INTERVAL_S = 0.2
TIMEOUT_S = 2.0  # the scheduler's heartbeat timeout: long enough for a loaded 2-core machine
WAIT_S = 20.0
LR = 0.5
SGD = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=LR))
SHAPES = {"a": (256,), "b": (64, 4), "c": (32,)}


def _ints(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-8, 9, s).astype(np.float32) for k, s in SHAPES.items()}


def _versions(server: ServerThread) -> dict[str, int]:
    handlers = server.running.handlers
    return server.call(lambda: {str(s.key): s.version for s in handlers.store.slots()})


def _untouched(server: ServerThread, before: dict[str, int]) -> bool:
    """No write landed on `server` since `before` (slices it gave up to a new primary's copies aside)."""
    return all(before[key] == version for key, version in _versions(server).items())


def _lease_expired(server: ServerThread) -> bool:
    handlers = server.running.handlers
    return server.call(lambda: handlers.lease is not None and handlers.lease.expired())


def _lease_armed(server: ServerThread) -> bool:
    handlers = server.running.handlers
    return server.call(lambda: handlers.lease is not None and not handlers.lease.expired())


def _in_sync(scheduler: SchedulerHandle, primary: str) -> frozenset[str]:
    membership = scheduler.running.servicer.membership
    return scheduler.call(lambda: membership.in_sync.of(primary))


@pytest.mark.parametrize("n_servers", [3, 2])
def test_a_primary_cut_off_is_fenced_by_its_lease_and_rejoins_as_a_backup(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient],
        n_servers: int) -> None:
    """With 2 servers the heir is the returning server's own backup's primary: it copies back to it the
    very slices the returning server still holds, frozen, which must give way to the copies."""
    scheduler = start_scheduler_thread(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S)
    link = CuttableLink(scheduler.address)
    followers: list[SchedulerClient] = []
    worker: SchedulerClient | None = None
    try:
        servers = [start_server(ServerSettings(replicas=1, pull_timeout_s=WAIT_S)) for _ in range(n_servers)]
        addresses = tuple(s.address for s in servers)
        heir = addresses[2 % n_servers]
        for i, server in enumerate(servers):
            spec = ClusterSpec(task_type="ps", task_index=i, ps=addresses,
                               scheduler=(link.address if i == 1 else scheduler.address,))
            # On the server's loop, as `pshard ps` does: its first callbacks run after the call.
            followers.append(server.call(lambda server=server, spec=spec: follow_scheduler(
                server.running, spec, server.loop)))
        worker = member = SchedulerClient(scheduler.address, "worker", node_id="worker-0", rank_hint=0)
        member.register()
        worker.wait_for_view(lambda v: len(v.live("ps")) == n_servers, WAIT_S)
        layout = worker.propose_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()],
                                       slice_bytes=256, replicas=1)
        assert all(layout.slices_on(i) for i in range(n_servers))
        client = new_client(servers, "worker-0", generation=lambda: member.generation, layout=layout)
        expected = _ints(0)
        client.declare(dict(expected), SGD)
        for clock in (0, 1):
            client.push_pull(_ints(10 + clock), clock)
            expected = {k: v - np.float32(LR) * _ints(10 + clock)[k] for k, v in expected.items()}
        wait_until(lambda: heir in _in_sync(scheduler, addresses[1]), WAIT_S,
                   "the next server holding an in-sync copy of server 1")

        # Cut server 1 off from the scheduler: it is failed over within the detection bound, and its
        # lease has run out before that, so nothing it took after the failover could count.
        wait_until(lambda: _lease_armed(servers[1]), WAIT_S, "server 1's lease")
        before = _versions(servers[1])
        cut_at = time.monotonic()
        link.cut()
        wait_until(lambda: _lease_expired(servers[1]), WAIT_S, "server 1's lease to run out")
        fenced_after = time.monotonic() - cut_at
        view = worker.wait_for_view(lambda v: v.layout_version > layout.version, WAIT_S)
        detected_after = time.monotonic() - cut_at
        assert fenced_after < detected_after <= 2 * TIMEOUT_S, (fenced_after, detected_after)
        print(f"cut-off server fenced after {fenced_after:.2f} s, failed over after {detected_after:.2f} s "
              f"(heartbeat timeout {TIMEOUT_S:g} s, lease {FRACTION:g} of it)")
        moved = worker.get_layout(WAIT_S)
        assert moved.version == view.layout_version and not moved.slices_on(1)

        # A worker still routing by the old layout (its call sent before the cut): refused, nothing moved.
        with pytest.raises(FencedError, match="no heartbeat answered by the scheduler"):
            client.push_pull(_ints(12), 2)
        assert _untouched(servers[1], before)

        # The link is back: server 1 learns it was declared dead, registers again, follows the new
        # layout, and only then takes writes again: for the slices that moved, a re-route.
        link.heal()
        wait_until(lambda: not _lease_expired(servers[1]), WAIT_S, "server 1 answered by the scheduler again")
        with pytest.raises(UnknownKeyError, match="moved"):
            client.push_pull(_ints(12), 2)
        assert _untouched(servers[1], before)

        # On the new layout the step goes to the heir; each clock is applied exactly once.
        client.set_layout(moved)
        for clock in (2, 3):
            weights = client.push_pull(_ints(10 + clock), clock)
            expected = {k: v - np.float32(LR) * _ints(10 + clock)[k] for k, v in expected.items()}
        for key, value in expected.items():
            assert weights[key].tobytes() == value.tobytes(), key
        # Rejoined as a backup: server 0, whose ring successor it is again, copies its slices to it.
        wait_until(lambda: addresses[1] in _in_sync(scheduler, addresses[0]), WAIT_S,
                   "server 1 holding an in-sync copy of server 0 again")
        assert _untouched(servers[1], before)  # with 2 servers it gave up its frozen slices to the copies
    finally:
        for follower in followers:
            follower.close()
        if worker is not None:
            worker.close()
        link.close()
        scheduler.stop()


def test_without_replicas_a_server_cut_off_from_the_scheduler_alone_serves_on(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    """Scheduler <-> one server only, workers still reach it: nothing to fail over to, and it serves every
    step, so the workers' word keeps it live (the job was killed within 11 s before)."""
    scheduler = start_scheduler_thread(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S)
    link = CuttableLink(scheduler.address)
    followers: list[SchedulerClient] = []
    worker: SchedulerClient | None = None
    try:
        server = start_server(ServerSettings(pull_timeout_s=WAIT_S))
        spec = ClusterSpec(task_type="ps", task_index=0, ps=(server.address,), scheduler=(link.address,))
        followers.append(server.call(lambda: follow_scheduler(server.running, spec, server.loop)))
        worker = member = SchedulerClient(scheduler.address, "worker", node_id="worker-0", rank_hint=0)
        member.register()
        member.wait_for_view(lambda v: len(v.live("ps")) == 1, WAIT_S)
        layout = member.propose_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()],
                                       slice_bytes=256)
        client = new_client([server], "worker-0", generation=lambda: member.generation, layout=layout)
        member.report_reached(client.reached_servers)
        expected = _ints(0)
        client.declare(dict(expected), SGD)
        link.cut()
        cut_at, clock = time.monotonic(), 0
        while time.monotonic() - cut_at < 2.5 * TIMEOUT_S:  # steps for longer than a death takes to declare
            client.push_pull(_ints(10 + clock), clock)
            expected = {k: v - np.float32(LR) * _ints(10 + clock)[k] for k, v in expected.items()}
            clock += 1
            view = member.view
            assert view is not None and [n.node_id for n in view.live("ps")] == ["ps-0"], view
        membership = scheduler.running.servicer.membership
        assert scheduler.call(lambda: membership.vouches) == 1
        assert scheduler.call(lambda: membership.silent_for("ps-0")) > TIMEOUT_S
        link.heal()
        wait_until(lambda: scheduler.call(lambda: membership.silent_for("ps-0")) < TIMEOUT_S, WAIT_S,
                   "the server heard by the scheduler again")
        weights = client.pull(clock)
        for key, value in expected.items():
            assert weights[key].tobytes() == value.tobytes(), key
        assert scheduler.call(lambda: membership.node("ps-0").state) is NodeState.LIVE
    finally:
        for follower in followers:
            follower.close()
        if worker is not None:
            worker.close()
        link.close()
        scheduler.stop()


def test_the_scheduler_cut_off_from_every_node_stops_the_job_cleanly_and_it_resumes_with_nothing_lost(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    """The scheduler's host cut off (replicas 1): the servers' leases run out, so writes pause; the
    scheduler, hearing from nobody, declares nobody dead; once the link is back the leases are renewed
    and the same steps go on, no failover, every clock applied once."""
    scheduler = start_scheduler_thread(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S)
    link = CuttableLink(scheduler.address)
    followers: list[SchedulerClient] = []
    worker: SchedulerClient | None = None
    try:
        servers = [start_server(ServerSettings(replicas=1, pull_timeout_s=WAIT_S)) for _ in range(3)]
        addresses = tuple(s.address for s in servers)
        for i, server in enumerate(servers):
            spec = ClusterSpec(task_type="ps", task_index=i, ps=addresses, scheduler=(link.address,))
            followers.append(server.call(lambda server=server, spec=spec: follow_scheduler(
                server.running, spec, server.loop)))
        worker = member = SchedulerClient(link.address, "worker", node_id="worker-0", rank_hint=0)
        member.register()
        member.wait_for_view(lambda v: len(v.live("ps")) == 3, WAIT_S)
        layout = member.propose_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()],
                                       slice_bytes=256, replicas=1)

        def newer(known: Layout, timeout_s: float) -> Layout | None:  # as the worker session's
            try:
                member.wait_for_view(lambda v: v.layout_version > known.version, timeout_s)
            except PullTimeoutError:
                return None
            return member.get_layout(WAIT_S)

        client = new_client(servers, "worker-0", generation=lambda: member.generation, layout=layout,
                            relayout=newer, reroute_wait_s=TIMEOUT_S, timeout_s=3 * WAIT_S)
        expected = _ints(0)
        client.declare(dict(expected), SGD)
        client.push_pull(_ints(10), 0)
        expected = {k: v - np.float32(LR) * _ints(10)[k] for k, v in expected.items()}
        wait_until(lambda: all(_lease_armed(s) for s in servers), WAIT_S, "every server's lease")
        link.cut()
        wait_until(lambda: all(_lease_expired(s) for s in servers), WAIT_S, "every server's lease to run out")
        done: list[dict[str, np.ndarray]] = []
        stepping = threading.Thread(target=lambda: done.append(client.push_pull(_ints(11), 1)), daemon=True)
        stepping.start()
        membership = scheduler.running.servicer.membership
        nodes = ["ps-0", "ps-1", "ps-2", "worker-0"]
        wait_until(lambda: scheduler.call(lambda: min(membership.silent_for(n) for n in nodes)) > TIMEOUT_S,
                   WAIT_S, "the cut to outlast the heartbeat timeout")
        assert not done  # paused: no server takes the step
        link.heal()
        stepping.join(timeout=3 * WAIT_S)
        assert done, "the step did not resume"
        expected = {k: v - np.float32(LR) * _ints(11)[k] for k, v in expected.items()}
        weights = client.push_pull(_ints(12), 2)
        expected = {k: v - np.float32(LR) * _ints(12)[k] for k, v in expected.items()}
        for key, value in expected.items():
            assert weights[key].tobytes() == value.tobytes(), key
        assert scheduler.call(lambda: (membership.failovers, membership.isolations)) == (0, 1)
        assert all(n.state is NodeState.LIVE for n in scheduler.call(membership.view).nodes)
    finally:
        for follower in followers:
            follower.close()
        if worker is not None:
            worker.close()
        link.close()
        scheduler.stop()


def test_a_write_that_finds_the_lease_expired_waits_for_a_late_answer_and_is_refused_only_at_its_lapse(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    """A loaded host answers a heartbeat late: the write goes on, unseen by the worker; behind a partition
    no answer comes, and it is refused, the store unchanged, once the lease has lapsed."""
    server = start_server(ServerSettings(replicas=1, static_quorum={"w0": 0}))
    handlers = server.running.handlers
    client = new_client([server], "w0")
    expected = _ints(0)
    client.declare(dict(expected), SGD)

    def expire_lease() -> None:  # answered last 1.7 s ago: past its 0.8 x 2 s, 1.9 s before its lapse
        server.call(lambda: handlers.renew_lease(time.monotonic() - 1.7, TIMEOUT_S))
        assert _lease_expired(server)

    expire_lease()
    done: list[dict[str, np.ndarray]] = []
    step = threading.Thread(target=lambda: done.append(client.push_pull(_ints(10), 0)), daemon=True)
    step.start()
    wait_until(lambda: server.call(lambda: handlers._changes.waiting) > 0, WAIT_S, "the write to wait")
    assert not done
    server.call(lambda: handlers.renew_lease(time.monotonic(), TIMEOUT_S))  # the late answer
    step.join(WAIT_S)
    expected = {k: v - np.float32(LR) * _ints(10)[k] for k, v in expected.items()}
    assert done and all(done[0][k].tobytes() == v.tobytes() for k, v in expected.items())

    wait_until(lambda: _lease_expired(server), WAIT_S, "the lease to run out again, unanswered")
    before = _versions(server)
    started = time.monotonic()
    with pytest.raises(FencedError):
        client.push_pull(_ints(11), 1)
    assert time.monotonic() - started >= 1.0 and _versions(server) == before


def test_a_sync_table_push_is_fenced_by_the_lease_as_a_dense_one_and_a_waiting_pull_ends_at_its_lapse(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    """The sparse-table half of the test above: a push that finds the lease expired waits for the late
    answer and goes on; unanswered, it is refused at the lapse with the rows unchanged, and a pull
    waiting for a clock no push can complete here any more is refused then too, not at its timeout."""
    from pshard.common.sparse import TableConfig

    server = start_server(ServerSettings(replicas=1, static_quorum={"w0": 0, "w1": 1}))
    handlers = server.running.handlers
    client = new_client([server], "w0", timeout_s=WAIT_S)
    config = TableConfig("emb", 4, initializer="zeros", optimizer="sgd", lr=1.0, mode="sync")
    client.declare_table(config)
    ids = np.array([3, 7], np.int64)
    grads = np.ones((2, 4), np.float32)

    server.call(lambda: handlers.renew_lease(time.monotonic() - 1.7, TIMEOUT_S))  # expired, 1.9 s to lapse
    assert _lease_expired(server)
    done: list[int] = []
    step = threading.Thread(target=lambda: done.append(client.push_rows("emb", ids, grads, 0)), daemon=True)
    step.start()
    wait_until(lambda: server.call(lambda: handlers._changes.waiting) > 0, WAIT_S, "the table push to wait")
    assert not done
    server.call(lambda: handlers.renew_lease(time.monotonic(), TIMEOUT_S))  # the late answer
    step.join(WAIT_S)
    assert done == [2]

    wait_until(lambda: _lease_expired(server), WAIT_S, "the lease to run out again, unanswered")
    started = time.monotonic()
    with pytest.raises(FencedError):
        client.push_rows("emb", ids, grads, 1)
    assert time.monotonic() - started >= 1.0
    # Clock 0 waits for w1's push, which can never complete here now: the pull is refused at the lapse.
    with pytest.raises(FencedError):
        client.pull_rows("emb", ids, clock=1)
    assert time.monotonic() - started < WAIT_S / 2

    # Answered again: w1's pushes complete clock 0 only. Had the refused push of clock 1 been kept, w1's
    # would complete that clock too.
    tables = server.running.tables
    assert tables is not None
    server.call(lambda: handlers.renew_lease(time.monotonic(), TIMEOUT_S))
    other = new_client([server], "w1", timeout_s=WAIT_S)
    other.declare_table(config)
    other.push_rows("emb", ids, grads, 0)
    other.push_rows("emb", ids, grads, 1)
    np.testing.assert_array_equal(client.pull_rows("emb", ids, clock=1), np.full((2, 4), -1.0, np.float32))
    assert server.call(lambda: tables._sync["emb"].behind(2, [OWN])) == (OWN, 1)  # clock 1 waits for w0
