"""A command whose optional extra is not installed ends in one line that names the install, exit 2."""

from __future__ import annotations

import subprocess
import sys

# torch made unimportable in a child, as in an install without the worker extra (the server image).
NO_TORCH = ("import sys; sys.modules['torch'] = None; from pshard.cli import main; "
            "sys.exit(main(['worker', '--help']))")


def test_pshard_worker_without_torch_names_the_worker_extra_and_exits_2():
    done = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=60)

    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "pshard worker: error: this command needs torch, which is not installed: pip install '.[worker]' "
        "in a clone of pshard"]


def test_a_missing_module_no_extra_brings_is_not_hidden():
    from pshard.cli import missing_extra

    assert missing_extra(ModuleNotFoundError("no", name="grpc"), "pshard ps") is None
    plot = missing_extra(ModuleNotFoundError("no", name="matplotlib.pyplot"), "pshard plot")
    assert "'.[plot]'" in str(plot)
