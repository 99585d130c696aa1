"""Run an asyncio gRPC service in a daemon thread with its own event loop.

Tests, benchmarks and a chief that hosts the scheduler in-process all need a server beside
their own (blocking) code. Any service whose `start()` coroutine returns an object with a
`port` and an async `stop(grace_s)` can run this way.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Running(Protocol):
    """What a service's start() returns: where it listens, and how to stop it."""

    @property
    def port(self) -> int: ...

    async def stop(self, grace_s: float) -> None: ...


S = TypeVar("S", bound=Running)


@dataclass
class ServerThread(Generic[S]):
    """A started service (`running`) on `loop`, which runs in `thread`."""

    running: S
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    grace_s: float
    _stop: asyncio.Event

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Run `fn` on the service's loop (its state belongs to that loop) and return its result."""
        async def run() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=timeout_s)

    def stop(self, grace_s: float | None = None, timeout_s: float = 10.0) -> None:
        """Stop gracefully (`grace_s`, default the one given at start) and wait for the thread."""
        if not self.thread.is_alive():
            return
        if grace_s is not None:
            self.grace_s = grace_s  # read by the loop after _stop is set: the set orders the two
        self.loop.call_soon_threadsafe(self._stop.set)
        waited_s = self.grace_s + timeout_s
        self.thread.join(waited_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{self.thread.name}: still running {waited_s:g} s after stop()")


def start_in_thread(start: Callable[[], Awaitable[S]], *, name: str, grace_s: float = 1.0,
                    start_timeout_s: float = 30.0) -> ServerThread[S]:
    """Run `start()` on a new loop in a daemon thread; return once it is serving.

    A start-up failure (a port in use, say) is raised here, in the caller's thread.
    """
    ready = threading.Event()
    outcome: dict[str, object] = {}

    async def main() -> None:
        stop = asyncio.Event()
        try:
            running = await start()
        except BaseException as err:
            outcome["error"] = err
            ready.set()
            return
        handle = ServerThread(running, asyncio.get_running_loop(), threading.current_thread(), grace_s, stop)
        outcome["handle"] = handle
        ready.set()
        try:
            await stop.wait()
        finally:
            await running.stop(handle.grace_s)

    thread = threading.Thread(target=lambda: asyncio.run(main()), name=name, daemon=True)
    thread.start()
    if not ready.wait(start_timeout_s):
        raise TimeoutError(f"{name}: not serving within {start_timeout_s:g} s")
    error = outcome.get("error")
    if isinstance(error, BaseException):
        raise error
    handle = outcome["handle"]
    assert isinstance(handle, ServerThread)
    return handle
