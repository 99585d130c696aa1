"""The client library's objects meet through public members only: PSClient and the tables client share one
ServerConnections (client/connections.py) instead of one reaching into the other's private state."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def private_reaches(source: str) -> list[str]:
    """Reads of another object's `_member` (not `self`'s or `cls`'s own, nor a dunder)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_client_module_reaches_into_another_objects_private_members():
    modules = sorted((ROOT / "client").glob("*.py"))
    reaches = {path.name: private_reaches(path.read_text()) for path in modules}
    assert {name: found for name, found in reaches.items() if found} == {}


def test_a_planted_reach_is_found():
    source = "class T:\n    def f(self):\n        return self._client._timeout_s, self._own, obj.__class__\n"
    assert private_reaches(source) == ["line 3: self._client._timeout_s"]
