"""`pshard launch --coordinator SCRIPT`: the chief runs the script with the arguments after '--', every
worker serves its functions; the flags that cannot go with it are refused naming them."""

from __future__ import annotations

import sys

import pytest
from pshard.launcher.cli import parse_options
from pshard.launcher.plan import ClusterPlan, child_specs


def fake_ports(count: int, host: str) -> list[int]:
    return list(range(7000, 7000 + count))


def test_the_chief_runs_the_script_and_the_workers_serve() -> None:
    options = parse_options(["--ps", "1", "--workers", "2", "--coordinator", "job.py", "--", "--steps", "9"])
    plan = ClusterPlan.allocate(options.ps, options.workers, chief=options.chief, ports=fake_ports)

    trainers = {s.name: s for s in child_specs(plan, options, python="py") if not s.health_address}

    assert options.chief and options.coordinator == "job.py"
    assert trainers["chief-0"].argv == ("py", "job.py", "--steps", "9")
    assert trainers["worker-0"].argv == ("py", "-m", "pshard.worker", "--serve")
    assert trainers["worker-1"].argv == ("py", "-m", "pshard.worker", "--serve")
    assert '"type": "chief"' in trainers["chief-0"].env["TF_CONFIG"]


@pytest.mark.parametrize(("argv", "named"), [
    (["--coordinator", "job.py", "train.py"], "--coordinator: got it with a worker script"),
    (["--coordinator", "job.py", "--worker-cmd", "python w.py"], "--coordinator: got it with --worker-cmd"),
])
def test_a_coordinator_with_a_worker_script_or_command_is_refused(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_options(argv)
    assert raised.value.code == 2
    assert named in capsys.readouterr().err


def test_workers_serve_with_this_python_by_default() -> None:
    options = parse_options(["--coordinator", "job.py"])
    plan = ClusterPlan.allocate(options.ps, options.workers, chief=True, ports=fake_ports)
    worker = next(s for s in child_specs(plan, options) if s.name == "worker-0")
    assert worker.argv[0] == sys.executable
