"""The prelude every admin command shares (pshard/admin.py): which scheduler, which credential, and the
error that ends the command when neither flags, TF_CONFIG nor a running `pshard launch` names one."""

from __future__ import annotations

import importlib

import pytest
from pshard.common.security.credentials import ENV_CA, ENV_CERT, ENV_INSECURE, ENV_KEY, ENV_TLS_DIR, ENV_TOKEN

from pshard.cli import COMMANDS

ADMIN = {"status": [], "drain": ["ps-1"], "rebalance": ["--dry-run"]}


@pytest.fixture
def no_target(tmp_path, monkeypatch):
    """No TF_CONFIG, no credential, and a records folder with no running launch in it."""
    for var in ("TF_CONFIG", ENV_CA, ENV_CERT, ENV_KEY, ENV_TLS_DIR, ENV_TOKEN, ENV_INSECURE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PSHARD_CERTS_DIR", str(tmp_path / "certs"))
    return tmp_path


def run_admin(command: str, argv: list[str]) -> int:
    """The command's exit status, as `pshard COMMAND ARGV` would end."""
    main = importlib.import_module(COMMANDS[command].module).main
    try:
        return int(main(argv, prog=f"pshard {command}") or 0)
    except SystemExit as ended:  # as argparse ends a command on a bad flag
        return int(ended.code or 0)


@pytest.mark.parametrize("command", sorted(ADMIN))
def test_an_admin_command_with_no_scheduler_to_find_says_how_to_name_one_and_exits_2(command, no_target,
                                                                                      capsys):
    assert run_admin(command, ADMIN[command]) == 2
    err = capsys.readouterr().err
    assert err == (f"pshard {command}: error: no scheduler: pass --scheduler HOST:PORT or set TF_CONFIG (no "
                   f"'pshard launch' is running: a running one keeps a record in {no_target / 'launches'})\n")


@pytest.mark.parametrize("command", sorted(ADMIN))
def test_an_admin_command_names_the_field_of_a_bad_tf_config_and_exits_2(command, no_target, monkeypatch,
                                                                         capsys):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["w:1"]}, "task": {"type": "boss", "index": 0}}')
    assert run_admin(command, ADMIN[command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pshard {command}: error: task.type: got 'boss'"), err


@pytest.mark.parametrize("command", sorted(ADMIN))
def test_every_admin_command_takes_its_scheduler_from_the_same_flag(command):
    parser = importlib.import_module(COMMANDS[command].module).build_parser(f"pshard {command}")
    assert parser.parse_args([*ADMIN[command], "--scheduler", "h:7"]).scheduler == "h:7"
    assert "--scheduler HOST:PORT" in parser.format_help()
