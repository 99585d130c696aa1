"""Fork safety: `DataLoader(num_workers=N)` forks the training process while PSTrainer's gRPC
channels, fast paths and threads are alive (docs/architecture.md, 14 PyTorch idioms).

What made the loader's children die with SIGSEGV was gRPC's own fork support: grpcio enables its
core's pthread_atfork handlers, which skip their quiescing whenever another thread is inside gRPC
(always, once channels exist: "Other threads are currently calling into gRPC, skipping fork()
handlers") and still start gRPC's poller and executor threads again in the child, on the parent's
half-copied state. pshard therefore turns that support off by default (`pshard/__init__.py` sets
GRPC_ENABLE_FORK_SUPPORT=0 unless the user set it, before anything imports grpc), so a child runs no
gRPC code at all, and here makes sure it never will:

- right after a fork, the child freezes the objects it inherited out of the cyclic garbage
  collector (`gc.freeze`), so it never finalises the parent's channels, calls or sockets;
- a PSClient remembers the process that made it: used from another one it raises
  ForkedClientError, and closing it there drops nothing the parent still uses.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

from pshard.common.errors import ForkedClientError

log = logging.getLogger("pshard.fork")

FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
_FALSE = ("0", "false", "no", "off")


# This process's id, kept by the fork hook below: os.getpid() is a system call, and every push+pull asks
# whether its client is still in the process that made it (issue 18's latency drift).
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    # Objects that existed at the fork (the parent's gRPC calls, channels, fast-path sockets among
    # them) are never collected here: finalising one runs gRPC code on locks the parent's threads held.
    gc.freeze()


os.register_at_fork(after_in_child=_after_fork_in_child)


def grpc_fork_handlers_on() -> bool:
    """Whether gRPC's core runs its fork handlers in this process (the setting it read at import)."""
    return os.environ.get(FORK_SUPPORT_ENV, "1").strip().lower() not in _FALSE


def warn_if_fork_unsafe() -> None:
    """Say how to fix a process where gRPC was imported with its fork handlers on (grpc imported
    before pshard, or GRPC_ENABLE_FORK_SUPPORT=1 set by hand): DataLoader workers may then crash."""
    if "grpc" in sys.modules and grpc_fork_handlers_on():
        log.warning("gRPC's fork handlers are on (%s=%s): forked DataLoader workers may crash with "
                    "SIGSEGV; import pshard before grpc (or anything that imports it), or set %s=0",
                    FORK_SUPPORT_ENV, os.environ.get(FORK_SUPPORT_ENV, "unset"), FORK_SUPPORT_ENV)


class ProcessOwned:
    """Remembers the process that made an object holding channels and threads."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._pid = _pid

    @property
    def here(self) -> bool:
        """Whether this is the process that made it."""
        return _pid == self._pid

    def check(self) -> None:
        if _pid != self._pid:
            raise ForkedClientError(
                f"{self._what}: made in process {self._pid}, used in process {os.getpid()} forked from it "
                f"(a DataLoader worker?); its channels belong to the parent: make a new one in this process")
