"""The development CA: one certificate per node, made on first use and kept after (`pshard certs`).

The `pshard certs` command (pshard/certs.py) and the launcher call it; every process told to make its
certificates (common.security.credentials) does too, which is why it lives in the shared layer.

Each NODE is ``ROLE`` or ``ROLE/NODE-ID``; its certificate names it in a URI SAN,
``spiffe://pshard/<role>/<node-id>`` (what servers authorise on, `pshard.common.security.identity`), and
its host names in DNS/IP SANs (always ``localhost`` and ``127.0.0.1``, plus every ``--host`` and
the node id itself, which is the host name in the compose file). Files in DIR:

    ca.pem, ca-key.pem          the CA (its key never leaves DIR; guard it)
    crl.pem                     the certificates the CA revoked (empty at first; --tls-crl FILE)
    <name>.pem, <name>-key.pem  a node, <name> = its node id, or its role when it has none

Run twice, it changes nothing: a file is (re)made only when missing, expired within a day, not
signed by DIR's CA, revoked, or lacking a host asked for (so after ``--revoke NAME``, naming the
node again gives it a new certificate). Servers re-read crl.pem when it changes. For production,
use your own CA: pshard needs only the URI SAN above in each certificate.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pshard.common.errors import ClusterConfigError
from pshard.common.security.credentials import SecurityConfig
from pshard.common.security.identity import Identity

DEFAULT_DIR = "pshard-certs"
DEFAULT_DAYS = 365
# Longest validity: X.509 dates end at 9999, and a CA valid for a century is long enough.
MAX_DAYS = 36500
LOCAL_HOSTS = ("localhost", "127.0.0.1")
_RENEW_BEFORE = dt.timedelta(days=1)
CRL_NAME = "crl.pem"
# OpenSSL refuses every peer once a CRL's nextUpdate has passed: `ensure` re-signs it well before.
_CRL_DAYS, _CRL_RENEW_BEFORE = 90, dt.timedelta(days=30)


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path
    crl: Path | None = None

    def security(self, role: str = "", node_id: str = "") -> SecurityConfig:
        return SecurityConfig(self.cert, self.key, self.ca, role=role, node_id=node_id, crl=self.crl)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _write_private(path: Path, data: bytes, mode: int) -> None:
    """Write whole or not at all: a reader never sees half a key (rotation re-reads these files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@contextmanager
def _locked(directory: Path) -> Any:
    # Several processes may start at once (a launcher's children, compose services): one makes the CA.
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def make_ca(directory: Path, *, name: str = "pshard development CA", days: int = DEFAULT_DAYS * 10
            ) -> tuple[Path, Path]:
    """A new self-signed CA in `directory` (overwrites one there); returns (ca.pem, ca-key.pem)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pshard"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    ca, ca_key = directory / "ca.pem", directory / "ca-key.pem"
    _write_private(ca_key, _key_pem(key), 0o600)
    _write_private(ca, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return ca, ca_key


def _san(identity: Identity, hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.spiffe_id())]
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(directory: Path, identity: Identity, hosts: Iterable[str] = LOCAL_HOSTS, *,
          days: int = DEFAULT_DAYS, not_before: dt.datetime | None = None,
          not_after: dt.datetime | None = None, name: str | None = None) -> CertFiles:
    """A certificate for `identity` signed by `directory`'s CA (which must exist), always new.

    `not_before`/`not_after` exist for tests (an expired certificate)."""
    ca_path, ca_key_path = directory / "ca.pem", directory / "ca-key.pem"
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pshard"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
                         x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id or identity.role)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before or now - dt.timedelta(minutes=5))
            .not_valid_after(not_after or now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(_san(identity, [*hosts, *([identity.node_id] if identity.node_id else [])]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    base = name or identity.node_id or identity.role
    files = CertFiles(directory / f"{base}.pem", directory / f"{base}-key.pem", ca_path)
    _write_private(files.key, _key_pem(key), 0o600)
    _write_private(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


# ---- revocation ----

def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return ca, key


def _crl(directory: Path) -> x509.CertificateRevocationList | None:
    """DIR's CRL when its CA signed it (a CRL of a former CA revokes nothing of the new one)."""
    path = directory / CRL_NAME
    try:
        crl = x509.load_pem_x509_crl(path.read_bytes())
        ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    except (OSError, ValueError):
        return None
    valid = crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    return crl if valid else None


def revoked_serials(directory: Path) -> dict[int, dt.datetime]:
    crl = _crl(directory)
    return {} if crl is None else {e.serial_number: e.revocation_date_utc for e in crl}


def write_crl(directory: Path, revoked: dict[int, dt.datetime]) -> Path:
    """DIR/crl.pem listing `revoked` (serial → when), signed by DIR's CA, written whole."""
    ca, ca_key = _load_ca(directory)
    now = _now()
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
               .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=_CRL_DAYS))
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    path = directory / CRL_NAME
    signed = builder.sign(ca_key, hashes.SHA256())
    _write_private(path, signed.public_bytes(serialization.Encoding.PEM), 0o644)
    return path


