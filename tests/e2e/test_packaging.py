"""`pip install` of a clean copy of the repository, into a fresh virtual environment, without make.

The copy holds what git tracks (or would: new files not ignored), so no generated stub and no
.venv: the build hook (setup.py) must generate `pshard.api.v1` itself, with grpcio-tools from
pip's build isolation. Then the installed distribution is checked from outside the repository:
the public imports, the stubs, its only top-level name `pshard`, and the `pshard` command.
The install is the server image's (no worker extra), so it also shows that pshard installs no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

INSTALL_TIMEOUT_S = 240  # venv + pip install, dependencies from the package index or pip's cache
RUN_TIMEOUT_S = 60


@dataclass(frozen=True)
class Installed:
    source: Path  # the clean copy that was installed
    python: Path  # the fresh venv's interpreter
    bin: Path
    workdir: Path  # outside the repository and the copy, so neither is on sys.path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TF_CONFIG")}


def clean_copy(destination: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True, timeout=RUN_TIMEOUT_S).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("packaging")
    source = clean_copy(base / "pshard")
    assert not list(source.glob("pshard/api/v1/*_pb2*")), "the copy must hold no generated stub"
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT_S,
                   env=_env(), cwd=base)
    python = venv / "bin" / "python"
    result = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(source)], cwd=base,
                            env=_env(), capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    workdir = base / "elsewhere"
    workdir.mkdir()
    return Installed(source, python, venv / "bin", workdir)


def run_in(installed: Installed, *argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], cwd=installed.workdir, env=_env(), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def python_json(installed: Installed, code: str) -> object:
    result = run_in(installed, installed.python, "-c", code)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_package_its_client_and_its_stubs_import_from_the_installed_copy(installed: Installed) -> None:
    files = python_json(installed, """if True:
        import json, pshard, pshard.worker
        from pshard.worker import PSClient
        from pshard.client import PSClient as client_PSClient, TableClient
        assert client_PSClient is PSClient and TableClient.__module__ == "pshard.client.tables"
        from pshard.api.v1 import parameter_server_pb2, parameter_server_pb2_grpc, scheduler_pb2, tensor_pb2
        assert PSClient.__module__ == "pshard.client.ps_client"
        print(json.dumps([m.__file__ for m in (pshard, parameter_server_pb2, scheduler_pb2, tensor_pb2)]))
    """)

    assert isinstance(files, list)
    for file in files:
        assert Path(file).is_relative_to(installed.python.parent.parent), file  # in the venv, not a tree


def test_the_distributions_only_top_level_name_is_pshard(installed: Installed) -> None:
    facts = python_json(installed, """if True:
        import json
        from importlib.metadata import distribution
        dist = distribution("pshard")
        print(json.dumps({"top_level": dist.read_text("top_level.txt").split(),
                          "roots": sorted({f.parts[0] for f in dist.files if f.parts[0] != ".."})}))
    """)

    assert isinstance(facts, dict)
    assert facts["top_level"] == ["pshard"]
    # Besides the package, only its own metadata folder (scripts live outside site-packages: "..").
    assert [r for r in facts["roots"] if not r.endswith(".dist-info")] == ["pshard"]


def test_the_pshard_command_and_its_ps_subcommand_answer_help(installed: Installed) -> None:
    top = run_in(installed, installed.bin / "pshard", "--help")
    ps = run_in(installed, installed.bin / "pshard", "ps", "--help")

    assert top.returncode == 0, top.stderr
    assert all(f"  {command} " in top.stdout for command in ("scheduler", "ps", "worker", "launch", "run"))
    assert ps.returncode == 0, ps.stderr
    assert ps.stdout.startswith("usage: pshard ps ") and "--checkpoint-dir" in ps.stdout


def test_without_the_worker_extra_nothing_installs_torch(installed: Installed) -> None:
    found = python_json(installed, "import importlib.util, json; "
                                   "print(json.dumps(importlib.util.find_spec('torch') is not None))")

    assert found is False


def test_a_worker_command_without_the_worker_extra_names_the_install_in_one_line(
        installed: Installed) -> None:
    done = run_in(installed, installed.bin / "pshard", "worker", "--help")

    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "pshard worker: error: this command needs torch, which is not installed: pip install '.[worker]' "
        "in a clone of pshard"]


def test_a_wheel_built_from_the_sdist_has_the_stubs(installed: Installed, tmp_path: Path) -> None:
    # The sdist carries proto/ (MANIFEST.in) but no generated stub; pip builds a wheel from it as it
    # would from a release on the package index, generating the stubs on the way.
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")],
                           cwd=installed.source, env=_env(), capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S)
    assert sdist.returncode == 0, sdist.stderr
    archive = tmp_path / "sdist" / sdist.stdout.split()[-1]
    built = subprocess.run([str(installed.python), "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--wheel-dir", str(tmp_path / "wheel"), str(archive)], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert built.returncode == 0, built.stdout + built.stderr

    [wheel] = (tmp_path / "wheel").glob("pshard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("parameter_server_pb2", "parameter_server_pb2_grpc", "scheduler_pb2", "tensor_pb2"):
        assert f"pshard/api/v1/{stub}.py" in names, stub
    assert {name.split("/")[0] for name in names} == {"pshard", wheel.name.split("-py3")[0] + ".dist-info"}
