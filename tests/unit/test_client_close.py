"""A client closed right after it was made leaves no dying thread behind: grpcio's connectivity poller read
a channel closed under it and died with "Cannot monitor channel state: Channel closed!" on stderr (the
client's `close` now waits for each channel's first connectivity callback, bounded)."""

from __future__ import annotations

import threading
import time

from pshard.client.connections import ServerConnections
from pshard.common.security.credentials import SecurityConfig


def _pollers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "_poll_connectivity" in t.name]


def test_a_client_closed_at_once_kills_no_grpc_poller(monkeypatch):
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(repr(args.exc_value)))
    for _ in range(12):
        # One channel: its close follows its subscription closest. Nothing listens on port 1: the channel
        # stays idle, which is all a poller needs.
        connections = ServerConnections(["127.0.0.1:1"], "worker-0", SecurityConfig(insecure=True),
                                        timeout_s=5.0, transport="grpc", shm_dir="")
        connections.close()
    deadline = time.monotonic() + 10.0
    while _pollers() and time.monotonic() < deadline:  # an unsubscribed poller ends within 0.2 s
        time.sleep(0.02)
    assert not _pollers(), "grpcio's connectivity pollers outlived their closed channels"
    assert died == []
