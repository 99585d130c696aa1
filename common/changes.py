"""Wake asyncio waiters when shared state changes, without a thread per waiter.

The owner of some state calls `notify()` after every change (from its event loop or from any
other thread). Each waiter re-checks its own condition: a waiting pull, barrier or Watch stream
costs a suspended coroutine, never a worker thread, so any number of them cannot starve the
pushes, heartbeats and registrations they wait for (docs/architecture.md, 5 Consistency).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ChangeSignal:
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: the loop the waiters run on (default: the running one)."""
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._event = asyncio.Event()
        self.waiting = 0  # coroutines inside wait_for now

    def notify(self) -> None:
        """Wake every waiter. Thread-safe: may be called from any thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._fire()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        if not self.waiting:  # nobody holds the event (most pushes): nothing to wake, nothing to replace
            return
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait_for(self, check: Callable[[], T | None], deadline: float | None = None) -> T | None:
        """Return check()'s first non-None result, or None at `deadline` (time.monotonic(); None = never)."""
        self.waiting += 1
        try:
            while True:
                # Take the event before checking, so a change between the check and the wait wakes us.
                event = self._event
                result = check()
                if result is not None:
                    return result
                if deadline is None:
                    await event.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            self.waiting -= 1
