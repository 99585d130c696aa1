"""Chaos (issue 10): a job under `pshard launch --restart on-failure` survives a seeded schedule of SIGKILLs.

Three servers, three trainers and a scheduler train an MLP on scikit-learn's digits for one to two minutes.
Every 10-20 s one node is SIGKILLed: a parameter server, the scheduler, or a worker (the chief too). The
launcher starts each again: a server or the scheduler on its address, a restarted server restoring its
shard from the last checkpoint (every 0.5 s); a trainer rejoins at the job's current clock and trains what
its shard plan has left, while the others go on without it.

The job must complete (the launcher exits 0) and reach the digits accuracy bar, and every node killed
while the job still had a while to go must have been restarted. The schedule is printed first and comes
from PSHARD_CHAOS_SEED (default 1), so a failure can be replayed with the same seed.

The same schedule runs a second time with `--replicas 1` instead of checkpoints: a killed server's slices
fail over to its in-sync backup, the restarted one rejoins as a backup, and a killed scheduler is given
the layout back by the chief. Nothing may be lost there: no failover may find its slices without an
in-sync copy, and no slice may be re-created or served from a copy that lacks them. `make test` runs the
replicated variant on seed 1; `make soak` runs both variants on more seeds (PSHARD_SOAK=1): the checkpoint
one's recovery paths are each covered in make test by tests/e2e/test_failures.py (a server restored from its
checkpoint, the scheduler killed and restarted, a worker killed), and its two minutes did not fit the budget.

A scheduler SIGKILLed and restarted mid-training must leave sync training bit-identical to an
undisturbed run of the same seed (issue 23, item 11): the workers re-register a few heartbeats apart,
and each clock's union batch must still be split by the same view on every worker. A chief SIGKILLed
together with the scheduler, after a failover, must find the failed-over layout (the servers give it back)
rather than a fresh one (make soak; the rule itself is tested in tests/service and tests/unit).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.e2e.harness import Proc, Procs, chief_accuracy, finals, start_launcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(720)]  # the run itself is bounded by RUN_TIMEOUT_S

SEED = int(os.environ.get("PSHARD_CHAOS_SEED", "1"))
NODES = ("scheduler", "ps-0", "ps-1", "ps-2", "worker-0", "worker-1", "worker-2")
# 500 epochs of digits over 3 workers are 7,500 sync clocks: one to two minutes on this machine, room for
# 4-8 kills at the gaps below, and make test's budget (the two variants took 400 s at 800 epochs). make
# soak runs the longer schedule (PSHARD_CHAOS_EPOCHS=800) on more seeds.
EPOCHS = int(os.environ.get("PSHARD_CHAOS_EPOCHS", "500"))
MIN_GAP_S, MAX_GAP_S = 10.0, 20.0
RUN_TIMEOUT_S = 600.0
# A kill this close to the job's end may find the trainers done before the restart's backoff is over.
RESTART_GRACE_S = 10.0
DIGITS_ACCURACY_BAR = 0.90  # as tests/e2e/test_failures.py: measured 0.96-0.98 for sync


@dataclass(frozen=True)
class Kill:
    after_s: float  # since the previous kill (the first: since training started)
    victim: str


def schedule(seed: int, count: int = 40) -> list[Kill]:
    """The kills, drawn in advance from `seed` (more than the job lasts)."""
    rng = random.Random(seed)
    return [Kill(round(rng.uniform(MIN_GAP_S, MAX_GAP_S), 1), rng.choice(NODES)) for _ in range(count)]


def children(launcher_pid: int) -> dict[str, int]:
    """The launcher's live children by task name (from the TF_CONFIG each one runs with)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        for item in environ:
            if item.startswith(b"TF_CONFIG="):
                task = json.loads(item[len(b"TF_CONFIG="):])["task"]
                found[f"{task['type']}-{task['index']}" if task["type"] != "scheduler" else "scheduler"] = (
                    int(entry.name))
    return found


def wait_for(condition: object, timeout_s: float, what: str, run: Proc) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert run.alive(), f"the launcher ended while waiting for {what}:\n{run.output()}"
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s:\n{run.output()}"
        time.sleep(0.1)  # polling the process table and the launcher's output


