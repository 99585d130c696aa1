"""Small file systems for tests of a full or read-only disk: a tmpfs mounted for the test (root only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import wait_until


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


def remount_read_only(where: Path, timeout_s: float = 30.0) -> None:
    """Make a tmpfs mounted by `tmpfs` read-only, keeping its files.

    The kernel refuses (EBUSY) while a process holds a file there open for writing, as a server's
    periodic checkpoint does for a moment every interval: the remount is tried until it is taken, and a
    refusal that lasts `timeout_s` fails with mount's own words."""
    said: list[str] = []

    def remounted() -> bool:
        done = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True,
                              timeout=30)
        said[:] = [done.stderr.strip()]
        return done.returncode == 0

    try:
        wait_until(remounted, timeout_s, f"{where} remounted read-only")
    except AssertionError as err:
        raise AssertionError(f"{err}; mount said: {said[0] if said else ''}") from None
