"""When a service with --exit-when-done decides its job is over (pshard.common.jobend)."""

from __future__ import annotations

import argparse

import pytest
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.jobend import DEFAULT_QUIET_S, JobEnd, add_exit_argument, training_finished


def view(*states: NodeState, evaluator: NodeState | None = None) -> ClusterView:
    nodes = [Node("ps-0", "ps", 0, "h:1", NodeState.LIVE, 1)]
    nodes += [Node(f"worker-{i}", "chief" if i == 0 else "worker", i, f"h:{i + 2}", state, 1)
              for i, state in enumerate(states)]
    if evaluator is not None:
        nodes.append(Node("evaluator-0", "evaluator", 0, "h:9", evaluator, 1))
    return ClusterView(len(nodes), tuple(nodes))


def test_training_is_finished_only_when_every_trainer_left_on_purpose() -> None:
    assert not training_finished(None)
    assert not training_finished(view())  # nobody joined yet
    assert not training_finished(view(NodeState.LEFT, NodeState.LIVE))
    assert not training_finished(view(NodeState.LEFT, NodeState.DEAD))  # a dead one may come back
    assert training_finished(view(NodeState.LEFT, NodeState.LEFT, evaluator=NodeState.LIVE))


def test_the_job_ends_a_quiet_period_after_the_last_request() -> None:
    end = JobEnd(quiet_s=10)
    assert not end.observe(False, 0, now=0)
    assert not end.observe(True, 5, now=1)
    assert not end.observe(True, 6, now=9)  # the chief's final pull: the quiet period starts again
    assert not end.observe(True, 6, now=18.9)
    assert end.observe(True, 6, now=19)


def test_a_worker_joining_again_cancels_the_countdown() -> None:
    end = JobEnd(quiet_s=10)
    assert not end.observe(True, 0, now=0)
    assert not end.observe(False, 0, now=5)
    assert not end.observe(True, 0, now=12)
    assert end.observe(True, 0, now=22)


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    ([], {}, None),
    (["--exit-when-done"], {}, DEFAULT_QUIET_S),
    (["--exit-when-done", "2.5"], {}, 2.5),
    ([], {"PSHARD_EXIT_WHEN_DONE": "1"}, DEFAULT_QUIET_S),
    ([], {"PSHARD_EXIT_WHEN_DONE": "4"}, 4.0),
    ([], {"PSHARD_EXIT_WHEN_DONE": "off"}, None),
])
def test_the_flag_and_its_environment_default(argv: list[str], environ: dict[str, str],
                                              expected: float | None) -> None:
    parser = argparse.ArgumentParser()
    add_exit_argument(parser, environ)
    assert parser.parse_args(argv).exit_when_done == expected


def test_a_negative_quiet_period_is_refused_naming_the_value() -> None:
    parser = argparse.ArgumentParser()
    add_exit_argument(parser, {})
    with pytest.raises(SystemExit):
        parser.parse_args(["--exit-when-done", "-1"])
