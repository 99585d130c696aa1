"""TLS for the benchmarks: a throw-away development CA and certificates (`pshard certs`), and how
servers and workers are told to use them, so that a figure can be taken with TLS on and compared
with the same figure in clear in the same run (issue 11's bars)."""

from __future__ import annotations

import tempfile
from pathlib import Path

PS_IDENTITY = ("ps", "ps-0")  # every bench server presents this one: they all answer on 127.0.0.1


def worker_id(index: int) -> str:
    """Bench workers are worker-0, worker-1, ...: the ids whose certificates may train (and worker-0
    may declare the job) when TLS is on."""
    return f"worker-{index}"


def make_pki(workers: int = 2) -> Path:
    """A new directory with a CA, the servers' certificate and one per worker (removed at exit by
    the OS's temporary-file clean-up; nothing secret outlives the bench)."""
    from pshard.common.security.ca import ensure
    from pshard.common.security.identity import Identity

    directory = Path(tempfile.mkdtemp(prefix="pshard-bench-pki-"))
    ensure(directory, [Identity(*PS_IDENTITY), *(Identity("worker", worker_id(i)) for i in range(workers))])
    return directory


def server_args(pki: str | None) -> list[str]:
    """A parameter server's flags: mutual TLS with the bench CA, or none."""
    if pki is None:
        return []
    base = Path(pki) / PS_IDENTITY[1]
    return ["--tls-cert", f"{base}.pem", "--tls-key", f"{base}-key.pem", "--tls-ca", f"{pki}/ca.pem"]


def worker_security(pki: str | None, node_id: str) -> object:
    """The PSClient `security` of worker `node_id` (None: in clear)."""
    if pki is None:
        return None
    from pshard.common.security.credentials import SecurityConfig

    base = Path(pki) / node_id
    return SecurityConfig(Path(f"{base}.pem"), Path(f"{base}-key.pem"), Path(pki) / "ca.pem",
                          role="worker", node_id=node_id)
