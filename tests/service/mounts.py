"""Small file systems for tests of a full or read-only disk: a tmpfs mounted for the test (root only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, *, size: str = "64k", read_only: bool = False) -> Iterator[Path]:
    """A fresh tmpfs of `size` at `where` for the duration; skips the test where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a full or read-only disk) needs root")
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def remount_read_only(where: Path) -> None:
    """Make a tmpfs mounted by `tmpfs` read-only, keeping its files."""
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True, timeout=30)
