"""One owner per checkpoint directory: a lock held for the life of the process that writes there.

Two jobs writing one checkpoint directory delete each other's temporary files and overwrite each
other's shards, and both exit 0 (docs/architecture.md, 9 Failures). So a launcher takes its
`--checkpoint-dir` (its servers use a sub-directory each, which they lock for themselves) and a
parameter server takes its own; whoever comes second is refused at start, told who holds it.

The lock is `flock(2)` on `<dir>/<name>`: the kernel drops it when the holder dies, however it dies,
so a crashed job leaves nothing to clean up (the next one takes it at once). The file also holds
what the holder says about itself (job, host, pid, since when), for the refusal's message only: it
proves nothing, the flock does. flock is per host on most network file systems; jobs on different
hosts that share a directory need directories of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from pshard.common.errors import ClusterConfigError


class DirectoryInUseError(ClusterConfigError):
    """Another live process holds the directory's lock; the message names it."""


class DirectoryLock:
    """A held lock; `release()` it (or let the process end)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str], owner: Mapping[str, object], *,
                name: str = ".pshard.lock", flag: str = "--checkpoint-dir") -> DirectoryLock:
        """Lock `directory` for `owner` (what the refusal of another process will show: job id, role...).

        Raises DirectoryInUseError naming the holder; OSError when the directory cannot be written."""
        path = Path(directory) / name
        # The lock is held on a read-only descriptor, and the record written through one that is closed
        # at once: a file held open for writing keeps its file system from being remounted read-only
        # (EBUSY) for the whole life of the server, which tests of a read-only checkpoint disk, and an
        # operator, need to do.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise DirectoryInUseError(
                f"{flag}: {str(directory)!r} is in use by {holder}; two jobs in one directory delete each "
                "other's checkpoints. Stop that one, or give this one another directory") from None
        except BaseException:
            os.close(fd)
            raise
        record = {**owner, "host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time())}
        try:
            _write(path, (json.dumps(record, sort_keys=True) + "\n").encode())
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                _write(self.path, b"")
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _write(path: Path, data: bytes) -> None:
    """Replace the lock file's record in place (its inode is the one locked), closing at once."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read(fd: int) -> dict[str, object]:
    try:
        raw = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _describe(holder: Mapping[str, object]) -> str:
    """'job launch-1a2b (ps-0, pid 4242 on host-a, since 2026-11-27 15:04:05 UTC)', or what is known."""
    if not holder:
        return "another process (it has not said which yet)"
    who = f"job {holder['job_id']}" if holder.get("job_id") else "another process"
    details = [str(holder["role"])] if holder.get("role") else []
    if holder.get("pid"):
        details.append(f"pid {holder['pid']} on {holder.get('host', '?')}")
    since = holder.get("since")
    if isinstance(since, int):
        details.append("since " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)))
    return f"{who} ({', '.join(details)})" if details else who
