"""Transport security of every pshard channel: mTLS files, tokens, and what they make.

Parsed once at an entry point into a frozen `SecurityConfig`:

    --tls-cert FILE   (PSHARD_TLS_CERT)   this process's certificate chain (PEM)
    --tls-key FILE    (PSHARD_TLS_KEY)    its private key (PEM)
    --tls-ca FILE     (PSHARD_TLS_CA)     the CA that signs every pshard certificate (PEM)
    --tls-crl FILE    (PSHARD_TLS_CRL)    certificates the CA revoked (a CRL it signed; re-read on change)
    --token-file FILE (PSHARD_TOKEN_FILE) role tokens, see `pshard.common.security.identity.TokenTable`
    --tls-dir DIR     (PSHARD_TLS_DIR)    a development CA: this node's certificate made there on first use
    --insecure        (PSHARD_INSECURE=1) no TLS and no token, on purpose (a loud warning says so)

The three TLS files go together. With no flag at all a process runs in the clear as before;
`SecurityConfig()` (the default of every API: PSClient, SchedulerClient, start(...))
is that same plain set-up, so library users and tests keep working untouched.

What the rest of pshard uses (docs/architecture.md, 13 Security):

- `server_credentials()`: gRPC server credentials that re-read the certificate and key when
  their files change (certificate rotation without a restart), client certificates required
  unless a token file lets token-only clients in; `add_port(server, bind)` picks secure or not.
- `channel(target, options)`: a client channel with the right credentials: TLS (+ the token as
  call credentials), or a plain channel carrying the token in metadata (with a warning that it
  travels in clear).
- `server_ssl_context()` / `client_ssl_context()`: `ssl.SSLContext`s from the same files, for the
  raw TCP fast path (mutual authentication, TLS 1.2+, the CRL checked by OpenSSL); the server's
  builds a fresh context for a new connection when a file changed (rotation, a new CRL).
- `server_interceptors()`: the `pshard.common.security.auth.Authorizer` that names each caller's role (and
  refuses a certificate the CRL revokes: gRPC Python cannot load a CRL, `pshard.common.security.revocation`).

The gRPC objects are made in `pshard.common.security.grpc_credentials`, imported by these methods when a
process first serves or dials: parsing the flags loads no grpc, so every command's --help and usage
errors are quick.

Certificates name their holder's role and node id in a URI SAN, ``spiffe://pshard/<role>/<id>``
(`pshard certs` makes them; see `pshard.common.security.identity`).
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pshard.common.errors import ClusterConfigError
from pshard.common.security.identity import Identity, TokenTable

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("pshard.security")

ENV_CERT, ENV_KEY, ENV_CA = "PSHARD_TLS_CERT", "PSHARD_TLS_KEY", "PSHARD_TLS_CA"
ENV_CRL = "PSHARD_TLS_CRL"
ENV_TOKEN = "PSHARD_TOKEN_FILE"
ENV_INSECURE = "PSHARD_INSECURE"
# A development CA's directory: without TLS files, a process makes (once) and uses its own certificate
# there (`pshard certs`), so a compose file turns mTLS on with one shared volume.
ENV_TLS_DIR = "PSHARD_TLS_DIR"


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ClusterConfigError(f"{what}: cannot read {str(path)!r}: {e.strerror or e}") from None


def _check_tls_files(cert: Path, key: Path, ca: Path) -> None:
    """ClusterConfigError naming the flag and the file unless each is readable PEM of its kind and
    the key is the certificate's."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    cert_pem, key_pem, ca_pem = _read(cert, "--tls-cert"), _read(key, "--tls-key"), _read(ca, "--tls-ca")
    checks = ((cert, "--tls-cert", "a PEM certificate", lambda: x509.load_pem_x509_certificate(cert_pem)),
              (key, "--tls-key", "an unencrypted PEM private key",
               lambda: serialization.load_pem_private_key(key_pem, None)),
              (ca, "--tls-ca", "PEM certificates", lambda: x509.load_pem_x509_certificates(ca_pem)),
              (key, "--tls-key", "the key of --tls-cert", lambda: check_pair(cert_pem, key_pem)))
    for path, flag, kind, load in checks:
        try:
            load()
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # cryptography's: not that kind
            reason = str(e).split(". See https://")[0]
            raise ClusterConfigError(f"{flag}: {str(path)!r} is not {kind} ({reason})") from None


