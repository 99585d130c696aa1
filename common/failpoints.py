"""Failpoints: named places in a real process where a test can hold it, to land a fault exactly there.

A test that must cut a link or kill a peer *between* two steps of a process cannot time that from outside:
the process's log line arrives after it has moved on, and on a loaded machine by hundreds of
milliseconds (a chief's last step and its next call to a server are microseconds apart). At a failpoint that
`PSHARD_FAILPOINTS` names, the thread that reaches it prints `failpoint NAME: paused (pid N)` to stderr and
waits there until the process receives SIGUSR1: the test waits for that line, lands its fault, and
resumes it. Only that thread waits: the process's other threads (heartbeats, say) go on, so a pause
does not look like a death. Nothing is faked: the process runs its own code on both sides of the pause.
Any thread may pause (a server's executor thread replaying a primary's copy, say): the SIGUSR1 handler,
which Python lets only the main thread install, is installed at import when the variable names a
failpoint; a SIGUSR1 resumes every pause in progress.

    PSHARD_FAILPOINTS="worker.before_await_peers=pause"     (comma-separated NAME=ACTION)

`pause` holds every thread that reaches the place; `pause-once` only the first (a backup reaches
`ps.before_replica_apply` with each batch, and a test that resumed the first wants the rest to go on).

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
ACTIONS = ("pause", "pause-once")
# Every failpoint there is, so that a misspelt name fails at start-up instead of never firing.
NAMES = (
    "worker.before_await_peers",  # the chief, after its last step, before it asks the servers for clocks
    "ps.before_replica_apply",  # a backup (a joiner, say) holding a primary's copy, not applied yet
    "ps.before_rows_apply",  # a backup or a move's target holding a primary's table rows, not applied yet
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
_PAUSED: list[threading.Event] = []  # the pauses in progress, resumed together by one SIGUSR1
_HANDLER_INSTALLED = False


def _resume_all(_signum: int, _frame: object) -> None:
    for resumed in list(_PAUSED):
        resumed.set()


if _ACTIVE and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGUSR1, _resume_all)
    _HANDLER_INSTALLED = True


_FIRED: set[str] = set()  # the pause-once failpoints reached already
_FIRED_LOCK = threading.Lock()


def failpoint(name: str) -> None:
    """Pause the calling thread here if `PSHARD_FAILPOINTS` names `name` (see the module docstring)."""
    action = _ACTIVE.get(name)
    if action == "pause" or (action == "pause-once" and _first(name)):
        _pause(name)


def _first(name: str) -> bool:
    with _FIRED_LOCK:
        first = name not in _FIRED
        _FIRED.add(name)
        return first


def _pause(name: str) -> None:
    if not _HANDLER_INSTALLED:
        # Python runs signal handlers on the main thread only, and only it can install one: nothing could
        # resume the pause of a process that imported this module elsewhere.
        raise RuntimeError(f"failpoint {name}: reached on thread {threading.current_thread().name!r}, but "
                           f"{__name__} was imported off the main thread; a pause needs its SIGUSR1 handler")
    resumed = threading.Event()
    _PAUSED.append(resumed)
    try:
        # The handler is in place since the import: a SIGUSR1 sent on seeing the line cannot kill the process.
        print(f"failpoint {name}: paused (pid {os.getpid()}); SIGUSR1 resumes it", file=sys.stderr,
              flush=True)
        while not resumed.wait(0.05):  # short waits: on the main thread, the handler runs between them
            pass
    finally:
        _PAUSED.remove(resumed)
