"""One retry policy for every client: gRPC's own for unary calls, one backoff helper for streams.

Unary calls retry inside gRPC, declared once per channel in its service config (as in grpc's
``examples/python/retry``): no hand-written loop, and each call's one deadline bounds all of its
attempts. gRPC caps ``maxAttempts`` at 5, which is enough because callers also pass
``wait_for_ready=True``: an attempt made while the server is down (not started yet, restarting)
waits for it to come up until the deadline instead of failing at once. Only idempotent methods
get the policy; see `SCHEDULER_RETRIED` and `PARAMETER_SERVER_RETRIED`.

A stream cannot be retried by gRPC once a message came back, so the two streaming loops (Exchange,
Watch) keep a loop of their own, pacing it with `Backoff`.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

SCHEDULER_SERVICE = "pshard.api.v1.SchedulerService"
PARAMETER_SERVER_SERVICE = "pshard.api.v1.ParameterServerService"

# Safe to send twice. Register: a second Register of the same node id supersedes the first
# incarnation, and the client only ever uses the reply it got. Leave, Barrier (an arrival is keyed
# by node id), ProposeLayout (the first proposal wins) and GetLayout change nothing when repeated.
# Heartbeat is left out on purpose: its loop sends the next one an interval later anyway, and a
# retried one would only arrive late with stale progress.
SCHEDULER_RETRIED = ("Register", "Leave", "Barrier", "ProposeLayout", "GetLayout")
# PushPull: a server applies a (worker, clock, slice) at most once, so a resent push is dropped;
# GetStats reads; Checkpoint writes the same shard again.
PARAMETER_SERVER_RETRIED = ("PushPull", "GetStats", "Checkpoint")

# gRPC refuses more than 5 attempts (gRFC A6).
MAX_ATTEMPTS = 5
INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
BACKOFF_MULTIPLIER = 2.0
# A call is retried only while its request is still buffered; past gRPC's default 256 KiB the call
# commits and fails on the first error. The unary PushPull carries up to 1 MiB (client/ps_client.py's
# SMALL_PAYLOAD_BYTES); bigger payloads take the Exchange stream.
RETRY_BUFFER_BYTES = 2 * 2**20


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = MAX_ATTEMPTS
    initial_backoff_s: float = INITIAL_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    multiplier: float = BACKOFF_MULTIPLIER

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"max_attempts: got {self.max_attempts}, gRPC accepts 2..{MAX_ATTEMPTS}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoff: got initial {self.initial_backoff_s} s and max "
                             f"{self.max_backoff_s} s, expected 0 < initial <= max")
        if self.multiplier < 1:
            raise ValueError(f"multiplier: got {self.multiplier}, expected >= 1")


DEFAULT_POLICY = RetryPolicy()


def service_config(service: str, methods: Iterable[str], policy: RetryPolicy = DEFAULT_POLICY) -> str:
    """The channel's service-config JSON: `methods` of `service` retry on UNAVAILABLE."""
    return json.dumps({"methodConfig": [{
        "name": [{"service": service, "method": m} for m in methods],
        "retryPolicy": {
            "maxAttempts": policy.max_attempts,
            "initialBackoff": f"{policy.initial_backoff_s}s",
            "maxBackoff": f"{policy.max_backoff_s}s",
            "backoffMultiplier": policy.multiplier,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]})


def retry_options(service: str, methods: Iterable[str],
                  policy: RetryPolicy = DEFAULT_POLICY) -> list[tuple[str, str | int]]:
    """Channel options that switch gRPC's retries on for `methods`; add them to `channel_options()`."""
    return [("grpc.enable_retries", 1),
            ("grpc.service_config", service_config(service, methods, policy)),
            ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES)]


def scheduler_channel_options() -> list[tuple[str, str | int]]:
    return retry_options(SCHEDULER_SERVICE, SCHEDULER_RETRIED)


def parameter_server_channel_options() -> list[tuple[str, str | int]]:
    return retry_options(PARAMETER_SERVER_SERVICE, PARAMETER_SERVER_RETRIED)


class Backoff:
    """Exponential backoff with jitter for the loops gRPC cannot retry (streams).

    `wait()` sleeps the next delay, jittered to 50-150 % so that clients cut off together do not
    come back together; it returns early (True) when `stop` is set. `reset()` after a success.
    """

    def __init__(self, policy: RetryPolicy = DEFAULT_POLICY, stop: threading.Event | None = None,
                 rng: random.Random | None = None) -> None:
        self._policy = policy
        self._stop = stop
        self._rng = rng or random.Random()
        self._delay = policy.initial_backoff_s

    def next_delay(self) -> float:
        """The delay to wait now (jittered); the one after it grows by the multiplier, up to the cap."""
        delay = self._delay * (0.5 + self._rng.random())
        self._delay = min(self._delay * self._policy.multiplier, self._policy.max_backoff_s)
        return delay

    def wait(self, limit_s: float | None = None) -> bool:
        """Sleep the next delay (at most `limit_s`); True when `stop` was set meanwhile."""
        delay = self.next_delay()
        if limit_s is not None:
            delay = max(0.0, min(delay, limit_s))
        if self._stop is not None:
            return self._stop.wait(delay)
        time.sleep(delay)
        return False

    def reset(self) -> None:
        self._delay = self._policy.initial_backoff_s
