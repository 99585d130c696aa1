"""PSTrainer's param_groups (worker/hyper.py) and buffers policy (worker/buffers.py), as pure functions."""

from __future__ import annotations

import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import OptimizerConfig
from pshard.worker import buffers, hyper
from torch import nn

SGD = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)
ADAM = OptimizerConfig(name="adam", lr=0.01, betas=(0.8, 0.99))


def test_param_groups_show_what_applies_to_the_optimizer_under_torch_names() -> None:
    assert hyper.defaults(SGD) == {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": False,
                                   "weight_decay": 0.0}
    assert hyper.defaults(ADAM)["betas"] == (0.8, 0.99) and "momentum" not in hyper.defaults(ADAM)


def test_the_job_lr_is_not_stamped_a_scheduled_one_is() -> None:
    group = hyper.defaults(SGD)
    assert hyper.stamped_lr([group], SGD) is None
    assert hyper.stamped_lr([{**group, "lr": 0.025}], SGD) == 0.025
    assert hyper.stamped_lr([{**hyper.defaults(ADAM), "betas": [0.8, 0.99]}], ADAM) is None  # a list is fine


@pytest.mark.parametrize(("change", "message"), [
    ({"momentum": 0.85}, r"param_groups\[0\]\['momentum'\]: got 0.85, the servers' sgd runs momentum=0.9"),
    ({"lr": -1.0}, r"param_groups\[0\]\['lr'\]: got -1.0, expected a finite value"),
    ({"lr": float("nan")}, r"param_groups\[0\]\['lr'\]: got nan"),
])
def test_what_the_servers_cannot_follow_is_refused_naming_the_value(change, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        hyper.stamped_lr([{**hyper.defaults(SGD), **change}], SGD)


def test_one_param_group_only_and_no_schedule_for_aggregate() -> None:
    group = hyper.defaults(SGD)
    with pytest.raises(InvalidArgumentError, match="param_groups: got 2 groups, expected 1"):
        hyper.stamped_lr([group, group], SGD)
    aggregate = OptimizerConfig(name="aggregate", lr=0.1)
    with pytest.raises(InvalidArgumentError, match="local_optimizer's schedule"):
        hyper.stamped_lr([{"lr": 0.05}], aggregate)


def test_buffer_policy_defaults_by_mode_and_refuses_unknown_names() -> None:
    assert buffers.resolve(None, "sync") == "average"
    assert buffers.resolve(None, "async") == buffers.resolve(None, "ssp") == "local"
    assert buffers.resolve("local", "sync") == "local"
    refused = r"buffers: got 'broadcast', expected one of \('average', 'local'\)"
    with pytest.raises(InvalidArgumentError, match=refused):
        buffers.resolve("broadcast", "sync")


def test_only_floating_point_buffers_travel() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    assert list(buffers.synced(model, "average")) == ["1.running_mean", "1.running_var"]
    assert buffers.synced(model, "local") == {}
