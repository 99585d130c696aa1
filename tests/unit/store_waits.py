"""Blocking pulls for tests that drive a ShardStore from threads (servers wait in coroutines)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
from pshard.common.errors import PullTimeoutError
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.store import ShardStore


class _Changes:
    """Counts the store's change notifications, so a waiter never sleeps through one."""

    def __init__(self, store: ShardStore) -> None:
        self.condition = threading.Condition()
        self.count = 0
        store.subscribe(self._bump)

    def _bump(self) -> None:
        with self.condition:
            self.count += 1
            self.condition.notify_all()


_changes: weakref.WeakKeyDictionary[ShardStore, _Changes] = weakref.WeakKeyDictionary()
_changes_lock = threading.Lock()


def wait_pull(store: ShardStore, stamp: Stamp, keys: Sequence[SliceKey],
              timeout_s: float) -> list[tuple[np.ndarray, int]]:
    """Block this thread until the pull is ready, then read; PullTimeoutError naming what it waited for."""
    with _changes_lock:
        changes = _changes.get(store) or _changes.setdefault(store, _Changes(store))
    deadline = time.monotonic() + timeout_s
    while True:
        with changes.condition:
            seen = changes.count
        waiting = store.pull_status(stamp, keys)
        if waiting is None:
            return store.read(keys)
        with changes.condition:
            while changes.count == seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PullTimeoutError(
                        f"pull by worker {stamp.worker_id!r} at clock {stamp.clock} timed out "
                        f"after {timeout_s:g} s: {waiting}")
                changes.condition.wait(remaining)
