"""`python -m pshard.launcher` runs a real local cluster: scheduler, parameter servers and workers.

The training test uses scikit-learn's digits (an empty --data-dir makes the workers fall back to
them), which train to high accuracy in seconds. The stand-in workers (`--worker-cmd`) check the
launcher's own duties (TF_CONFIG, prefixed output, shutdown) without the cost of training.
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
from pathlib import Path

import pytest
import torch
from pshard.common.entry import LAUNCHER_PID_ENV
from pshard.common.rpc.health import probe

from tests.e2e.harness import PYTHON, Proc, Procs, finals, start_launcher, wait_until

pytestmark = pytest.mark.e2e

# Whole-run bounds; a run takes a fraction of these on two busy cores.
RUN_TIMEOUT_S = 90
QUICK_TIMEOUT_S = 45
# Sync training on digits with 2 workers: 3 epochs of batch 32 (69 steps each; the whole run
# takes 3 s idle, 25 s on busy cores) reached 0.98 test accuracy in measurements (0.96 with half
# the learning rate; chance is 0.10). 0.90 leaves room for noise and fails a model that did not train.
DIGITS_ACCURACY_BAR = 0.90


def child_lines(proc: Proc, name: str) -> list[str]:
    """Lines the launcher relayed from child `name`, without the prefix."""
    prefix = f"[{name}] "
    return [line[len(prefix):] for line in proc.lines if line.startswith(prefix)]


def server_addresses(proc: Proc) -> list[str]:
    """The scheduler and server addresses from the launcher's `cluster {...}` line."""
    match = proc.wait_for_line(r"^launcher: cluster (\{.*\})$", QUICK_TIMEOUT_S)
    cluster = json.loads(match.group(1))
    return [*cluster["scheduler"], *cluster["ps"]]


def assert_gone(pid: int) -> None:
    """`pid` no longer exists (an orphan reparented to init is reaped by it shortly)."""

    def gone() -> bool:
        try:
            status = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        return status == "Z"  # killed; its new parent has not reaped it yet

    wait_until(gone, 10, f"process {pid} to be gone")


