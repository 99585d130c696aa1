"""The `pshard` command's own logic: which subcommand `pshard run` picks, usage and unknown commands."""

from __future__ import annotations

import json

import pytest

from pshard import __version__
from pshard.cli import COMMANDS, RoleError, main, role_command


def tf_config(task_type: object) -> dict[str, str]:
    task = {"type": task_type, "index": 0}
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w:1"]}, "task": task})}


@pytest.mark.parametrize(("task_type", "command"), [
    ("scheduler", "scheduler"), ("ps", "ps"), ("worker", "worker"), ("chief", "worker"),
    ("master", "worker"), ("evaluator", "worker"),
    # TensorFlow's TFConfigClusterResolver reads the type in any case.
    ("PS", "ps"), ("Scheduler", "scheduler"), ("Chief", "worker"),
])
def test_run_starts_the_command_of_tf_configs_task_type(task_type, command):
    assert role_command(tf_config(task_type)) == command


@pytest.mark.parametrize(("environ", "message"), [
    ({}, "TF_CONFIG is not set"),
    ({"TF_CONFIG": ""}, "TF_CONFIG is not set"),
    (tf_config("trainer"), "task.type: got 'trainer'"),
    (tf_config(3), "task.type: got 3"),
])
def test_run_refuses_a_missing_or_unknown_role(environ, message):
    with pytest.raises(RoleError, match=message):
        role_command(environ)


@pytest.mark.parametrize("raw", ["{not json", "[]", '{"task": "worker"}', '{"cluster": {}}'])
def test_a_malformed_tf_config_goes_to_the_parser_that_names_the_field(raw):
    # The worker's TF_CONFIG parser reports it (exit 2, field and value named); run only dispatches.
    assert role_command({"TF_CONFIG": raw}) == "worker"


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0

    out = capsys.readouterr().out
    assert out.startswith("usage: pshard <command>")
    for name in COMMANDS:
        assert f"\n  {name} " in out


def test_an_unknown_command_is_a_usage_error(capsys):
    assert main(["train"]) == 2

    assert capsys.readouterr().err.endswith("pshard: error: unknown command 'train'\n")


def test_run_without_tf_config_is_one_error_line(capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)

    assert main(["run"]) == 2

    err = capsys.readouterr().err
    assert err.startswith("pshard run: error: TF_CONFIG is not set") and err.count("\n") == 1


def test_version(capsys):
    assert main(["--version"]) == 0

    assert capsys.readouterr().out == f"pshard {__version__}\n"
