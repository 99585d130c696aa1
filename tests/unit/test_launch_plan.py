"""The launcher's pure parts: ports, the cluster plan and its TF_CONFIGs, child commands, output."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
from pshard.common.cluster.spec import ClusterSpec
from pshard.launcher.cli import parse_options
from pshard.launcher.plan import (
    ClusterPlan,
    Options,
    child_environment,
    child_specs,
    free_ports,
    join_address,
    restart_decision,
    trainer_restart_decision,
)
from pshard.launcher.supervisor import LinePrefixer, describe_exit, status_of, summary_line


def fake_ports(count: int, host: str) -> list[int]:
    return list(range(7000, 7000 + count))


# ---- ports ----


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_ipv6_addresses_get_brackets() -> None:
    assert join_address("::1", 7000) == "[::1]:7000"
    assert join_address("127.0.0.1", 7000) == "127.0.0.1:7000"


# ---- cluster plan ----


def test_plan_gives_every_task_its_own_port_in_role_order() -> None:
    plan = ClusterPlan.allocate(2, 2, ports=fake_ports)
    assert plan.cluster() == {
        "scheduler": ["127.0.0.1:7000"],
        "ps": ["127.0.0.1:7001", "127.0.0.1:7002"],
        "worker": ["127.0.0.1:7003", "127.0.0.1:7004"],
    }
    assert [t.name for t in plan.servers] == ["scheduler", "ps-0", "ps-1"]
    assert [t.name for t in plan.trainers] == ["worker-0", "worker-1"]


def test_chief_is_an_extra_task_listed_before_the_workers() -> None:
    plan = ClusterPlan.allocate(1, 2, chief=True, ports=fake_ports)
    assert plan.cluster()["chief"] == ["127.0.0.1:7002"]
    assert plan.worker == ("127.0.0.1:7003", "127.0.0.1:7004")
    assert [t.name for t in plan.trainers] == ["chief-0", "worker-0", "worker-1"]


@pytest.mark.parametrize("chief", [False, True])
def test_each_tf_config_parses_to_its_own_task(chief: bool) -> None:
    plan = ClusterPlan.allocate(2, 2, chief=chief, ports=fake_ports)
    for task in [*plan.servers, *plan.trainers]:
        spec = ClusterSpec.from_tf_config(plan.tf_config(task))
        assert (spec.task_type, spec.task_index) == (task.task_type, task.index)
        assert spec.own_address == task.address
        assert spec.scheduler_address == plan.scheduler
        assert spec.ps == plan.ps
        assert spec.world_size == 2 + chief


@pytest.mark.parametrize(("num_ps", "num_workers", "chief"), [(0, 2, False), (1, 0, False), (1, -1, True)])
def test_plan_needs_a_server_and_a_trainer(num_ps: int, num_workers: int, chief: bool) -> None:
    with pytest.raises(ValueError, match="num_"):
        ClusterPlan.allocate(num_ps, num_workers, chief=chief, ports=fake_ports)


# ---- child commands ----


def test_servers_bind_their_planned_address_and_get_the_scheduler_timings() -> None:
    plan = ClusterPlan.allocate(2, 1, ports=fake_ports)
    options = Options(heartbeat_interval_ms=200, heartbeat_timeout_ms=1500, checkpoint_dir="/ck")
    specs = {s.name: s for s in child_specs(plan, options, python="py")}
    assert specs["scheduler"].argv == ("py", "-m", "pshard.scheduler", "--bind", "127.0.0.1:7000",
                                       "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1500")
    assert specs["ps-1"].argv == ("py", "-m", "pshard.ps_server", "--bind", "127.0.0.1:7002",
                                  "--checkpoint-dir", os.path.join("/ck", "ps-1"))
    assert specs["ps-1"].health_address == "127.0.0.1:7002"
    assert json.loads(specs["ps-1"].env["TF_CONFIG"])["task"] == {"type": "ps", "index": 1}


def test_row_partitions_per_server_go_to_the_scheduler() -> None:
    plan = ClusterPlan.allocate(2, 1, ports=fake_ports)
    options = parse_options(["--row-partitions-per-server", "4", "--", "--mode", "sync"])
    specs = {s.name: s for s in child_specs(plan, options, python="py")}
    assert specs["scheduler"].argv[-2:] == ("--row-partitions-per-server", "4")
    assert "--row-partitions-per-server" not in specs["ps-0"].argv
    assert options.worker_args == ("--mode", "sync")


def test_the_automatic_rebalance_goes_to_the_scheduler_and_is_off_by_default() -> None:
    plan = ClusterPlan.allocate(2, 1, ports=fake_ports)
    options = parse_options(["--row-partitions-per-server", "4", "--rebalance-auto", "1.3",
                             "--rebalance-cooldown", "30"])
    specs = {s.name: s for s in child_specs(plan, options, python="py")}
    assert specs["scheduler"].argv[-4:] == ("--rebalance-auto", "1.3", "--rebalance-cooldown", "30")
    off = {s.name: s for s in child_specs(plan, parse_options([]), python="py")}
    assert not any(a.startswith("--rebalance") for a in off["scheduler"].argv)


def test_a_rebalance_cooldown_without_the_policy_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--rebalance-cooldown", "30"])
    assert exit_.value.code == 2
    assert "--rebalance-cooldown: got 30, but the automatic rebalance is off" in capsys.readouterr().err


def test_servers_start_before_workers_and_workers_have_no_health_check() -> None:
    specs = child_specs(ClusterPlan.allocate(1, 2, ports=fake_ports), Options())
    assert [s.name for s in specs] == ["scheduler", "ps-0", "worker-0", "worker-1"]
    assert [s.health_address is None for s in specs] == [False, False, True, True]


def test_worker_args_go_to_every_worker_with_its_name_filled_in() -> None:
    plan = ClusterPlan.allocate(1, 2, ports=fake_ports)
    options = Options(worker_cmd=("w",), worker_args=("--mode", "sync", "--metrics", "m-{task}.jsonl"))
    workers = [s for s in child_specs(plan, options) if s.name.startswith("worker")]
    assert [s.argv for s in workers] == [("w", "--mode", "sync", "--metrics", "m-worker-0.jsonl"),
                                         ("w", "--mode", "sync", "--metrics", "m-worker-1.jsonl")]


def test_child_environment_is_the_launchers_plus_the_task_and_leaves_pythonpath_alone() -> None:
    # Children import the installed package: the launcher adds no path of its own.
    env = child_environment({"TF_CONFIG": "{}"}, {"PATH": "/bin", "PYTHONPATH": "/x", "TF_CONFIG": "old"})
    assert env == {"PATH": "/bin", "PYTHONPATH": "/x", "TF_CONFIG": "{}"}
    assert "PYTHONPATH" not in child_environment({"TF_CONFIG": "{}"}, {"PATH": "/bin"})


def test_children_run_the_installed_package_by_module_name() -> None:
    specs = child_specs(ClusterPlan.allocate(1, 1, ports=fake_ports), Options(), python="py")
    assert [s.argv[:3] for s in specs] == [("py", "-m", "pshard.scheduler"), ("py", "-m", "pshard.ps_server"),
                                           (sys.executable, "-m", "pshard.worker")]


def test_a_non_default_log_level_goes_to_the_servers() -> None:
    specs = child_specs(ClusterPlan.allocate(1, 1, ports=fake_ports), Options(log_level="WARNING"))
    assert [s.argv[-2:] for s in specs[:2]] == [("--log-level", "WARNING")] * 2


# ---- output ----


def test_prefixer_emits_only_complete_lines() -> None:
    p = LinePrefixer("ps-0")
    assert p.feed(b"hello\nwor") == ["[ps-0] hello"]
    assert p.feed(b"ld\n") == ["[ps-0] world"]
    assert p.close() == []


def test_prefixer_cuts_progress_bar_redraws_and_drops_blank_lines() -> None:
    p = LinePrefixer("w")
    assert p.feed(b"\r 10%|#\r 20%|##\r\n\nstep 3\r\n") == ["[w]  10%|#", "[w]  20%|##", "[w] step 3"]


def test_prefixer_decodes_a_character_split_between_reads() -> None:
    p = LinePrefixer("w")
    encoded = "loss ≈ 0.1\n".encode()
    cut = encoded.index("≈".encode()) + 1
    assert p.feed(encoded[:cut]) == []
    assert p.feed(encoded[cut:]) == ["[w] loss ≈ 0.1"]


def test_prefixer_flushes_an_unterminated_last_line_and_replaces_bad_bytes() -> None:
    p = LinePrefixer("w")
    assert p.feed(b"bye \xff") == []
    assert p.close() == ["[w] bye \ufffd"]


# ---- exit status and summary ----


def test_summary_names_each_workers_exit() -> None:
    line = summary_line({"worker-0": 0, "worker-1": -9, "worker-2": None}, 1)
    assert line == "launcher: exit 1: worker-0=0 worker-1=SIGKILL worker-2=not-started"


@pytest.mark.parametrize(("code", "status"), [(2, 2), (-15, 143), (-9, 137), (300, 1)])
def test_status_of_a_failing_child(code: int, status: int) -> None:
    assert status_of(code) == status


def test_describe_exit_of_an_unknown_signal() -> None:
    assert describe_exit(-200) == "signal-200"


# ---- command line ----


def test_arguments_after_double_dash_and_unknown_flags_go_to_workers() -> None:
    options = parse_options(["--ps", "1", "--mode", "sync", "--lr", "-0.5", "--workers", "3",
                             "--", "--epochs", "2", "--ps", "x"])
    assert (options.ps, options.workers) == (1, 3)
    assert options.worker_args == ("--mode", "sync", "--lr", "-0.5", "--epochs", "2", "--ps", "x")
    assert options.worker_cmd == (sys.executable, "-m", "pshard.worker")


def test_worker_cmd_is_split_like_a_shell_does() -> None:
    assert parse_options(["--worker-cmd", "python -c 'print(1)'"]).worker_cmd == ("python", "-c", "print(1)")


@pytest.mark.parametrize("argv", [
    ["--ps", "0"],
    ["--workers", "0"],
    ["--scheduler-interval-ms", "500", "--scheduler-timeout-ms", "500"],
    ["--grace-s", "0"],
    ["--worker-cmd", ""],
])
def test_bad_launcher_flags_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_options(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_workers_zero_is_fine_with_a_chief() -> None:
    assert parse_options(["--workers", "0", "--chief"]).chief


# ---- restarts (--restart on-failure) ----


def test_checkpoint_interval_goes_to_the_servers_with_their_checkpoint_dir() -> None:
    plan = ClusterPlan.allocate(1, 1, ports=fake_ports)
    specs = child_specs(plan, Options(checkpoint_dir="/ck", checkpoint_interval_s=0.5), python="py")
    assert specs[1].argv[-4:] == ("--checkpoint-dir", os.path.join("/ck", "ps-0"),
                                  "--checkpoint-interval-s", "0.5")
    assert "--checkpoint-interval-s" not in specs[0].argv


def test_never_restarts_nothing() -> None:
    decision = restart_decision(Options(), -9, 0)
    assert not decision.restart and "never" in decision.reason


def test_on_failure_restarts_a_failure_with_doubling_backoff_up_to_the_bound() -> None:
    options = Options(restart="on-failure", max_restarts=3, restart_backoff_s=0.5)
    decisions = [restart_decision(options, -9, n) for n in range(4)]
    assert [(d.restart, d.delay_s) for d in decisions] == [
        (True, 0.5), (True, 1.0), (True, 2.0), (False, 0.0)]
    assert decisions[0].reason == "restart 1 of 3"
    assert "already restarted 3 time(s)" in decisions[3].reason


def test_on_failure_leaves_a_clean_exit_alone_and_caps_the_backoff() -> None:
    options = Options(restart="on-failure", max_restarts=100, restart_backoff_s=1.0)
    assert not restart_decision(options, 0, 0).restart
    assert restart_decision(options, 1, 0).restart
    assert restart_decision(options, 1, 20).delay_s == 30.0


def test_restart_flags_are_parsed_and_checked() -> None:
    options = parse_options(["--restart", "on-failure", "--max-restarts", "5", "--restart-backoff-s", "0.2",
                             "--checkpoint-dir", "/ck", "--checkpoint-interval-s", "1"])
    o = options
    got = (o.restart, o.max_restarts, o.restart_backoff_s, o.checkpoint_interval_s)
    assert got == ("on-failure", 5, 0.2, 1.0)
    with pytest.raises(SystemExit):
        parse_options(["--checkpoint-interval-s", "1"])  # without --checkpoint-dir


def test_a_trainer_is_restarted_only_after_a_signal_and_only_under_on_failure() -> None:
    options = Options(restart="on-failure", max_restarts=2, restart_backoff_s=0.5)
    assert trainer_restart_decision(options, -9, 0).restart  # SIGKILL: retryable, as TFJob's ExitCode
    assert not trainer_restart_decision(options, -9, 2).restart  # the bound holds for trainers too
    for code in (0, 1, 2):  # its own verdict: success, a diverged run, bad flags
        assert not trainer_restart_decision(options, code, 0).restart
    assert not trainer_restart_decision(Options(), -9, 0).restart  # --restart never


def test_a_fast_port_base_pins_each_servers_fast_path_port(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: `pshard launch --fast-port N` gives ps-i port N+i, to open in a firewall."""
    options = parse_options(["--ps", "3", "--fast-port", "7200"])
    assert options.fast_port == 7200
    plan = ClusterPlan.allocate(3, 1, ports=fake_ports)
    specs = {s.name: s for s in child_specs(plan, options, python="py")}
    assert [specs[f"ps-{i}"].argv[-2:] for i in range(3)] == [("--fast-port", f"720{i}") for i in range(3)]
    assert "--fast-port" not in specs["scheduler"].argv
    assert "--fast-port" not in " ".join(child_specs(ClusterPlan.allocate(1, 1, ports=fake_ports), Options(),
                                                     python="py")[1].argv)
    with pytest.raises(SystemExit):
        parse_options(["--ps", "3", "--fast-port", "65534"])
    assert "--fast-port: got 65534, but ps-2 would listen on 65536" in capsys.readouterr().err
