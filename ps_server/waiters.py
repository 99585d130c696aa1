"""Wake asyncio waiters when the store changes, without a thread per waiter.

The store calls `notify()` after every change (from the event loop or an executor
thread). Each waiter re-checks its own condition; a waiting pull costs a suspended
coroutine, never a worker thread, so any number of pulls can wait for the pushes
that will release them (DESIGN §5: no thread-starvation deadlock).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ChangeSignal:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self.waiting = 0

    def notify(self) -> None:
        """Thread-safe: may be called from any thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._fire()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait_for(self, check: Callable[[], T | None], deadline: float) -> T | None:
        """Return check()'s first non-None result, or None at `deadline` (time.monotonic())."""
        self.waiting += 1
        try:
            while True:
                # Take the event before checking, so a change between the check and the wait wakes us.
                event = self._event
                result = check()
                if result is not None:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            self.waiting -= 1