@dataclass(frozen=True)
class SecurityConfig:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    token_file: Path | None = None
    insecure: bool = False
    # The role this process acts as: picks its own line of the token file.
    role: str = ""
    node_id: str = ""
    tokens: TokenTable = field(default_factory=TokenTable, compare=False, repr=False)
    # A CRL signed by the CA: certificates it revokes are refused (gRPC: by the interceptor; TCP: OpenSSL).
    crl: Path | None = None

    def __post_init__(self) -> None:
        given = [p for p in (self.cert, self.key, self.ca) if p is not None]
        if given and len(given) != 3:
            flags = (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca))
            missing = [n for n, p in flags if p is None]
            raise ClusterConfigError(f"TLS: {', '.join(missing)} missing; the three TLS files go together")
        if self.crl is not None and self.ca is None:
            raise ClusterConfigError("--tls-crl: needs --tls-ca (a CRL is checked against its CA)")
        if self.insecure and (given or self.token_file):
            raise ClusterConfigError("--insecure: cannot be combined with --tls-* or --token-file")
        if self.token_file is not None and not self.tokens.entries:
            raw = _read(self.token_file, "--token-file")
            try:
                text = raw.decode()
            except UnicodeDecodeError as e:
                raise ClusterConfigError(f"--token-file: {str(self.token_file)!r} is not UTF-8 text "
                                         f"(byte {e.start})") from None
            object.__setattr__(self, "tokens", TokenTable.parse(text, str(self.token_file)))
        if self.cert is not None and self.key is not None and self.ca is not None:
            # Fail at start-up, one line naming the flag, not with a traceback at the first handshake.
            _check_tls_files(self.cert, self.key, self.ca)
        if self.crl is not None:
            from pshard.common.security.revocation import read_crl

            try:
                read_crl(self.crl, self.ca)
            except (OSError, ValueError) as e:
                raise ClusterConfigError(f"--tls-crl: cannot use {str(self.crl)!r}: {e}") from None

    # ---- what is on ----

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def enabled(self) -> bool:
        """Callers are authenticated (and authorised) by the servers of this process."""
        return self.tls or self.token_file is not None

    def for_node(self, role: str, node_id: str = "") -> SecurityConfig:
        """The same files for a process acting as `role` (picks which token it sends)."""
        return SecurityConfig(self.cert, self.key, self.ca, self.token_file, self.insecure, role, node_id,
                              self.tokens, self.crl)

    def own_token(self) -> str | None:
        return self.tokens.token_for(self.role, self.node_id) if self.token_file is not None else None

    def describe(self) -> str:
        if self.tls:
            return (f"mTLS (CA {self.ca}" + (f", CRL {self.crl})" if self.crl else ")")
                    + (" and tokens" if self.token_file else ""))
        if self.token_file:
            return "tokens in clear (no TLS)"
        return "no TLS, no authentication"

    def warn_if_open(self, prog: str) -> None:
        """Say loudly when this process was told to run open (--insecure) or sends tokens in clear.

        Nothing is said without any flag: that is the plain library default of tests and embedding;
        the compose file, the launcher and the Kubernetes manifests turn TLS on."""
        if self.insecure:
            log.warning("%s: --insecure: NO TLS AND NO AUTHENTICATION. Anyone who reaches the ports can read "
                        "and overwrite the model. Use only on a machine of your own.", prog)
        elif self.token_file is not None and not self.tls:
            log.warning("%s: tokens without TLS: every token travels in clear and can be replayed", prog)

    # ---- gRPC server side ----

    def server_credentials(self) -> grpc.ServerCredentials:
        """Dynamic server credentials: the key and chain are re-read when their files change."""
        assert self.cert is not None and self.key is not None and self.ca is not None
        from pshard.common.security import grpc_credentials  # grpc: only once a server starts

        # A token file lets clients in that have no certificate (they still need the token).
        return grpc_credentials.rotating_server_credentials(
            self.cert, self.key, self.ca, require_client_certificate=self.token_file is None)

    def add_port(self, server: Any, bind: str) -> int:
        """Listen on `bind` (grpc or grpc.aio server) with TLS when configured; the port, 0 on failure."""
        if self.tls:
            return int(server.add_secure_port(bind, self.server_credentials()))
        return int(server.add_insecure_port(bind))

    def server_interceptors(self, refusals: Any = None) -> list[Any]:
        """The interceptors a secured server adds (none when security is off)."""
        if not self.enabled:
            return []
        from pshard.common.security.auth import Authorizer
        from pshard.common.security.revocation import RevocationList

        revocations = RevocationList(self.crl, self.ca) if self.crl is not None else None
        return [Authorizer(self.tokens if self.token_file else None, refusals, revocations)]

    # ---- gRPC client side ----

    def channel_credentials(self) -> grpc.ChannelCredentials:
        assert self.tls
        from pshard.common.security import grpc_credentials  # grpc: only once a channel is made

        return grpc_credentials.tls_channel_credentials(
            _read(self.ca, "--tls-ca"), _read(self.key, "--tls-key"),  # type: ignore[arg-type]
            _read(self.cert, "--tls-cert"), self.own_token())  # type: ignore[arg-type]

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A synchronous channel to `target` with this process's credentials."""
        from pshard.common.security import grpc_credentials  # grpc: only once a channel is made

        if self.tls:
            return grpc_credentials.secure_channel(target, self.channel_credentials(), options)
        return grpc_credentials.plain_channel(target, self.own_token(), options)

    # ---- ssl contexts for the raw TCP fast path ----

    def server_ssl_context(self) -> ssl.SSLContext:
        """Server side: presents this process's certificate, requires one signed by the CA and not
        revoked; each new connection gets the files as they are then (rotation, CRL updates)."""
        assert self.tls, "server_ssl_context: TLS is off"
        return _ReloadingContext(self._ssl_context, self._files())

    def client_ssl_context(self) -> ssl.SSLContext:
        """Client side: verifies the server against the CA (and its host name), presents our certificate."""
        assert self.tls, "client_ssl_context: TLS is off"
        return self._ssl_context(ssl.PROTOCOL_TLS_CLIENT)

    def _ssl_context(self, protocol: ssl._SSLMethod = ssl.PROTOCOL_TLS_SERVER) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.load_verify_locations(cafile=str(self.ca))
        if self.crl is not None:
            # The peer's own certificate is checked; the CA's (a root) has nothing to be revoked by.
            ctx.load_verify_locations(cafile=str(self.crl))
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def _files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca, self.crl) if p is not None)

    def own_identity(self) -> Identity | None:
        """Who this process is, from its certificate (or its token line)."""
        if self.tls:
            from pshard.common.security.identity import identity_from_pem

            return identity_from_pem(_read(self.cert, "--tls-cert"))  # type: ignore[arg-type]
        if self.token_file is not None:
            return self.tokens.identity_of(self.own_token() or "")
        return None


