"""Who a caller is: a role and, when its credential names one, a node id.

Certificates carry it in a URI subject alternative name, ``spiffe://pshard/<role>/<node-id>``
(``spiffe://pshard/admin/alice``, ``spiffe://pshard/worker/worker-1``); `pshard certs` writes
them. A certificate with the role but no id (``spiffe://pshard/worker``) stands for any node of
that role.

Token files hold one credential a line, ``ROLE[/NODE-ID] SECRET``; blank lines and ``#`` comments
are skipped::

    # role[/node-id]   secret
    chief              9f2c...
    worker             a41b...        # shared by every worker: identity "worker", any id
    worker/worker-3    77d0...        # pins worker-3 to its own secret
    admin              c3e8...

A server accepts every line of its file; a client sends the line of its own role (its own
role/id line first). Give a worker a file with only its own line when workers must not act as
the chief; a shared file gives whoever reads it every role in it.

Pure: no grpc, no environment. `cryptography` is imported only to read a certificate.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from functools import lru_cache

from pshard.common.errors import ClusterConfigError

# Roles a credential may name: the cluster's task types, plus a human operator.
CREDENTIAL_ROLES = ("scheduler", "ps", "chief", "worker", "evaluator", "admin")
SPIFFE_PREFIX = "spiffe://pshard/"


@dataclass(frozen=True)
class Identity:
    role: str
    node_id: str = ""  # "" = any node of the role

    def __str__(self) -> str:
        return f"{self.role}/{self.node_id}" if self.node_id else self.role

    def may_be(self, node_id: str) -> bool:
        """Whether this credential may act as node `node_id` (an id-less one: any node of its role)."""
        return self.node_id == node_id if self.node_id else node_id.split("-", 1)[0] == self.role

    def spiffe_id(self) -> str:
        return SPIFFE_PREFIX + (f"{self.role}/{self.node_id}" if self.node_id else self.role)


def parse_identity(text: str, where: str) -> Identity:
    role, _, node_id = text.partition("/")
    if role not in CREDENTIAL_ROLES:
        raise ClusterConfigError(f"{where}: role {role!r}, expected one of {', '.join(CREDENTIAL_ROLES)}")
    if "/" in node_id:
        raise ClusterConfigError(f"{where}: {text!r}, expected ROLE or ROLE/NODE-ID")
    return Identity(role, node_id)


def identity_from_spiffe(uri: str) -> Identity | None:
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    try:
        return parse_identity(uri[len(SPIFFE_PREFIX):], "certificate URI")
    except ClusterConfigError:
        return None


@lru_cache(maxsize=256)
def identity_from_pem(pem: bytes) -> Identity | None:
    """The identity a (peer's) certificate names, None if it names none (cached: every call asks)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        found = identity_from_spiffe(uri)
        if found is not None:
            return found
    return None


def may_serve_scheduler(identity: Identity | None, host_task: str) -> bool:
    """Whether a certificate naming `identity` may serve the scheduler: the scheduler's own, or that
    of the task hosting it in-process (`host_task`, "chief-0" or "worker-0", in a cluster without a
    scheduler task; "" when the cluster has one). Any other node's certificate, though signed by the
    job's CA, is an impostor's (issue 24: a server registered with a worker posing as the scheduler)."""
    if identity is None:
        return False
    if identity.role == "scheduler":
        return True
    return bool(host_task) and identity.role == host_task.split("-", 1)[0] and identity.may_be(host_task)


@dataclass(frozen=True)
class TokenTable:
    entries: tuple[tuple[Identity, str], ...] = ()

    @classmethod
    def parse(cls, text: str, where: str = "token file") -> TokenTable:
        entries: list[tuple[Identity, str]] = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ClusterConfigError(
                    f"{where}:{n}: expected 'ROLE[/NODE-ID] SECRET', got {len(parts)} fields")
            identity, secret = parse_identity(parts[0], f"{where}:{n}"), parts[1]
            if len(secret) < 16:
                raise ClusterConfigError(
                    f"{where}:{n}: secret of {len(secret)} characters, expected 16 or more")
            entries.append((identity, secret))
        if not entries:
            raise ClusterConfigError(f"{where}: no 'ROLE[/NODE-ID] SECRET' line")
        return cls(tuple(entries))

    def identity_of(self, token: str) -> Identity | None:
        """Whose token this is; compared in constant time, every line looked at."""
        found = None
        for identity, secret in self.entries:
            if hmac.compare_digest(secret.encode(), token.encode()):
                found = identity
        return found

    def token_for(self, role: str, node_id: str = "") -> str | None:
        """The secret a client of `role` sends: its own id's line, else its role's, else a lone line."""
        for identity, secret in self.entries:
            if identity.role == role and identity.node_id and identity.node_id == node_id:
                return secret
        for identity, secret in self.entries:
            if identity.role == role and not identity.node_id:
                return secret
        return self.entries[0][1] if len(self.entries) == 1 else None