def test_help_describes_the_cluster_flags() -> None:
    import subprocess

    result = subprocess.run([PYTHON, "-m", "pshard.launcher", "--help"], capture_output=True, text=True,
                            timeout=QUICK_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    for flag in ("--ps", "--workers", "--chief", "--host", "--scheduler-timeout-ms", "--worker-cmd", "--"):
        assert flag in result.stdout


def test_sync_training_on_digits_finishes_and_saves_a_state_dict(procs: Procs, tmp_path: Path) -> None:
    data_dir = tmp_path / "empty-data"
    data_dir.mkdir()
    model_path = tmp_path / "model.pt"
    run = start_launcher(procs, "--ps", "2", "--workers", "2", "--",
                         "--mode", "sync", "--epochs", "3", "--batch-size", "32", "--model", "mlp",
                         "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--seed", "0",
                         "--data-dir", str(data_dir), "--output", str(model_path),
                         "--metrics", str(tmp_path / "metrics-{task}.jsonl"))
    code = run.wait(RUN_TIMEOUT_S)
    assert code == 0, run.output()
    assert run.lines[-1] == "launcher: exit 0: worker-0=0 worker-1=0", run.output()

    results = finals(run)
    assert set(results) == {"worker-0", "worker-1"}, run.output()
    accuracies = [float(f["test_accuracy"]) for f in results.values() if "test_accuracy" in f]
    assert len(accuracies) == 1, results  # only the chief (worker 0 here) evaluates
    assert accuracies[0] > DIGITS_ACCURACY_BAR, results

    state = torch.load(model_path, weights_only=True)["state_dict"]  # beside the model's description
    assert isinstance(state, dict) and state
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    for name in ("worker-0", "worker-1"):
        assert (tmp_path / f"metrics-{name}.jsonl").stat().st_size > 0


def test_a_failing_worker_stops_everything_and_fails_the_launch(procs: Procs) -> None:
    run = start_launcher(procs, "--ps", "1", "--workers", "2", "--grace-s", "5", "--", "--no-such-flag")
    servers = server_addresses(run)
    code = run.wait(QUICK_TIMEOUT_S)
    assert code == 2, run.output()  # argparse's usage-error status, passed through
    # Whichever worker fails first stops the other, which may not have got as far as its own usage error:
    # both answer within half a second now (flags parsed before torch loads), so either can be first.
    first = re.search(r"launcher: (worker-\d) failed \(2\); stopping everything", "\n".join(run.lines))
    assert first is not None, run.output()
    assert any("--no-such-flag" in line for line in child_lines(run, first.group(1))), run.output()
    assert re.fullmatch(r"launcher: exit 2: worker-0=\S+ worker-1=\S+", run.lines[-1]), run.output()
    for address in servers:
        assert not probe(address, timeout_s=1.0, security=procs.admin_security())[0], \
            f"{address} still serving after the launcher exited"


def test_a_server_that_cannot_start_fails_the_launch_before_any_worker(procs: Procs) -> None:
    # A stand-in worker that would say so if it ran. The launcher checks --checkpoint-dir itself, so a
    # file where the server's own sub-directory (<dir>/ps-0) goes is what makes ps fail, after it started.
    root = procs.tmp_path / "checkpoints"
    root.mkdir()
    (root / "ps-0").write_text("")
    run = start_launcher(procs, "--ps", "1", "--workers", "1", "--checkpoint-dir", str(root),
                         "--worker-cmd", f"{PYTHON} -c 'print(\"worker ran\")'")
    code = run.wait(QUICK_TIMEOUT_S)
    assert code == 1, run.output()
    assert "worker ran" not in "\n".join(run.lines)
    assert run.lines[-1] == "launcher: exit 1: worker-0=not-started", run.output()


STAND_IN = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    # A grandchild in the worker's process group, as a data loader would be.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    if task["index"] == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this one
    print(f"pids {os.getpid()} {sleeper.pid} task {task['type']}-{task['index']}", flush=True)
    time.sleep(300)
""")


def test_sigterm_stops_every_child_and_grandchild(procs: Procs, tmp_path: Path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    run = start_launcher(procs, "--ps", "1", "--workers", "2", "--grace-s", "1",
                         "--worker-cmd", f"{PYTHON} {script}")
    servers = server_addresses(run)
    pids = []
    for name in ("worker-0", "worker-1"):
        match = run.wait_for_line(rf"^\[{name}\] pids (\d+) (\d+) task {name}$", QUICK_TIMEOUT_S)
        pids += [int(match.group(1)), int(match.group(2))]

    run.signal_group(signal.SIGTERM)
    code = run.wait(QUICK_TIMEOUT_S)

    assert code == 128 + signal.SIGTERM, run.output()
    assert "launcher: got SIGTERM; stopping everything" in run.lines, run.output()
    assert "launcher: worker-0 still running 1s after SIGTERM; sending SIGKILL" in run.lines, run.output()
    assert run.lines[-1] == "launcher: exit 143: worker-0=SIGKILL worker-1=SIGTERM", run.output()
    for pid in pids:
        assert_gone(pid)
    for address in servers:
        assert not probe(address, timeout_s=1.0, security=procs.admin_security())[0], \
            f"{address} still serving after the launcher exited"


def test_every_child_line_is_prefixed_with_its_name(procs: Procs) -> None:
    run = start_launcher(procs, "--ps", "2", "--workers", "1", "--chief",
                         "--worker-cmd", f"{PYTHON} -c 'import os; print(os.environ[\"TF_CONFIG\"])'")
    assert run.wait(QUICK_TIMEOUT_S) == 0, run.output()
    names = {"scheduler", "ps-0", "ps-1", "chief-0", "worker-0"}
    for line in run.lines:
        assert line.startswith("launcher: ") or re.match(r"^\[([\w-]+)\] ", line), line
        if not line.startswith("launcher: "):
            assert line[1:line.index("]")] in names, line
    for name in ("chief-0", "worker-0"):
        (tf_config,) = child_lines(run, name)
        task_type, index = name.split("-")
        assert json.loads(tf_config)["task"] == {"type": task_type, "index": int(index)}
        assert set(json.loads(tf_config)["cluster"]) == {"scheduler", "ps", "chief", "worker"}
    assert run.lines[-1] == "launcher: exit 0: chief-0=0 worker-0=0"


def test_sigterm_mid_training_stops_real_workers_quietly(procs: Procs, tmp_path: Path) -> None:
    data_dir = tmp_path / "empty-data"
    data_dir.mkdir()
    run = start_launcher(procs, "--ps", "1", "--workers", "2", "--grace-s", "20", "--",
                         "--mode", "sync", "--epochs", "1000", "--batch-size", "32", "--model", "mlp",
                         "--data-dir", str(data_dir), "--metrics", "-", "--log-every", "1")
    for name in ("worker-0", "worker-1"):
        run.wait_for_line(rf'^\[{name}\] .*"event": "step"', RUN_TIMEOUT_S)

    run.signal_group(signal.SIGTERM)
    code = run.wait(QUICK_TIMEOUT_S)

    assert code == 128 + signal.SIGTERM, run.output()
    # Each worker took the launcher's SIGTERM as a stop: left, reported it, exited 128 + 15.
    assert run.lines[-1] == "launcher: exit 143: worker-0=143 worker-1=143", run.output()
    results = finals(run)
    assert {name: fields.get("failed") for name, fields in results.items()} == {
        "worker-0": "stopped", "worker-1": "stopped"}, run.output()
    assert not any("Traceback" in line for line in run.lines), run.output()
    assert not any("still running" in line for line in run.lines), run.output()


def _children_of_launcher(launcher_pid: int) -> list[int]:
    """Live processes whose environment marks them as children of the launcher `launcher_pid`."""
    marker = f"{LAUNCHER_PID_ENV}={launcher_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_a_sigkilled_launcher_takes_its_children_with_it(procs: Procs, tmp_path: Path) -> None:
    # The launcher starts each child in its own session, so only the kernel's parent-death signal,
    # which every pshard entry point asks for, can reach them once the launcher is SIGKILLed.
    data_dir = tmp_path / "empty-data"
    data_dir.mkdir()
    run = start_launcher(procs, "--ps", "1", "--workers", "1", "--", "--mode", "async", "--epochs", "1000",
                         "--model", "mlp", "--data-dir", str(data_dir), "--metrics", "-", "--log-every", "1")
    run.wait_for_line(r'^\[worker-0\] .*"event": "step"', RUN_TIMEOUT_S)
    children = _children_of_launcher(run.popen.pid)
    assert len(children) == 3, run.output()  # scheduler, ps-0, worker-0

    os.kill(run.popen.pid, signal.SIGKILL)  # the launcher alone, not its process group
    assert run.wait(QUICK_TIMEOUT_S) == -signal.SIGKILL
    for pid in children:
        assert_gone(pid)


@pytest.mark.parametrize(("args", "names"), [
    (("--host", "192.0.2.1"), "--host: cannot listen on '192.0.2.1'"),  # TEST-NET: never local
    (("--worker-cmd", "no-such-program-here --x"), "--worker-cmd: 'no-such-program-here'"),
])
def test_a_launch_that_cannot_start_is_one_error_line_before_any_process(procs: Procs, args: tuple[str, ...],
                                                                          names: str) -> None:
    import subprocess

    result = subprocess.run([PYTHON, "-m", "pshard.launcher", *args], capture_output=True, text=True,
                            timeout=QUICK_TIMEOUT_S)

    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # no cluster line: nothing started
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("python -m pshard.launcher: error: ") and names in line, line


def test_sigterm_while_the_launcher_starts_is_a_quiet_stop(procs: Procs) -> None:
    from tests.service.entrypoints import wait_until_catching

    run = start_launcher(procs, "--ps", "1", "--workers", "1")
    wait_until_catching(run.popen, signal.SIGTERM, QUICK_TIMEOUT_S)

    run.signal_group(signal.SIGTERM)
    code = run.wait(QUICK_TIMEOUT_S)

    assert code == 128 + signal.SIGTERM, run.output()
    assert not any("Traceback" in line for line in run.lines), run.output()


def _pid_serving(address: str) -> int:
    """The pid of the process started with ``--bind address`` (a launcher child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--bind" in argv and address.encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no process bound to {address}")


@pytest.mark.parametrize("victim_name", ["ps-1", "scheduler"])
def test_restart_on_failure_brings_a_killed_server_back(procs: Procs, tmp_path: Path,
                                                        victim_name: str) -> None:
    data_dir = tmp_path / "empty-data"
    data_dir.mkdir()
    checkpoints = tmp_path / "checkpoints"
    run = start_launcher(procs, "--ps", "2", "--workers", "2", "--scheduler-interval-ms", "200",
                         "--scheduler-timeout-ms", "1500", "--checkpoint-dir", str(checkpoints),
                         "--checkpoint-interval-s", "0.3", "--restart", "on-failure",
                         "--restart-backoff-s", "0.2", "--",
                         # The scheduler's restart must fall inside training even on an idle machine.
                         "--mode", "sync", "--epochs", "8" if victim_name == "ps-1" else "40",
                         "--batch-size", "32", "--model", "mlp",
                         "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--seed", "0",
                         "--data-dir", str(data_dir), "--metrics", "-", "--log-every", "1",
                         "--step-timeout-s", "30", "--startup-timeout-s", "30")
    ps1 = server_addresses(run)[2]
    for name in ("worker-0", "worker-1"):
        run.wait_for_line(rf'^\[{name}\] .*"event": "step"', RUN_TIMEOUT_S)
    if victim_name == "scheduler":
        scheduler = server_addresses(run)[0]
        os.kill(_pid_serving(scheduler), signal.SIGKILL)
        run.wait_for_line(r"^launcher: scheduler exited \(SIGKILL\) while workers were training; restarting "
                          "it on " + re.escape(scheduler), QUICK_TIMEOUT_S)
        run.wait_for_line(r"^launcher: scheduler restarted \(restart 1 of 3, pid \d+\)$", QUICK_TIMEOUT_S)
        assert run.wait(RUN_TIMEOUT_S) == 0, run.output()
        return
    # The json commits a checkpoint (its npz comes first): only then has a restart something to restore.
    committed = checkpoints / "ps-1" / "shard.json"
    wait_until(committed.exists, QUICK_TIMEOUT_S, f"ps-1 to commit a checkpoint at {committed}")

    victim = _pid_serving(ps1)
    os.kill(victim, signal.SIGKILL)

    run.wait_for_line(r"^launcher: ps-1 exited \(SIGKILL\) while workers were training; restarting it on "
                      + re.escape(ps1) + r" in 0.2s \(restart 1 of 3\)$", QUICK_TIMEOUT_S)
    run.wait_for_line(r"^launcher: ps-1 restarted \(restart 1 of 3, pid \d+\)$", QUICK_TIMEOUT_S)
    run.wait_for_line(r"^\[ps-1\] .*restored \d+ slices", QUICK_TIMEOUT_S)
    assert _pid_serving(ps1) != victim
    code = run.wait(RUN_TIMEOUT_S)
    assert code == 0, run.output()
    assert run.lines[-1] == "launcher: exit 0: worker-0=0 worker-1=0", run.output()
    results = finals(run)
    accuracies = [float(f["test_accuracy"]) for f in results.values() if "test_accuracy" in f]
    assert len(accuracies) == 1 and accuracies[0] > DIGITS_ACCURACY_BAR, results


def test_a_relaunch_with_the_same_checkpoint_dir_starts_fresh_unless_resumed(procs: Procs,
                                                                            tmp_path: Path) -> None:
    # Issue 10: re-running with the same --checkpoint-dir mixed two jobs (the restored servers fenced
    # the new workers with the old run's generations, or silently resumed the old weights).
    data_dir = tmp_path / "empty-data"
    data_dir.mkdir()
    checkpoints = tmp_path / "checkpoints"
    worker_args = ("--mode", "sync", "--epochs", "1", "--batch-size", "64", "--model", "mlp",
                   "--data-dir", str(data_dir), "--step-timeout-s", "30", "--startup-timeout-s", "30")
    runs = []
    for extra in ((), (), ("--resume",)):
        run = start_launcher(procs, "--ps", "1", "--workers", "2", "--checkpoint-dir", str(checkpoints),
                             *extra, "--", *worker_args)
        assert run.wait(RUN_TIMEOUT_S) == 0, run.output()
        assert (checkpoints / "ps-0" / "shard.json").exists()
        runs.append(child_lines(run, "ps-0"))
    first, second, resumed = runs
    assert not any("NOT RESTORING" in line or "RESUMING" in line for line in first), first
    set_aside = [line for line in second if "NOT RESTORING" in line]
    assert len(set_aside) == 1 and "'launch-" in set_aside[0], second
    assert [line for line in resumed if "RESUMING ANOTHER JOB (--resume)" in line], resumed