class _ReloadingContext(ssl.SSLContext):
    """An `ssl.SSLContext` (what asyncio servers take) that wraps each new connection with a context
    built from the TLS files as they are now. OpenSSL cannot drop a CRL or a certificate from a
    context, so a changed file means a new context; the check is a stat of each file per connection
    (connections are per fast-path session). Files that fail to load keep the last good context."""

    def __new__(cls, build: Callable[[], ssl.SSLContext], files: Sequence[Path]) -> _ReloadingContext:
        return super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)

    def __init__(self, build: Callable[[], ssl.SSLContext], files: Sequence[Path]) -> None:
        self._build = build
        self._files = tuple(files)
        self._lock = threading.Lock()
        self._stamp = _stamps(self._files)
        self._inner: ssl.SSLContext = build()

    def _current(self) -> ssl.SSLContext:
        stamp = _stamps(self._files)
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._inner = self._build()
                    log.info("TLS files changed: new fast-path connections use them")
                except (OSError, ssl.SSLError) as e:
                    log.warning("TLS files changed but cannot be loaded (%s); keeping the current ones", e)
                self._stamp = stamp
            return self._inner

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        return self._current().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self._current().wrap_socket(*args, **kwargs)


def _stamps(files: Sequence[Path]) -> tuple[tuple[int, int], ...]:
    stamps = []
    for path in files:
        try:
            st = path.stat()
            stamps.append((st.st_ino, st.st_mtime_ns))
        except OSError:
            stamps.append((0, 0))
    return tuple(stamps)