@pytest.mark.parametrize("replicas", [0, 1], ids=["checkpoints", "replicas"])
def test_a_job_survives_a_seeded_schedule_of_kills(procs: Procs, tmp_path: Path, replicas: int) -> None:
    if not replicas and not os.environ.get("PSHARD_SOAK"):
        pytest.skip("the checkpoint variant runs in make soak (PSHARD_SOAK=1), see the module docstring")
    kills = schedule(SEED)
    print(f"\nchaos seed {SEED} (PSHARD_CHAOS_SEED), replicas {replicas}, schedule: "
          + ", ".join(f"+{k.after_s}s {k.victim}" for k in kills))
    data_dir = tmp_path / "empty-data"  # digits, bundled with scikit-learn
    data_dir.mkdir()
    # Without replicas a restarted server restores its shard from the last checkpoint; with them it
    # rejoins as a backup and copies its state from the live primaries, no checkpoint involved.
    recovery = (("--replicas", str(replicas)) if replicas else
                ("--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-interval-s", "0.5"))
    run = start_launcher(
        procs, "--ps", "3", "--workers", "3", "--restart", "on-failure", "--max-restarts", "20",
        "--restart-backoff-s", "0.5", *recovery, "--certs-dir", str(tmp_path / "certs"), "--",
        "--mode", "sync", "--epochs", str(EPOCHS), "--batch-size", "32", "--model", "mlp",
        "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--seed", "0", "--data-dir", str(data_dir),
        "--metrics", str(tmp_path / "metrics-{task}.jsonl"))
    metrics = tmp_path / "metrics-worker-0.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 120, "training to start", run)

    started = time.monotonic()
    done: list[tuple[str, float]] = []  # (victim, when)
    for kill in kills:
        deadline = time.monotonic() + kill.after_s
        while run.alive() and time.monotonic() < deadline:
            time.sleep(0.1)  # the schedule's gap; the launcher may finish meanwhile
        if not run.alive():
            break
        pid = children(run.pid).get(kill.victim)
        if pid is None:  # not running right now (being restarted, or a trainer that already finished)
            print(f"chaos: +{time.monotonic() - started:.0f}s {kill.victim} not running, skipped")
            continue
        if any(line.startswith(f"[{kill.victim}] final:") for line in run.lines):
            # A trainer past its final line is only exiting: killed now, the launcher restarts it,
            # it rejoins a finished job and prints a second final line (seen in CI), testing nothing
            # about recovery.
            print(f"chaos: +{time.monotonic() - started:.0f}s {kill.victim} already finished, skipped")
            continue
        os.kill(pid, signal.SIGKILL)
        done.append((kill.victim, time.monotonic()))
        print(f"chaos: +{time.monotonic() - started:.0f}s SIGKILL {kill.victim} (pid {pid})")

    code = run.wait(RUN_TIMEOUT_S)
    ended = time.monotonic()
    victims = ", ".join(v for v, _ in done)
    log = tmp_path / "launcher.log"  # every child's lines, for replaying a failure
    log.write_text("\n".join(run.lines) + "\n")
    print(f"chaos: {len(done)} kills ({victims}) in {ended - started:.0f} s of training; output in {log}")
    assert code == 0, run.output(200)
    assert len(done) >= 3, f"the job ended before the chaos had its way: {done}\n{run.output()}"
    for victim, when in done:  # a kill in the job's last seconds may find the trainers done first
        if ended - when > RESTART_GRACE_S:
            assert any(f"{victim} restarted" in line for line in run.lines), (
                f"{victim} was killed but never restarted:\n{run.output()}")
    results = finals(run)
    assert "worker-0" in results, run.output()
    assert chief_accuracy(*results.values()) > DIGITS_ACCURACY_BAR, results
    if replicas:
        # A server restarted at a dead primary's address may answer a step before the failover is
        # published ("rejoins as a backup"): the worker re-routes, as designed (seen in CI). Any other
        # "not declared" means a server lacked slices that the layout gave it.
        text = "\n".join(line for line in run.lines if "rejoins as a backup" not in line)
        for loss in ("FAILOVER IMPOSSIBLE", "holds no copy of it", "not declared on this server"):
            assert loss not in text, f"{loss!r}:\n{run.output()}"
        server_kills = sum(v.startswith("ps-") for v, _ in done)
        assert not server_kills or "FAILOVER: server" in text, run.output()



def _digits_run(procs: Procs, name: str, tmp_path: Path, *args: str, epochs: int = 20) -> tuple[Proc, Path]:
    """A short sync job on digits (2 servers, 2 trainers) that saves its final model."""
    data_dir = tmp_path / "empty-data"  # digits, bundled with scikit-learn
    data_dir.mkdir(exist_ok=True)
    model = tmp_path / f"{name}.pt"
    run = procs.python(name, "-m", "pshard.launcher", "--ps", "2", "--workers", "2",
                       "--scheduler-interval-ms", "200", "--scheduler-timeout-ms", "1500", *args, "--",
                       "--mode", "sync", "--epochs", str(epochs), "--batch-size", "32", "--model", "mlp",
                       "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--seed", "0",
                       "--threads", "1", "--data-dir", str(data_dir), "--output", str(model),
                       "--metrics", "-", "--log-every", "1", "--step-timeout-s", "60",
                       "--startup-timeout-s", "30")
    return run, model


