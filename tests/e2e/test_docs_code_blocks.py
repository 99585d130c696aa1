"""Every ```python block of README.md and docs/ runs as written, and every `pshard` command line in
their shell blocks names a real subcommand and real flags.

Each python block runs in its own process with this test run's interpreter, in an empty directory,
with a deadline: a block that needs a name it never defines, a file it never writes, or a server it
never starts fails here. Shell blocks that start clusters are fragments (tests/doc_blocks.py), so
they are not run; their `pshard ...` lines are still checked against each command's `--help`.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.doc_blocks import SHELL, Block, all_blocks
from tests.e2e.harness import PYTHON, ROOT

pytestmark = pytest.mark.e2e

BLOCK_TIMEOUT_S = 120
BLOCKS = all_blocks()
# Flags that reach another command: `pshard launch` hands what it does not know to every worker, and
# `pshard run` to the command TF_CONFIG's role names.
ALSO_TAKES = {"launch": ("worker",), "run": ("scheduler", "ps", "worker")}
_ENDS_ARGS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1"}


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as pshard worker sets it: torch's spinning starves gRPC
    return env


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "python"], ids=lambda b: b.name)
def test_python_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")

    done = subprocess.run([PYTHON, str(script)], cwd=tmp_path, env=environment(), capture_output=True,
                          text=True, timeout=BLOCK_TIMEOUT_S, check=False)

    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


@functools.cache
def help_text(*command: str) -> str:
    done = subprocess.run([PYTHON, "-m", "pshard", *command, "--help"], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    return done.stdout + done.stderr if done.returncode == 0 else ""


def command_lines(block: Block) -> list[str]:
    """The block's shell commands, continuation lines joined; a console block's `$ ` lines only."""
    text = re.sub(r"\\\n\s*", " ", block.code)
    lines = text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return lines


def pshard_calls(line: str) -> list[tuple[str, list[str]]]:
    """(subcommand, its words up to the end of the command) for each `pshard <subcommand>` in a line."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    calls = []
    for i, word in enumerate(words[:-1]):
        if word == "pshard" or word.endswith("/pshard"):
            rest = words[i + 2:]
            end = next((j for j, w in enumerate(rest) if w in _ENDS_ARGS), len(rest))
            calls.append((words[i + 1], rest[:end]))
    return calls


def flags_of(words: list[str]) -> list[str]:
    """The flags a command line gives pshard itself: up to a script (`train.py`) whose own they are."""
    flags = []
    for word in words:
        if word.endswith(".py"):
            break
        if word.startswith("--") and len(word) > 2 and not word.startswith("--$"):
            flags.append(word.split("=", 1)[0])
    return flags


SHELL_CALLS = [(block, subcommand, words) for block in BLOCKS if block.lang in SHELL
               for line in command_lines(block) for subcommand, words in pshard_calls(line)]


def test_the_docs_show_pshard_command_lines() -> None:
    assert {"launch", "status", "plot", "ps", "worker"} <= {call[1] for call in SHELL_CALLS}


def unknown_flags(subcommand: str, words: list[str]) -> list[str]:
    """The flags of a `pshard <subcommand> <words>` line that no `--help` it reaches lists."""
    helps = [help_text(subcommand)] + [help_text(other) for other in ALSO_TAKES.get(subcommand, ())]
    positional = next((w for w in words if not w.startswith("-")), None)
    if positional is not None and not positional.endswith(".py"):
        helps.append(help_text(subcommand, positional))  # `pshard checkpoint prune --keep-checkpoints`
    return [flag for flag in flags_of(words)
            if not any(re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text) for text in helps)]


@pytest.mark.parametrize(("block", "subcommand", "words"), SHELL_CALLS,
                         ids=[f"{b.name}-{c}" for b, c, _ in SHELL_CALLS])
def test_shell_blocks_name_real_commands_and_flags(block: Block, subcommand: str, words: list[str]) -> None:
    from pshard.cli import COMMANDS

    assert subcommand in COMMANDS, f"{block.name}: 'pshard {subcommand}' is no command ({sorted(COMMANDS)})"
    assert not unknown_flags(subcommand, words), f"{block.name}: 'pshard {subcommand}' has no such flags"


def test_a_flag_no_command_has_is_caught() -> None:
    line = "pshard launch --ps 2 --no-such-flag -- --mode sync --bogus 1 && pshard plot a.jsonl -o x"
    calls = pshard_calls(line)
    assert [c for c, _ in calls] == ["launch", "plot"]
    assert unknown_flags(*calls[0]) == ["--no-such-flag", "--bogus"]
    assert unknown_flags(*calls[1]) == []
    assert unknown_flags("launch", ["--ps", "2", "train.py", "--bogus"]) == []  # the script's own
