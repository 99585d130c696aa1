"""Every code block of README.md and docs/ is run, parsed, or marked a fragment on purpose.

The python blocks run in tests/e2e/test_docs_code_blocks.py (each in its own process); here, the
cheap checks: that every block has a kind, and that every json block parses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, all_blocks, blocks_of

BLOCKS = all_blocks()


def test_the_docs_have_blocks_of_every_kind() -> None:
    kinds = {block.kind for block in BLOCKS}
    assert {"python", "json", "fragment"} <= kinds, kinds
    assert any(block.path == Path("README.md") for block in BLOCKS)


def test_every_block_is_python_json_or_a_fragment_on_purpose() -> None:
    unmarked = [f"{b.name} (```{b.lang or 'no language'})" for b in BLOCKS if b.kind == "unmarked"]
    assert not unmarked, ("blocks that no test runs: make them ```python that runs as-is, or put "
                          "'<!-- fragment: why -->' on the line before the fence:\n" + "\n".join(unmarked))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "json"], ids=lambda b: b.name)
def test_json_blocks_parse(block) -> None:
    json.loads(block.code)


def test_blocks_are_read_with_their_marker_language_and_indentation(tmp_path: Path) -> None:
    page = "\n".join([
        "# A page", "", "```python", "print(1)", "```", "",
        "<!-- fragment: starts a cluster -->", "```bash", "pshard launch", "```",
        "- a list item:", "", "  ```json", '  {"a": 1}', "  ```",
        "<!-- fragment -->", "````console", "$ cat x.md", "```", "````", "~~~", "plain", "~~~", ""])

    blocks = blocks_of(page, Path("page.md"))

    assert [(b.line, b.lang, b.kind, b.code) for b in blocks] == [
        (3, "python", "python", "print(1)\n"),
        (8, "bash", "fragment", "pshard launch\n"),
        (13, "json", "json", '{"a": 1}\n'),
        (17, "console", "fragment", "$ cat x.md\n```\n"),
        (21, "", "unmarked", "plain\n"),
    ]


def test_the_readme_and_every_docs_page_are_read() -> None:
    read = {b.path for b in BLOCKS}
    assert Path("README.md") in read
    assert Path("docs/guide/tf-config.md") in read, sorted(read)
    assert (ROOT / "docs" / "architecture.md").is_file()