def test_a_scheduler_restart_leaves_sync_training_bit_identical(procs: Procs, tmp_path: Path) -> None:
    reference, reference_model = _digits_run(procs, "undisturbed", tmp_path)
    assert reference.wait(RUN_TIMEOUT_S) == 0, reference.output()

    run, model = _digits_run(procs, "scheduler-restart", tmp_path, "--restart", "on-failure",
                             "--restart-backoff-s", "0.2")
    for name in ("worker-0", "worker-1"):
        run.wait_for_line(rf'^\[{name}\] .*"event": "step".*"step": 40,', RUN_TIMEOUT_S)
    os.kill(children(run.pid)["scheduler"], signal.SIGKILL)
    run.wait_for_line(r"^launcher: scheduler restarted", 60)
    for name in ("worker-0", "worker-1"):  # each re-registered with the new scheduler while training
        run.wait_for_line(rf"^\[{name}\] .*forgot {name} .*registering again", 60)
    assert run.wait(RUN_TIMEOUT_S) == 0, run.output()
    assert set(finals(run)) == {"worker-0", "worker-1"}
    last_step = max(i for i, line in enumerate(run.lines) if '"event": "step"' in line)
    reregistered = max(i for i, line in enumerate(run.lines) if "registering again" in line)
    assert reregistered < last_step, f"the job ended before the workers re-registered:\n{run.output()}"

    expected = torch.load(reference_model, weights_only=True)["state_dict"]
    got = torch.load(model, weights_only=True)["state_dict"]
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        diff = (got[key] - value).abs().max().item()
        assert torch.equal(got[key], value), f"{key}: differs from the undisturbed run (max abs diff {diff})"


def test_a_chief_restarted_just_before_the_scheduler_joins_the_layout_its_servers_hold(
        procs: Procs, tmp_path: Path) -> None:
    """The chaos failure of 11-28: the chief was restarted just before the scheduler, so no member had a
    layout to give back, and the new chief's proposal was planned afresh (version 1) over servers that
    routed by a failover's later version; they then disagreed about who was primary and the job failed.
    The servers now give the restarted scheduler their layout as they register again.

    50-60 s on the loaded 2-core machine (the restarted chief alone takes 10 s to start), past make test's
    budget: `make soak` runs it; tests/service/test_scheduler_service.py and tests/unit/test_replicas.py
    prove the rule in make test. Without the fix it fails as the chaos run did (fresh "layout version 1",
    "has this server as its primary since a failover", a pull timed out)."""
    if not os.environ.get("PSHARD_SOAK"):
        pytest.skip("runs in make soak (PSHARD_SOAK=1): 50-60 s, see the docstring")
    run, _ = _digits_run(procs, "chief-and-scheduler-restart", tmp_path, "--replicas", "1",
                         "--restart", "on-failure", "--restart-backoff-s", "0.2", epochs=10)
    run.wait_for_line(r'^\[worker-1\] .*"event": "step".*"step": 20,', RUN_TIMEOUT_S)
    for _ in range(2):  # killed before its backup is in sync, a primary would not be failed over
        run.wait_for_line(r"^\[scheduler\] .*ROLE: .* is an in-sync backup of", 60)
    os.kill(children(run.pid)["ps-1"], signal.SIGKILL)
    run.wait_for_line(r"^\[scheduler\] .*FAILOVER: server 1 .*layout version 2", 60)
    pids = children(run.pid)
    os.kill(pids["worker-0"], signal.SIGKILL)  # a fresh chief process holds no layout to give back
    os.kill(pids["scheduler"], signal.SIGKILL)
    run.wait_for_line(r"^launcher: scheduler restarted", 60)

    assert run.wait(RUN_TIMEOUT_S) == 0, run.output(200)
    assert set(finals(run)) == {"worker-0", "worker-1"}
    text = "\n".join(run.lines)
    restarted = text.index("launcher: scheduler restarted")
    assert "LAYOUT: adopted layout version" in text[restarted:], run.output(200)
    assert "layout version 1:" not in text[restarted:], run.output(200)  # no fresh plan
