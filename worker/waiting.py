"""Waiting for peers out loud (docs/architecture.md, 9 Failures).

A worker waits for peers at start-up (the scheduler, the parameter servers) and at the start barrier
(the other trainers). Silent, those waits lasted the whole start-up timeout (minutes) and ended with
an error that did not name the missing peer. `PeerWait` runs beside a blocking wait: every few seconds
it logs whom the wait is for and at which address, and it ends the wait at once (through `abort`) when
a peer is known to be gone (the scheduler declared it dead, or it left) or has refused connections for
longer than a short grace (nothing listens at its address), or at once when the peer's TLS certificate
is one this process refuses (it does not name the address the peer is reached by, or another CA signed
it): gRPC would retry that handshake for the whole start-up timeout without a word (issue 24).
`failure` then says why, naming the peer and the fix.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from pshard.common.cluster.spec import parse_address
from pshard.common.errors import PSError, UnavailableError

log = logging.getLogger("pshard.worker")

CHECK_INTERVAL_S = 0.5
_PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Peer:
    name: str  # "the scheduler", "ps-1", "worker-1"
    address: str
    # What is known of it ("not registered with the scheduler yet"); "" = nothing.
    state: str = ""
    # Whether it should accept connections at `address` (servers do; trainers do not listen).
    listens: bool = False
    # Known gone (declared dead, or left): it will not come, the wait ends at once.
    gone: bool = False


class Silence(str):
    """A probe's reason that is no answer at all (a dropping firewall, a host down), not a refusal."""


def refused(address: str, timeout_s: float = _PROBE_TIMEOUT_S) -> str | None:
    """Why nothing accepts a TCP connection at `address` ("connection refused", a Silence, ...); None
    if something does, or if that is not known."""
    try:
        host, _, port = parse_address(address, "address").rpartition(":")
        target = (host.strip("[]"), int(port))
    except (PSError, ValueError):  # not ours to judge here: the wait's own timeout decides
        return None
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        # No answer at all, not even a refusal: a firewall drops the port, or the host is down. A kernel
        # answers a connect in microseconds whatever its processes do, so the grace makes it a verdict.
        return Silence(f"no answer within {timeout_s:g} s")
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"unreachable ({e.strerror})"
        if isinstance(e, socket.gaierror):
            return f"unknown host ({e.strerror})"
        return None


def certificate_refused(address: str, context: ssl.SSLContext, timeout_s: float = _PROBE_TIMEOUT_S
                        ) -> str | None:
    """Why this process refuses the TLS certificate served at `address`, with the fix; None when it is
    accepted, or when that is not known (nothing answers there: `refused` tells that apart)."""
    try:
        host, _, port = parse_address(address, "address").rpartition(":")
        target = (host.strip("[]"), int(port))
    except (PSError, ValueError):
        return None
    context.set_alpn_protocols(["h2"])  # as gRPC's handshake: a gRPC server may insist on it
    try:
        with socket.create_connection(target, timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=target[0]):
            return None
    except ssl.SSLCertVerificationError as err:
        return (f"its TLS certificate is refused here ({err.verify_message}): issue it from the job's CA "
                f"for the address it is reached by (`pshard certs --host {target[0]}`), or reach it by a "
                "name its certificate has")
    except OSError:  # refused, unreachable, timed out, or the peer refused our certificate
        return None


class PeerWait:
    """A context manager around a blocking wait for `pending()` peers; see the module docstring."""

    def __init__(self, what: str, pending: Callable[[], Sequence[Peer]], abort: Callable[[], None], *,
                 log_every_s: float = 5.0, refused_grace_s: float = 30.0,
                 probe: Callable[[str], str | None] = refused,
                 tls: Callable[[], ssl.SSLContext] | None = None) -> None:
        """`tls`: this process's client context (a new one per call) when the job runs TLS: a peer
        whose certificate it refuses ends the wait at once."""
        self.what = what
        self.failure: str | None = None
        self._pending = pending
        self._abort = abort
        self._log_every_s = log_every_s
        self._refused_grace_s = refused_grace_s
        self._probe = probe
        self._tls = tls
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-wait", daemon=True)

    def __enter__(self) -> PeerWait:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        if exc is not None and self.failure is not None:
            # The wait ended because we aborted it: what it died of (a cancelled call) is a consequence.
            raise UnavailableError(self.failure) from exc

    def _run(self) -> None:
        started = time.monotonic()
        next_log = started + self._log_every_s
        refused_since: dict[str, float] = {}
        while not self._stop.wait(CHECK_INTERVAL_S):
            now = time.monotonic()
            peers = list(self._pending())
            notes: list[str] = []
            troubled: list[str] = []
            for peer in peers:
                note, failure, wrong = self._check(peer, now, refused_since)
                notes.append(note)
                if wrong:
                    troubled.append(note)
                if failure is not None:
                    self.failure = f"{self.what}: {failure}"
                    log.error("%s", self.failure)
                    self._abort()
                    return
            if peers and now >= next_log:
                log.warning("%s: still waiting after %.0f s for %s", self.what, now - started,
                            _naming(notes, troubled))
                next_log = now + self._log_every_s

    def _check(self, peer: Peer, now: float, refused_since: dict[str, float]
               ) -> tuple[str, str | None, bool]:
        """(how the peer reads in the log line, why the wait must end now or None, whether something
        is known to be wrong with it)."""
        why = self._probe(peer.address) if peer.listens else None
        if why is None:
            refused_since.pop(peer.address, None)
            refused_for = 0.0
        else:
            refused_for = now - refused_since.setdefault(peer.address, now)
        details = [d for d in (peer.state, why and f"{why} for {refused_for:.0f} s") if d]
        note = f"{peer.name} at {peer.address}" + (f" ({', '.join(details)})" if details else "")
        if peer.gone:
            return note, (f"{peer.name} at {peer.address} is gone ({peer.state or 'the scheduler says so'}); "
                          "it will not come, so waiting for it is pointless"), True
        if why is None and peer.listens and self._tls is not None:
            refusal = certificate_refused(peer.address, self._tls())
            if refusal is not None:
                return note, f"{peer.name} at {peer.address}: {refusal}", True
        if why is not None and refused_for >= self._refused_grace_s:
            host, _, port = peer.address.rpartition(":")
            hint = (f"a firewall drops port {port}, or the host is down: open TCP port {port} on {host} to "
                    "this host" if isinstance(why, Silence)
                    else "nothing listens there: is it started, and is the address right?")
            return note, f"{peer.name} at {peer.address}: {why} for {refused_for:.0f} s ({hint})", True
        return note, None, bool(details)


def _naming(notes: Sequence[str], troubled: Sequence[str]) -> str:
    """The peers a wait line names: those with something known wrong when some have (the one server
    nobody reaches, not every server of the job), else all."""
    if not troubled or len(troubled) == len(notes):
        return "; ".join(notes)
    others = len(notes) - len(troubled)
    answer = f"{others} others answer" if others > 1 else "1 other answers"
    return f"{'; '.join(troubled)} ({answer})"
