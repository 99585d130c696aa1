"""`pshard launch [options] train.py [args]`: the script form, parsed as torchrun does; the launch record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pshard.launcher.cli import parse_options
from pshard.launcher.plan import ClusterPlan, child_specs
from pshard.launcher.record import LaunchRecord, find_record, remove_record, write_record


def test_everything_after_the_script_is_the_scripts_even_launcher_flags() -> None:
    options = parse_options(["--ps", "1", "--workers", "3", "train.py", "--epochs", "2", "--workers", "9",
                             "--"])
    assert (options.ps, options.workers, options.script) == (1, 3, "train.py")
    assert options.worker_cmd == (sys.executable, "train.py")
    assert options.worker_args == ("--epochs", "2", "--workers", "9", "--")


def test_without_a_script_the_worker_cmd_forms_keep_working() -> None:
    plain = parse_options(["--ps", "1", "--", "--mode", "sync", "--output", "x.py"])
    assert plain.script is None and plain.worker_cmd[1:] == ("-m", "pshard.worker")
    assert plain.worker_args == ("--mode", "sync", "--output", "x.py")
    custom = parse_options(["--worker-cmd", "python my.py", "--mode", "sync"])
    assert custom.script is None and custom.worker_cmd == ("python", "my.py")


def test_a_flag_the_launcher_does_not_know_before_the_script_is_refused(capsys: pytest.CaptureFixture[str]
                                                                         ) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--mode", "sync", "train.py"])
    assert exit_.value.code == 2
    assert "'--mode': got it with the script 'train.py'" in capsys.readouterr().err


def test_script_trainers_get_tf_config_and_passive_openmp() -> None:
    options = parse_options(["--ps", "1", "--workers", "1", "train.py", "--out", "m-{task}.pt"])
    plan = ClusterPlan.allocate(1, 1, ports=lambda n, host: list(range(7000, 7000 + n)))
    trainer = child_specs(plan, options)[-1]
    assert trainer.argv == (sys.executable, "train.py", "--out", "m-worker-0.pt")
    assert '"task": {"type": "worker", "index": 0}' in trainer.env["TF_CONFIG"]
    assert trainer.env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_running_launch_is_found_by_its_address_and_a_finished_or_killed_one_is_not(tmp_path: Path) -> None:
    env = {"PSHARD_CERTS_DIR": str(tmp_path / "certs")}
    mine = LaunchRecord("127.0.0.1:7000", str(tmp_path / "certs"), "launch-1", pid=os.getpid())
    assert mine.status_command(env) == "pshard status --scheduler 127.0.0.1:7000"
    assert LaunchRecord("h:1", "/elsewhere", "j", 1).status_command(env).endswith("--tls-dir /elsewhere")
    assert write_record(mine, env) == tmp_path / "launches" / f"{os.getpid()}.json"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # A launcher SIGKILLed leaves its record behind.
    write_record(LaunchRecord("127.0.0.1:7001", None, "launch-2", pid=gone.pid), env)

    assert find_record(env) == mine
    assert find_record(env, "127.0.0.1:7000") == mine
    assert find_record(env, "127.0.0.1:7001") is None  # its launcher is gone
    remove_record(os.getpid(), env)
    assert find_record(env) is None


def test_pshard_status_takes_the_credentials_of_the_launch_it_was_pointed_at(tmp_path: Path) -> None:
    from pshard.admin import _launcher_security
    from pshard.status import build_parser

    env = {"PSHARD_CERTS_DIR": str(tmp_path / "certs")}
    write_record(LaunchRecord("127.0.0.1:7000", str(tmp_path / "certs"), "launch-1", pid=os.getpid()), env)
    try:
        args = build_parser().parse_args([])
        _launcher_security(args, "127.0.0.1:7000", env)
        assert (args.tls_dir, args.insecure) == (str(tmp_path / "certs"), None)
        other = build_parser().parse_args([])
        _launcher_security(other, "127.0.0.1:9999", env)  # not a launch of ours: no guess
        assert (other.tls_dir, other.insecure) == (None, None)
        explicit = build_parser().parse_args(["--insecure"])
        _launcher_security(explicit, "127.0.0.1:7000", env)
        assert (explicit.tls_dir, explicit.insecure) == (None, True)
        _launcher_security(from_env := build_parser().parse_args([]), "127.0.0.1:7000",
                           {**env, "PSHARD_TLS_DIR": "/mine"})
        assert from_env.tls_dir is None  # security_from_args reads PSHARD_TLS_DIR itself
    finally:
        remove_record(os.getpid(), env)
    write_record(LaunchRecord("127.0.0.1:7001", None, "launch-2", pid=os.getpid()), env)
    try:
        _launcher_security(args := build_parser().parse_args([]), "127.0.0.1:7001", env)
        assert args.insecure is True  # an --insecure launch
    finally:
        remove_record(os.getpid(), env)
