"""Missing peers with real processes (issue 10): a worker waiting for a peer says every few seconds whom
it waits for and at which address, and a peer that refuses connections past a short grace (half the
start-up timeout here) ends the wait at once with an error naming it. Before, each of these was a
silent wait of the whole start-up timeout (5 minutes by default) ending in an error naming nobody."""

from __future__ import annotations

import time

import pytest
from pshard.launcher.plan import ClusterPlan

from tests.e2e.harness import SYNC, Proc, Procs, wait_healthy

pytestmark = pytest.mark.e2e

STARTUP_S = 12  # the refusal grace is half of it
BOUND_S = 45  # far below what the old silent waits took, and still generous on busy cores


def _worker(procs: Procs, plan: ClusterPlan, name: str, index: int, tmp_path) -> Proc:
    data = tmp_path / "empty-data"
    data.mkdir(exist_ok=True)
    task = next(t for t in plan.trainers if t.name == name)
    return procs.python(name, "-m", "pshard.worker", *SYNC, "--data-dir", str(data), "--model", "mlp",
                        "--epochs", "1", "--startup-timeout-s", str(STARTUP_S), "--step-timeout-s", "30",
                        tf_config=plan.tf_config(task))


def _servers(procs: Procs, plan: ClusterPlan, start_ps: tuple[int, ...]) -> None:
    sched = plan.servers[0]
    started = [(sched, procs.python("scheduler", "-m", "pshard.scheduler", "--bind", sched.address,
                                    tf_config=plan.tf_config(sched)))]
    for i in start_ps:
        task = plan.servers[1 + i]
        started.append((task, procs.python(task.name, "-m", "pshard.ps_server", "--bind", task.address,
                                           tf_config=plan.tf_config(task))))
    for task, proc in started:
        wait_healthy(task.address, proc=proc)


def _ends_naming(proc: Proc, *texts: str) -> str:
    started = time.monotonic()
    code = proc.wait(BOUND_S)
    assert code == 1, proc.output()
    assert time.monotonic() - started < BOUND_S
    errors = [line for line in proc.lines if "error:" in line]
    assert errors and all(t in errors[-1] for t in texts), proc.output()
    return errors[-1]


def test_no_scheduler(procs: Procs, tmp_path) -> None:
    plan = ClusterPlan.allocate(1, 1)
    worker = _worker(procs, plan, "worker-0", 0, tmp_path)

    _ends_naming(worker, f"the scheduler at {plan.scheduler}: connection refused for")
    assert any("still waiting after" in line and f"the scheduler at {plan.scheduler} (connection refused"
               in line for line in worker.lines), worker.output()


def test_a_server_address_with_nothing_behind_it(procs: Procs, tmp_path) -> None:
    plan = ClusterPlan.allocate(2, 1)
    _servers(procs, plan, start_ps=(0,))  # ps-1 is never started
    worker = _worker(procs, plan, "worker-0", 0, tmp_path)

    _ends_naming(worker, "declaring the parameters", f"ps-1 at {plan.ps[1]}: connection refused")


def test_a_chief_tf_config_lists_but_nobody_started(procs: Procs, tmp_path) -> None:
    plan = ClusterPlan.allocate(1, 1, chief=True)
    _servers(procs, plan, start_ps=(0,))
    worker = _worker(procs, plan, "worker-0", 0, tmp_path)

    # Trainers do not listen, so nothing can be refused: the wait lasts the start-up timeout, naming the
    # chief every few seconds, and the error at the end names it (the scheduler never heard of it).
    missing = f"missing: chief-0 at {plan.chief[0]} (not registered with the scheduler)"
    _ends_naming(worker, "barrier", missing)
    assert any("the start barrier: still waiting after" in line
               and f"chief-0 at {plan.chief[0]} (not registered with the scheduler)" in line
               for line in worker.lines), worker.output()


def test_a_peer_in_another_mode_that_already_left(procs: Procs, tmp_path) -> None:
    plan = ClusterPlan.allocate(1, 2)
    _servers(procs, plan, start_ps=(0,))
    data = tmp_path / "empty-data"
    data.mkdir()
    workers = []
    for index, mode in ((0, "sync"), (1, "async")):
        task = next(t for t in plan.trainers if t.name == f"worker-{index}")
        workers.append(procs.python(task.name, "-m", "pshard.worker", "--mode", mode, "--data-dir", str(data),
                                    "--model", "mlp", "--epochs", "1", "--startup-timeout-s", "120",
                                    "--step-timeout-s", "30", tf_config=plan.tf_config(task)))
    # Whichever declared second is refused (the servers run the first one's mode) and leaves; the other,
    # at the start barrier, must not wait its 120 s start-up timeout for a peer that left.
    started = time.monotonic()
    codes = [w.wait(BOUND_S) for w in workers]
    assert codes == [1, 1], [w.output() for w in workers]
    assert time.monotonic() - started < BOUND_S
    errors = {w.name: next(line for line in reversed(w.lines) if "error:" in line) for w in workers}
    refused = [name for name, line in errors.items() if "this server runs" in line]
    assert len(refused) == 1, errors
    (waiter,) = set(errors) - set(refused)
    address = next(t.address for t in plan.trainers if t.name == refused[0])
    expected = f"the start barrier: {refused[0]} at {address} is gone (already left the job)"
    assert expected in errors[waiter], errors
