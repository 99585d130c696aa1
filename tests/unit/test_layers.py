"""The layer rules of docs/architecture.md §1, one line each, on the import graph computed from the source.

The folder `X/` is the package `pshard.X` (one rule, no map): a module's import name is its path. Imports
under `if TYPE_CHECKING:` are left out (they never run); imports inside a function are edges too, except
where a rule says otherwise. Every rule is a function of the graph, so a planted violation fails it
(test_each_rule_fails_on_a_planted_violation).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("common", "client", "ps_server", "worker", "scheduler", "launcher", "coordinator", "pshard")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, e.g. pshard.ps_server.core.store
    dst: str  # imported module or package, e.g. grpc, pshard.common.wire.codec
    where: str  # path:line
    in_function: bool


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts[0] == "pshard" else ".".join(["pshard", *parts])


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skip


def edges_of(source: str, module: str, where: str, *, is_package: bool = False) -> Iterator[Edge]:
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        inside = id(node) in in_function
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, at, inside)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield Edge(module, target, at, inside)
            for alias in node.names:  # `from pshard.x import y` may import the module pshard.x.y
                yield Edge(module, f"{target}.{alias.name}", at, inside)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            yield Edge(module, str(node.args[0].value), at, inside)


def graph(root: Path = ROOT) -> list[Edge]:
    out: list[Edge] = []
    for top in TOP:
        for path in sorted((root / top).rglob("*.py")):
            if "api" in path.relative_to(root).parts[:2] and top == "pshard":
                continue  # generated stubs
            out.extend(edges_of(path.read_text(), module_name(path, root), str(path.relative_to(root)),
                                is_package=path.name == "__init__.py"))
    return out


def modules(root: Path = ROOT) -> set[str]:
    return {module_name(p, root) for top in TOP for p in (root / top).rglob("*.py")}


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def resolve(dst: str, known: set[str]) -> str | None:
    """The pshard module an edge lands on (`from pshard.x import Name` lands on pshard.x)."""
    while dst and dst not in known:
        dst = dst.rpartition(".")[0]
    return dst or None


def cycles(edges: Iterable[Edge], known: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module, over module-level imports."""
    adj: dict[str, set[str]] = {m: set() for m in known}
    for e in edges:
        target = resolve(e.dst, known)
        # A package's __init__ is imported on the way to any of its modules: that edge is no dependency.
        if not e.in_function and target and target != e.src and not within(e.src, target):
            adj[e.src].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            strong(v)
    return found


# (rule, importers, forbidden imports, imports inside functions count too)
RULES: list[tuple[str, tuple[str, ...], tuple[str, ...], bool]] = [
    ("cores and tables import no grpc, protobuf or generated code",
     ("pshard.ps_server.core", "pshard.ps_server.tables"), ("grpc", "google.protobuf", "pshard.api"), True),
    ("handlers import no grpc", ("pshard.ps_server.handlers",), ("grpc",), True),
    ("replication never imports handlers", ("pshard.ps_server.replication",),
     ("pshard.ps_server.handlers",), True),
    # The handlers call replication through ps_server/replication/api.py (and hold a backup's copies in
    # its ReplicaSet); how batches travel is for the wiring (follower.py) to choose.
    ("handlers import no replication backend, link or wiring", ("pshard.ps_server.handlers",),
     ("pshard.ps_server.replication.backends", "pshard.ps_server.replication.link",
      "pshard.ps_server.replication.tables", "pshard.ps_server.replication.in_sync",
      "pshard.ps_server.transport", "pshard.ps_server.follower"), True),
    ("common imports no service and no CLI", ("pshard.common",),
     ("pshard.ps_server", "pshard.worker", "pshard.scheduler", "pshard.launcher", "pshard.client",
      "pshard.cli", "pshard.certs", "pshard.status", "pshard.plot", "pshard.evaluate",
      "pshard.checkpoint_cli", "pshard.admin", "pshard.drain_cli", "pshard.rebalance_cli"),
     True),
    ("client imports no torch, no server and no scheduler service", ("pshard.client",),
     ("torch", "pshard.ps_server", "pshard.scheduler", "pshard.worker", "pshard.launcher"), True),
    ("the parameter server imports no torch", ("pshard.ps_server",), ("torch",), True),
    ("the parameter server never imports the scheduler service or the worker", ("pshard.ps_server",),
     ("pshard.scheduler", "pshard.worker", "pshard.launcher"), True),
    # The one exception: a chief hosting the scheduler in-process imports it inside the function that starts
    # it.
    ("the worker imports the scheduler service only inside a function", ("pshard.worker",),
     ("pshard.scheduler",), False),
    # The coordinator is the chief's library: it uses the worker's session and the client, never a service.
    ("the coordinator imports no server, scheduler service, launcher or torch", ("pshard.coordinator",),
     ("pshard.ps_server", "pshard.scheduler", "pshard.launcher", "torch"), False),
    ("only the coordinator and the worker import the coordinator",
     ("pshard.common", "pshard.client", "pshard.ps_server", "pshard.scheduler", "pshard.launcher"),
     ("pshard.coordinator",), True),
    ("the scheduler imports no other service", ("pshard.scheduler",),
     ("pshard.ps_server", "pshard.worker", "pshard.launcher", "torch"), True),
]


