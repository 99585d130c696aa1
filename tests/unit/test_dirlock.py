"""One owner per checkpoint directory: a second lock is refused naming the holder; a dead holder's expires."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pshard.common.dirlock import DirectoryInUseError, DirectoryLock

HOLDER = """
import sys, time
from pshard.common.dirlock import DirectoryLock
DirectoryLock.acquire(sys.argv[1], {"job_id": "job-a", "role": "launcher"})
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_owner_is_refused_naming_the_first_until_it_releases(tmp_path: Path) -> None:
    first = DirectoryLock.acquire(tmp_path, {"job_id": "job-a", "role": "ps-0"})
    with pytest.raises(DirectoryInUseError, match=rf"--checkpoint-dir: '{tmp_path}' is in use by job job-a "
                                                  rf"\(ps-0, pid {os.getpid()} on [^,]+, since "):
        DirectoryLock.acquire(tmp_path, {"job_id": "job-b"})
    first.release()
    DirectoryLock.acquire(tmp_path, {"job_id": "job-b"}).release()


def test_the_lock_of_a_killed_holder_expires_with_it(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUseError, match=rf"job job-a \(launcher, pid {holder.pid} on "):
            DirectoryLock.acquire(tmp_path, {"job_id": "job-b"})
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    DirectoryLock.acquire(tmp_path, {"job_id": "job-b"}).release()  # nothing to clean up by hand
