"""Dependencies point one way (docs/architecture.md §1), checked on the source with `ast`, nothing imported.

- The parameter server and the worker never import the scheduler service at module level; the one
  exception is the worker's in-process scheduler hosting, which imports it inside the function
  that starts it, and only then. The parameter server does not import it at all.
- The shared layer (common/, `pshard.common`) imports no service: not the parameter server,
  the worker, the scheduler or the launcher.
- The parameter server imports no torch: its image holds none.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folder -> import package (pyproject.toml's package-dir).
PACKAGES = {"common": "pshard.common", "ps_server": "pshard.ps_server", "worker": "pshard.worker",
            "scheduler": "pshard.scheduler", "launcher": "pshard.launcher"}
SERVICES = ("pshard.ps_server", "pshard.worker", "pshard.scheduler", "pshard.launcher")


@dataclass(frozen=True)
class Import:
    module: str  # absolute, e.g. "pshard.scheduler.service"
    line: int
    in_function: bool  # inside a def: runs only when the function does


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports(source: str, package: str) -> Iterator[Import]:
    """Every module that `source` (a module of `package`) imports, with where it does so."""
    tree = ast.parse(source)
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        inside = id(node) in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno, inside)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield Import(module, node.lineno, inside)
            # `from pshard import scheduler` imports the package pshard.scheduler.
            for alias in node.names:
                yield Import(f"{module}.{alias.name}", node.lineno, inside)
        elif isinstance(node, ast.Call) and _imported_by_name(node) is not None:
            yield Import(str(_imported_by_name(node)), node.lineno, inside)


def _imported_by_name(call: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x")`` / ``import_module("x")``, else None."""
    name = getattr(call.func, "attr", getattr(call.func, "id", ""))
    if name == "import_module" and call.args and isinstance(call.args[0], ast.Constant):
        value = call.args[0].value
        return value if isinstance(value, str) else None
    return None


def modules(folder: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / folder).rglob("*.py"))


def violations(folder: str, forbidden: tuple[str, ...], *, allow_in_function: bool = False,
               root: Path = ROOT) -> list[str]:
    """One line per offending import statement: ``path:line imports module where``."""
    found: dict[tuple[Path, int], str] = {}
    for path in modules(folder, root):
        for imp in imports(path.read_text(encoding="utf-8"), PACKAGES[folder]):
            bad = any(_within(imp.module, f) for f in forbidden)
            if bad and not (allow_in_function and imp.in_function):
                where = "inside a function" if imp.in_function else "at module level"
                found.setdefault((path, imp.line), f"{path.relative_to(root)}:{imp.line} imports "
                                                   f"{imp.module} {where}")
    return list(found.values())


def test_every_checked_folder_has_modules():
    for folder in ("common", "ps_server", "worker"):
        assert len(modules(folder)) >= 3, folder


def test_the_parameter_server_never_imports_the_scheduler_service():
    assert violations("ps_server", ("pshard.scheduler",)) == []


def test_the_worker_imports_the_scheduler_service_only_inside_the_function_that_hosts_it():
    assert violations("worker", ("pshard.scheduler",), allow_in_function=True) == []


def test_the_shared_layer_imports_no_service():
    assert violations("common", SERVICES) == []


def test_the_parameter_server_imports_no_torch():
    assert violations("ps_server", ("torch",)) == []


# ---- the checker itself can fail ----

@pytest.mark.parametrize(("source", "package", "module", "in_function"), [
    ("import pshard.scheduler.service\n", "pshard.worker", "pshard.scheduler.service", False),
    ("from pshard.scheduler.membership import Membership\n", "pshard.ps_server",
     "pshard.scheduler.membership", False),
    ("from pshard import scheduler\n", "pshard.common", "pshard.scheduler", False),
    ("from ..scheduler import servicer\n", "pshard.common", "pshard.scheduler.servicer", False),
    ("from . import codec\n", "pshard.common", "pshard.common.wire.codec", False),
    ("def host():\n    from pshard.scheduler.service import start\n", "pshard.worker",
     "pshard.scheduler.service", True),
    ("class A:\n    def f(self):\n        import torch\n", "pshard.ps_server", "torch", True),
    ("import importlib\nimportlib.import_module('pshard.launcher.launch')\n", "pshard.common",
     "pshard.launcher.launch", False),
    ("try:\n    import torch\nexcept ImportError:\n    torch = None\n", "pshard.ps_server", "torch", False),
])
def test_imports_are_found_wherever_and_however_they_are_written(source, package, module, in_function):
    found = [(i.module, i.in_function) for i in imports(source, package)]

    assert (module, in_function) in found


def test_a_module_level_scheduler_import_in_the_worker_is_a_violation(tmp_path):
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "train.py").write_text("from pshard.scheduler.service import start\n")
    (tmp_path / "worker" / "host.py").write_text("def host():\n    from pshard.scheduler import service\n")

    assert violations("worker", ("pshard.scheduler",), allow_in_function=True, root=tmp_path) == [
        "worker/train.py:1 imports pshard.scheduler.service at module level"]
    assert len(violations("worker", ("pshard.scheduler",), root=tmp_path)) == 2
