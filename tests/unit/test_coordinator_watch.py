"""A serving worker (worker/serve.py): its watch on the coordinator ends once the chief has left or died,
also for a worker whose first view already shows that; PSHARD_SERVE makes `pshard run` serve."""

from __future__ import annotations

from pathlib import Path

import pytest
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.errors import ClusterConfigError
from pshard.worker.serve import CoordinatorWatch


def view(generation: int, *chief: NodeState) -> ClusterView:
    nodes = [Node("worker-0", "worker", 1, "127.0.0.1:1", NodeState.LIVE, 1)]
    nodes += [Node(f"chief-{i}", "chief", 0, "127.0.0.1:2", state, 1) for i, state in enumerate(chief)]
    return ClusterView(generation, tuple(nodes))


def test_the_watch_waits_for_a_coordinator_that_has_not_registered_yet_and_one_that_is_live() -> None:
    watch = CoordinatorWatch()
    watch.offer(view(1))
    watch.offer(view(2, NodeState.LIVE))
    assert not watch.gone.is_set()


def test_the_watch_ends_when_the_coordinator_leaves_or_is_declared_dead() -> None:
    for state in (NodeState.LEFT, NodeState.DEAD):
        watch = CoordinatorWatch()
        watch.offer(view(1, NodeState.LIVE))
        watch.offer(view(2, state))
        assert watch.gone.is_set() and watch.how == state.value


def test_a_worker_that_starts_after_its_coordinator_left_ends_at_its_first_view() -> None:
    watch = CoordinatorWatch()
    watch.offer(view(5, NodeState.LEFT))
    assert watch.gone.is_set()


TF_CONFIG = ('{"cluster": {"ps": ["127.0.0.1:7100"], "chief": ["127.0.0.1:7300"], '
             '"worker": ["127.0.0.1:7200"]}, "task": {"type": "worker", "index": 0}}')


def test_pshard_run_serves_in_a_coordinators_job_when_pshard_serve_is_set(tmp_path: Path) -> None:
    from pshard.worker.__main__ import config_from_args

    base = ["--data-dir", str(tmp_path), "--insecure"]
    assert config_from_args(base, {"TF_CONFIG": TF_CONFIG, "PSHARD_SERVE": "1"}).serve
    assert not config_from_args(base, {"TF_CONFIG": TF_CONFIG, "PSHARD_SERVE": "0"}).serve
    assert config_from_args([*base, "--serve"], {"TF_CONFIG": TF_CONFIG}).serve


def test_a_bad_pshard_serve_is_a_configuration_error_naming_it(tmp_path: Path) -> None:
    from pshard.worker.__main__ import config_from_args

    with pytest.raises(ClusterConfigError, match="PSHARD_SERVE: got 'maybe', expected 1 or 0"):
        config_from_args(["--data-dir", str(tmp_path)], {"TF_CONFIG": TF_CONFIG, "PSHARD_SERVE": "maybe"})
