"""How a fast-path TCP socket notices a peer that went silent (its host cut off, not its process killed).

A killed peer's kernel resets the connection, and the fast path breaks at once. A host that is cut
off answers nothing: without help a call in flight waits for its whole deadline (the step timeout,
minutes), while the scheduler fails the server over within its heartbeat timeout. gRPC's channels
ping for this; the raw TCP path, the shared-memory doorbell's peer and the replication link use the
kernel's equivalents (docs/architecture.md, 11 Transports):

* keepalive probes (SO_KEEPALIVE, TCP_KEEPIDLE/INTVL/CNT) while the socket waits for a reply with
  everything it sent acknowledged (a sync pull held for the slowest worker);
* TCP_USER_TIMEOUT while data it sent is unacknowledged (a request or reply being written), which
  also caps the probes: the connection fails with ETIMEDOUT once nothing came back for that long.

Both are derived from one figure, `dead_after_s`: the job's heartbeat timeout, so a cut-off peer is
noticed about when the scheduler declares it dead (at most twice that, the bar of issue 24).

Pure but for `keep_alive`, which sets the options on a socket.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from pshard.common.errors import InvalidArgumentError

# The scheduler's default heartbeat timeout (scheduler.settings.DEFAULT_HEARTBEAT_TIMEOUT_S), for
# sockets opened before the job's figure is known.
DEFAULT_DEAD_AFTER_S = 5.0
# Unanswered probes before the peer is declared gone: one lost probe is no verdict.
_PROBES = 3


@dataclass(frozen=True)
class KeepAlive:
    idle_s: int  # silence before the first probe (the kernel counts whole seconds, at least 1)
    interval_s: int  # between probes
    count: int  # unanswered probes that end the connection
    user_timeout_ms: int  # unacknowledged data (or unanswered probes) for this long ends it too

    @property
    def detection_s(self) -> float:
        """The longest a silent peer goes unnoticed: the later of the probes' verdict and the user
        timeout (with TCP_USER_TIMEOUT set, Linux ends a probed connection only once both passed)."""
        return max(self.idle_s + self.interval_s * self.count, self.user_timeout_ms / 1000)


def figures(dead_after_s: float) -> KeepAlive:
    """Probes and user timeout that notice a silent peer within about `dead_after_s` seconds (a
    second more at worst, for the kernel's whole-second probe timers)."""
    if not math.isfinite(dead_after_s) or dead_after_s <= 0:
        raise InvalidArgumentError(f"dead_after_s: got {dead_after_s}, expected a finite number > 0")
    idle = max(1, int(dead_after_s / 2))
    interval = max(1, int((dead_after_s - idle) / _PROBES))
    return KeepAlive(idle, interval, _PROBES, max(1, round(dead_after_s * 1000)))


def keep_alive(sock: socket.socket, dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> KeepAlive:
    """Set `figures(dead_after_s)` on a TCP socket (a unix socket is left alone: its peer shares our
    kernel, which closes it when the peer dies); the figures set."""
    ka = figures(dead_after_s)
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return ka
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, ka.idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, ka.interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, ka.count)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ka.user_timeout_ms)
    return ka