def check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """ValueError unless the key belongs to the certificate: a rotation writes two files, and a
    handshake between the two writes must keep the old pair rather than serve a broken one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, None)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ValueError("the key does not belong to the certificate (yet)")


# ---- entry points ----

def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs/architecture.md, 13 Security)")
    group.add_argument("--tls-cert", metavar="FILE", type=Path, default=None,
                       help=f"this node's certificate chain, PEM (env {ENV_CERT}); with --tls-key and "
                            "--tls-ca turns on mutual TLS")
    group.add_argument("--tls-key", metavar="FILE", type=Path, default=None,
                       help=f"its private key (env {ENV_KEY})")
    group.add_argument("--tls-ca", metavar="FILE", type=Path, default=None,
                       help=f"the CA certificate that signs every node of the job (env {ENV_CA})")
    group.add_argument("--tls-crl", metavar="FILE", type=Path, default=None,
                       help=f"a certificate revocation list signed by the CA (env {ENV_CRL}; 'pshard certs "
                            "--revoke' writes one): revoked peers are refused; re-read when it changes")
    group.add_argument("--token-file", metavar="FILE", type=Path, default=None,
                       help=f"role tokens, lines 'ROLE[/NODE-ID] SECRET' (env {ENV_TOKEN})")
    group.add_argument("--tls-dir", metavar="DIR", default=None,
                       help=f"a development CA (env {ENV_TLS_DIR}): without --tls-cert, this node's "
                            "certificate is made there on first use and kept ('pshard certs'); the CA key "
                            "lives there too")
    group.add_argument("--insecure", action="store_true", default=None,
                       help="run without TLS or tokens, on purpose, with a loud warning "
                            f"(env {ENV_INSECURE}=1)")


def security_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None, *,
                       role: str = "", node_id: str = "", hosts: Sequence[str] = ()) -> SecurityConfig:
    """Flags first, then the PSHARD_TLS_* / PSHARD_TOKEN_FILE variables; raises ClusterConfigError.

    With a --tls-dir (PSHARD_TLS_DIR) and no TLS files, the node's certificate for `role`/`node_id`
    (and `hosts`) is made there on first use (an operator's, role admin, when `role` is "")."""
    env = os.environ if environ is None else environ

    def path(flag: str, var: str) -> Path | None:
        value = getattr(args, flag, None)
        if value is not None:
            return Path(value)
        return Path(env[var]) if env.get(var) else None

    insecure = getattr(args, "insecure", None)
    if insecure is None:
        insecure = env.get(ENV_INSECURE, "").lower() in ("1", "true", "yes")
    cert, key, ca, token = (path("tls_cert", ENV_CERT), path("tls_key", ENV_KEY), path("tls_ca", ENV_CA),
                            path("token_file", ENV_TOKEN))
    crl = path("tls_crl", ENV_CRL)
    if insecure and getattr(args, "insecure", None) is None and (cert or token):
        insecure = False  # files named explicitly win over an inherited PSHARD_INSECURE
    tls_dir = getattr(args, "tls_dir", None) or env.get(ENV_TLS_DIR)
    if tls_dir and cert is None and key is None and ca is None and not insecure:
        cert, key, ca = _auto_certificate(Path(tls_dir), role or "admin", node_id, hosts)
        if crl is None:  # the development CA's own list (`pshard certs` keeps one beside the CA)
            crl = Path(tls_dir) / "crl.pem"
    if insecure:
        crl = None  # an inherited PSHARD_TLS_CRL means nothing without TLS
    return SecurityConfig(cert, key, ca, token, bool(insecure), role, node_id, crl=crl)


def _auto_certificate(directory: Path, role: str, node_id: str,
                      hosts: Sequence[str]) -> tuple[Path, Path, Path]:
    from pshard.common.security.ca import (
        ensure,  # the CA's half of cryptography: only processes told to make certificates load it
    )
    from pshard.common.security.identity import parse_identity

    identity = parse_identity(f"{role}/{node_id}" if node_id else role, "--tls-dir")
    try:
        files = ensure(directory, [identity], [h for h in hosts if h])[identity]
    except OSError as e:
        raise ClusterConfigError(f"--tls-dir: cannot make a certificate in {str(directory)!r}: "
                                 f"{e.strerror or e}") from None
    return files.cert, files.key, files.ca