def _crl_fresh(directory: Path) -> bool:
    crl = _crl(directory)
    expires = crl.next_update_utc if crl is not None else None
    return expires is not None and expires - _CRL_RENEW_BEFORE > _now()


def revoke(directory: Path | str, names: Sequence[str]) -> dict[str, int]:
    """Add each named certificate to DIR's CRL; a name is a node's file base name in DIR (``worker-1``)
    or a PEM file's path. Returns name → serial. Servers pick the new list up without a restart."""
    directory = Path(directory)
    out: dict[str, int] = {}
    with _locked(directory):
        ca, _ = _load_ca(directory)
        for name in names:
            path = Path(name) if name.endswith(".pem") and Path(name).exists() else directory / f"{name}.pem"
            try:
                cert = x509.load_pem_x509_certificate(path.read_bytes())
            except (OSError, ValueError) as e:
                raise ClusterConfigError(f"--revoke {name}: no certificate at {str(path)!r} ({e})") from None
            if cert.issuer != ca.subject:
                raise ClusterConfigError(f"--revoke {name}: {str(path)!r} is not signed by {directory}'s CA")
            out[name] = cert.serial_number
        revoked = revoked_serials(directory)
        for serial in out.values():
            revoked.setdefault(serial, _now())
        write_crl(directory, revoked)
    return out


def _still_good(files: CertFiles, hosts: Iterable[str]) -> bool:
    if not (files.cert.exists() and files.key.exists() and files.ca.exists()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except Exception:  # unreadable, foreign or tampered: any doubt makes a new one
        return False
    have = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    have |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    return (cert.not_valid_after_utc - _RENEW_BEFORE > _now() and set(hosts) <= have
            and cert.serial_number not in revoked_serials(files.ca.parent))


def ensure(directory: Path | str, nodes: Sequence[Identity], hosts: Iterable[str] = (), *,
           days: int = DEFAULT_DAYS) -> dict[Identity, CertFiles]:
    """The CA and a certificate per node in `directory`, made only where missing or unfit."""
    directory = Path(directory)
    wanted = [*LOCAL_HOSTS, *hosts]
    out: dict[Identity, CertFiles] = {}
    with _locked(directory):
        if not ((directory / "ca.pem").exists() and (directory / "ca-key.pem").exists()):
            make_ca(directory)
        if not _crl_fresh(directory):  # none yet, a former CA's, or near its nextUpdate
            write_crl(directory, revoked_serials(directory))
        crl = directory / CRL_NAME
        for identity in nodes:
            base = identity.node_id or identity.role
            files = CertFiles(directory / f"{base}.pem", directory / f"{base}-key.pem", directory / "ca.pem",
                              crl)
            node_hosts = [*wanted, *([identity.node_id] if identity.node_id else [])]
            if not _still_good(files, node_hosts):
                files = replace(issue(directory, identity, wanted, days=days), crl=crl)
            out[identity] = files
    return out