def broken(rule: tuple[str, tuple[str, ...], tuple[str, ...], bool], edges: Iterable[Edge]) -> list[str]:
    _, importers, forbidden, count_functions = rule
    return [f"{e.where} ({e.src}) imports {e.dst}" for e in edges
            if within(e.src, *importers) and within(e.dst, *forbidden)
            and (count_functions or not e.in_function)]


EDGES = graph()
KNOWN = modules()


def test_no_import_cycle_anywhere():
    assert cycles(EDGES, KNOWN) == []


@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_layer_rule(rule):
    assert broken(rule, EDGES) == []


def test_every_folder_is_its_import_name():
    # No package-dir map beyond "folder X/ is pshard.X" (pyproject.toml): each package the build installs
    # is a folder of the same dotted path.
    text = (ROOT / "pyproject.toml").read_text()
    for top in TOP[:-1]:
        assert f'"pshard.{top}" = "{top}"' in text


def _plant(tmp_path: Path, files: dict[str, str]) -> tuple[list[Edge], set[str]]:
    for top in TOP:
        (tmp_path / top).mkdir(exist_ok=True)
    for rel, source in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return graph(tmp_path), modules(tmp_path)


@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_each_rule_fails_on_a_planted_violation(tmp_path, rule):
    _, importers, forbidden, count_functions = rule
    importer = importers[0].removeprefix("pshard.").replace(".", "/")
    body = f"import {forbidden[0]}\n" if count_functions else f"def f():\n    pass\nimport {forbidden[0]}\n"
    edges, _ = _plant(tmp_path, {f"{importer}/planted.py": body})
    assert broken(rule, edges), rule[0]


def test_a_planted_cycle_is_found(tmp_path):
    edges, known = _plant(tmp_path, {"common/a.py": "from pshard.common import b\n",
                                     "common/b.py": "from pshard.common.a import X\n"})
    assert cycles(edges, known) == [["pshard.common.a", "pshard.common.b"]]


def test_type_checking_imports_and_package_inits_are_no_edges(tmp_path):
    edges, known = _plant(tmp_path, {
        "common/__init__.py": "from pshard.common import a\n",
        "common/a.py": ("from typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from pshard.common import b\n"),
        "common/b.py": "from pshard.common.a import X\n"})
    assert cycles(edges, known) == []


# ---- the edge finder sees imports wherever and however they are written ----

@pytest.mark.parametrize(("source", "module", "dst", "in_function"), [
    ("import pshard.scheduler.service\n", "pshard.worker.train", "pshard.scheduler.service", False),
    ("from pshard.scheduler.membership import Membership\n", "pshard.ps_server.service",
     "pshard.scheduler.membership", False),
    ("from pshard import scheduler\n", "pshard.common.x", "pshard.scheduler", False),
    ("from ..scheduler import servicer\n", "pshard.common.x", "pshard.scheduler.servicer", False),
    ("from . import codec\n", "pshard.common.wire.x", "pshard.common.wire.codec", False),
    ("def host():\n    from pshard.scheduler.service import start\n", "pshard.worker.train",
     "pshard.scheduler.service", True),
    ("class A:\n    def f(self):\n        import torch\n", "pshard.ps_server.x", "torch", True),
    ("import importlib\nimportlib.import_module('pshard.launcher.launch')\n", "pshard.common.x",
     "pshard.launcher.launch", False),
    ("try:\n    import torch\nexcept ImportError:\n    torch = None\n", "pshard.ps_server.x", "torch", False),
])
def test_imports_are_found_wherever_and_however_they_are_written(source, module, dst, in_function):
    found = [(e.dst, e.in_function) for e in edges_of(source, module, "x.py")]

    assert (dst, in_function) in found
