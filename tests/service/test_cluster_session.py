"""ClusterSession against a real scheduler: hosting it in-process, joining, the start barrier, leaving.

Worker 0 of a cluster without a scheduler task hosts the scheduler at its own address, a port the
OS picked a moment before.
"""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.errors import ClusterConfigError
from pshard.common.job import JobConfig
from pshard.worker.session import ClusterSession, training_over

from tests.service.conftest import WAIT_S


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _node(node_id: str, role: str, state: NodeState) -> Node:
    return Node(node_id, role, 0, "", state, 1)


def test_training_is_over_once_some_trainer_joined_and_none_is_live() -> None:
    live, left, dead = NodeState.LIVE, NodeState.LEFT, NodeState.DEAD
    chief_left = _node("chief-0", "chief", left)
    assert not training_over(ClusterView(1, (_node("ps-0", "ps", live),)))  # nobody joined yet
    assert not training_over(ClusterView(2, (chief_left, _node("worker-0", "worker", live))))
    assert training_over(ClusterView(3, (chief_left, _node("worker-0", "worker", dead),
                                         _node("evaluator-0", "evaluator", live))))


def test_worker_0_hosts_the_scheduler_joins_passes_the_barrier_and_leaves() -> None:
    port = _free_port()
    spec = ClusterSpec("worker", 0, ps=(f"127.0.0.1:{_free_port()}",), worker=(f"127.0.0.1:{port}",))
    session = ClusterSession(spec, startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S)
    try:
        session.host_scheduler_if_needed()
        scheduler = session.register()
        assert (scheduler.node_id, scheduler.rank) == ("worker-0", 0)

        session.await_start(0, wait_for_quorum=False)  # a barrier of one: this worker
        assert not session.wait_for_training_over(0.05)
        session.leave()

        assert session.wait_for_training_over(WAIT_S)
    finally:
        session.close()
    with socket.socket() as sock:  # the hosted scheduler stopped with the session
        sock.bind(("0.0.0.0", port))


def test_a_taken_port_is_a_configuration_error_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        spec = ClusterSpec("worker", 0, ps=(f"127.0.0.1:{_free_port()}",), worker=(address,))
        session = ClusterSession(spec, startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S)
        with pytest.raises(ClusterConfigError, match=f"worker-0 hosts the scheduler at {address}"):
            session.host_scheduler_if_needed()
        session.close()


def test_a_worker_joining_before_the_first_clock_waits_for_the_listed_workers_not_the_barrier() -> None:
    ps, worker = (f"127.0.0.1:{_free_port()}",), (f"127.0.0.1:{_free_port()}",)
    first = ClusterSession(ClusterSpec("worker", 0, ps=ps, worker=worker), startup_timeout_s=WAIT_S,
                           step_timeout_s=WAIT_S)
    joiner = ClusterSession(ClusterSpec("worker", 1, ps=ps, worker=worker, joining=True),
                            startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S)
    try:
        first.host_scheduler_if_needed()
        assert joiner.register().node_id == "worker-1"
        errors: list[BaseException] = []

        def start() -> None:
            try:
                joiner.await_start(0, wait_for_quorum=False)
            except BaseException as e:  # handed to the test thread
                errors.append(e)

        waiting = threading.Thread(target=start)
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive(), errors  # worker-0, which TF_CONFIG lists, has not registered yet
        first.register()
        waiting.join(WAIT_S)
        assert not waiting.is_alive() and not errors, errors
        first.await_start(0, wait_for_quorum=False)  # a barrier of TF_CONFIG's one worker: not the joiner
    finally:
        joiner.close()
        first.close()


def test_the_session_a_script_joins_through_comes_from_its_environment() -> None:
    cluster = {"scheduler": ["127.0.0.1:7000"], "ps": ["127.0.0.1:7100"],
               "worker": ["127.0.0.1:7200", "127.0.0.1:7201"]}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}),
           "PSHARD_JOB_ID": "launch-1", "PSHARD_REPLICAS": "0", "PSHARD_INSECURE": "1"}
    session = ClusterSession.from_environment(env)
    assert (session.spec.node_id, session.rank, session.is_chief, session.spec.world_size) == ("worker-1", 1,
                                                                                               False, 2)
    assert session.job_of(JobConfig()).job_id == "launch-1"
    assert session.job_of(JobConfig(job_id="mine")).job_id == "mine"
    without_id = ClusterSession.from_environment({**env, "PSHARD_JOB_ID": ""})
    assert without_id.job_of(JobConfig()).job_id.startswith("tf-")  # the same on every task of the cluster


@pytest.mark.parametrize(("env", "message"), [
    ({}, "TF_CONFIG: not set; a trainer without a PSClient joins"),
    ({"TF_CONFIG": json.dumps({"cluster": {"scheduler": ["127.0.0.1:7000"], "ps": ["127.0.0.1:7100"]},
                               "task": {"type": "ps", "index": 0}})},
     "task.type: got 'ps'"),
    ({"TF_CONFIG": json.dumps({"cluster": {"ps": ["127.0.0.1:7100"], "worker": ["127.0.0.1:7200"]},
                               "task": {"type": "worker", "index": 0}}), "PSHARD_REPLICAS": "two"},
     "PSHARD_REPLICAS: got 'two'"),
])
def test_an_environment_that_describes_no_trainer_is_refused_naming_what(env: dict[str, str],
                                                                        message: str) -> None:
    with pytest.raises(ClusterConfigError, match=re.escape(message)):
        ClusterSession.from_environment(env)
