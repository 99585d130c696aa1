"""``python -m pshard.launcher``: see `pshard.launcher.cli`."""

from __future__ import annotations

import signal
import sys
from types import FrameType


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    # Until the supervisor takes signals over (before any child starts), a stop is quiet and at
    # once, with the status the supervisor gives it later: 128 + the signal.
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _exit_at_once)

from pshard.launcher.cli import main  # noqa: E402 - after the handlers, which must come first

if __name__ == "__main__":
    sys.exit(main())
