"""Failpoints: named places in a real process where a test can hold it, to land a fault exactly there.

A test that must cut a link or kill a peer *between* two steps of a process cannot time that from outside:
the process's log line arrives after it has moved on, and on a loaded machine by hundreds of
milliseconds (a chief's last step and its next call to a server are microseconds apart). At a failpoint that
`PSHARD_FAILPOINTS` names, the thread that reaches it prints `failpoint NAME: paused (pid N)` to stderr and
waits there until the process receives SIGUSR1: the test waits for that line, lands its fault, and
resumes it. Only that thread waits: the process's other threads (heartbeats, say) go on, so a pause
does not look like a death. Nothing is faked: the process runs its own code on both sides of the pause.

    PSHARD_FAILPOINTS="worker.before_await_peers=pause"     (comma-separated NAME=ACTION)

The variable is read once, at import. Unset, as everywhere outside tests, a failpoint costs one lookup in an
empty dict; the places are never on a per-step path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from pshard.common.errors import InvalidArgumentError

ENV = "PSHARD_FAILPOINTS"
ACTIONS = ("pause",)
# Every failpoint there is, so that a misspelt name fails at start-up instead of never firing.
NAMES = (
    "worker.before_await_peers",  # the chief, after its last step, before it asks the servers for clocks
)


def parse(text: str) -> dict[str, str]:
    """`NAME=ACTION[,NAME=ACTION...]` to {name: action}; an unknown name or action raises, naming both."""
    points: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, action = item.partition("=")
        if not sep or name not in NAMES or action not in ACTIONS:
            raise InvalidArgumentError(
                f"{ENV}: got {item!r}; expected NAME=ACTION with NAME one of {', '.join(NAMES)} and ACTION "
                f"one of {', '.join(ACTIONS)}")
        points[name] = action
    return points


_ACTIVE = parse(os.environ.get(ENV, ""))


def failpoint(name: str) -> None:
    """Pause the calling thread here if `PSHARD_FAILPOINTS` names `name` (see the module docstring)."""
    if _ACTIVE.get(name) == "pause":
        _pause(name)


def _pause(name: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        # Python runs signal handlers on the main thread only: elsewhere nothing could resume the pause.
        raise RuntimeError(f"failpoint {name}: reached on thread {threading.current_thread().name!r}; "
                           f"a pause needs the main thread")
    resumed = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda _signum, _frame: resumed.set())
    try:
        # Printed once the handler is in place: a SIGUSR1 sent on seeing the line cannot kill the process.
        print(f"failpoint {name}: paused (pid {os.getpid()}); SIGUSR1 resumes it", file=sys.stderr,
              flush=True)
        while not resumed.wait(0.05):  # short waits: the handler runs between them
            pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
