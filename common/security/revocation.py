"""Certificate revocation: which peer certificates a CRL file revokes, re-read when the file changes.

gRPC Python cannot load a CRL into its TLS credentials, so a revoked certificate still completes
the handshake; the server interceptor (`pshard.common.security.auth.Authorizer`) then asks `RevocationList`
about the peer certificate gRPC hands it and refuses the call with UNAUTHENTICATED. The raw TCP fast
path checks the same file inside OpenSSL instead (`SecurityConfig.server_ssl_context`).

A CRL is trusted only when the job's CA signed it: a file anyone could write must not be able to
lock the job's nodes out (or, once trusted, be replaced by an emptier one from elsewhere). An update
that cannot be read or verified yet (half written) keeps the last good list, as certificate rotation
keeps the last good pair (docs/architecture.md, 13 Security). `pshard certs --revoke` writes the file.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pshard.common.errors import ClusterConfigError

log = logging.getLogger("pshard.security")


@dataclass(frozen=True)
class _Loaded:
    stamp: tuple[int, int, int]  # (inode, size, mtime): a CRL replaced by rename gets a new inode
    issuer: bytes  # DER of the CRL's issuer name
    serials: frozenset[int]


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_crl(path: Path, ca: Path | None) -> tuple[bytes, frozenset[int]]:
    """(issuer DER, revoked serials) of the PEM or DER CRL at `path`; ValueError unless `ca` signed it."""
    from cryptography import x509

    data = path.read_bytes()
    crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
    if ca is not None:
        authority = x509.load_pem_x509_certificate(ca.read_bytes())
        if crl.issuer != authority.subject or not crl.is_signature_valid(authority.public_key()):  # type: ignore[arg-type]
            raise ValueError(f"{path} is not signed by the CA {ca}")
    return crl.issuer.public_bytes(), frozenset(entry.serial_number for entry in crl)


@lru_cache(maxsize=256)
def _serial_and_issuer(pem: bytes) -> tuple[int, bytes] | None:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    return cert.serial_number, cert.issuer.public_bytes()


class RevocationList:
    """`revoked(pem)`: whether the CRL at `path` revokes that certificate. One stat per question;
    the file is parsed again only when it changed."""

    def __init__(self, path: Path, ca: Path | None) -> None:
        self.path, self._ca = path, ca
        self._lock = threading.Lock()
        self._failed: tuple[int, int, int] | None = None
        try:
            stamp = _stamp(path)
            issuer, serials = read_crl(path, ca)
        except (OSError, ValueError) as e:  # at start-up: fail, naming the flag
            raise ClusterConfigError(f"--tls-crl: cannot use {str(path)!r}: {e}") from None
        self._loaded = _Loaded(stamp, issuer, serials)

    def _current(self) -> _Loaded:
        try:
            stamp = _stamp(self.path)
        except OSError:
            return self._loaded  # removed for a moment (an editor's save): keep the last list
        if stamp in (self._loaded.stamp, self._failed):
            return self._loaded
        with self._lock:
            if stamp not in (self._loaded.stamp, self._failed):
                try:
                    issuer, serials = read_crl(self.path, self._ca)
                except (OSError, ValueError) as e:
                    self._failed = stamp  # said once, tried again when the file changes again
                    log.warning("CRL %s changed but cannot be used (%s); keeping the last one", self.path, e)
                    return self._loaded
                self._loaded = _Loaded(stamp, issuer, serials)
                log.info("CRL %s re-read: %d certificates revoked", self.path, len(serials))
        return self._loaded

    def revoked(self, pem: bytes) -> bool:
        found = _serial_and_issuer(pem)
        if found is None:
            return False  # not a certificate: the caller names nobody and is refused for that
        loaded = self._current()
        serial, issuer = found
        return issuer == loaded.issuer and serial in loaded.serials
