"""The fenced code blocks of README.md and docs/**/*.md, as the docs tests read them.

Every block is one of three kinds, decided by its fence and the line right before it:

- ``python``: a ```python block, run as-is by tests/e2e/test_docs_code_blocks.py;
- ``json``: a ```json block, parsed by tests/unit/test_docs_code_blocks.py;
- ``fragment``: any block whose previous line is ``<!-- fragment -->`` or ``<!-- fragment: why -->``,
  shown but not run on purpose (a shell session that starts a cluster, a script meant for
  ``pshard launch``, an excerpt of a file).

Anything else is ``unmarked``, and the unit test fails on it, so no snippet goes untested by accident.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAGMENT = re.compile(r"^<!--\s*fragment(?::\s*(?P<why>.*?))?\s*-->$")
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)[^`]*$")
RUNNABLE = {"python": "python", "py": "python", "json": "json"}
SHELL = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Block:
    path: Path  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    fragment: bool

    @property
    def kind(self) -> str:
        if self.fragment:
            return "fragment"
        return RUNNABLE.get(self.lang, "unmarked")

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks_of(text: str, path: Path) -> list[Block]:
    """Every fenced block of a Markdown text, with its content un-indented as a list item's is."""
    lines = text.split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        before = lines[i - 1].strip() if i > 0 else ""
        found.append(Block(path, i + 1, opening["lang"].lower(), "\n".join(body) + "\n",
                           FRAGMENT.match(before) is not None))
        i = end + 1
    return found


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [block for path in doc_files(root)
            for block in blocks_of(path.read_text(encoding="utf-8"), path.relative_to(root))]
