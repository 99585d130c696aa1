"""Ending a service when its job is over (``--exit-when-done``), so a finished job leaves no
processes behind under compose or a Kubernetes Job.

The job is over when some trainer has joined and every trainer has left on purpose (a dead one
may be restarted, so it does not end the job), and then nothing has been asked of this service
for a quiet period: the chief leaves the quorum before its final pull and evaluation, and an
evaluator takes a last look, so the servers must outlive the last Leave by a little. `JobEnd` is
the pure decision; `watch_job_end` polls it on the service's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Mapping

from pshard.common.cluster.view import TRAINER_ROLES, ClusterView, NodeState

EXIT_WHEN_DONE_ENV = "PSHARD_EXIT_WHEN_DONE"
DEFAULT_QUIET_S = 15.0
_POLL_S = 0.5


def training_finished(view: ClusterView | None) -> bool:
    """Some trainer joined, and every one has left on purpose (none live, none dead)."""
    if view is None:
        return False
    trainers = [n for n in view.nodes if n.role in TRAINER_ROLES]
    return bool(trainers) and all(n.state is NodeState.LEFT for n in trainers)


class JobEnd:
    """Decides when to stop: `quiet_s` after both the training finished and the last request."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._activity: int | None = None
        self._since: float | None = None  # when the finished state, with this activity count, began

    def observe(self, finished: bool, activity: int, now: float) -> bool:
        """True once it is time to stop. `activity`: a count that grows with every request served."""
        if not finished:
            self._since = None
            return False
        if self._since is None or activity != self._activity:
            self._activity, self._since = activity, now
        return now - self._since >= self.quiet_s


async def watch_job_end(view: Callable[[], ClusterView | None], activity: Callable[[], int],
                        quiet_s: float) -> None:
    """Returns when the job is over (see the module docstring); runs on the service's loop."""
    loop = asyncio.get_running_loop()
    decision = JobEnd(quiet_s)
    while not decision.observe(training_finished(view()), activity(), loop.time()):
        await asyncio.sleep(_POLL_S)


def quiet_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected seconds >= 0")
    return value


def add_exit_argument(parser: argparse._ActionsContainer, environ: Mapping[str, str] | None = None) -> None:
    """--exit-when-done [QUIET_S], defaulting to $PSHARD_EXIT_WHEN_DONE (seconds, or 1 for the default)."""
    env = (os.environ if environ is None else environ).get(EXIT_WHEN_DONE_ENV, "").strip().lower()
    default = None
    if env in ("1", "true", "yes", "on"):
        default = DEFAULT_QUIET_S
    elif env and env not in ("0", "false", "no", "off"):
        default = quiet_seconds(env)
    parser.add_argument(
        "--exit-when-done", metavar="QUIET_S", type=quiet_seconds, nargs="?", const=DEFAULT_QUIET_S,
        default=default,
        help="exit 0 once every worker has left the job and no request came for QUIET_S seconds "
             f"(default {DEFAULT_QUIET_S:g}; without the flag: ${EXIT_WHEN_DONE_ENV}, else keep serving)")
