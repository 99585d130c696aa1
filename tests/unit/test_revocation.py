"""Issue 11, revocation: `pshard certs --revoke` writes a CRL the CA signs, `--tls-crl`/PSHARD_TLS_CRL
(or a --tls-dir's crl.pem) put it in the one SecurityConfig, and `RevocationList` follows the file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pshard.common.errors import ClusterConfigError
from pshard.common.security.ca import CRL_NAME, ensure, revoke, revoked_serials
from pshard.common.security.credentials import add_security_arguments, security_from_args
from pshard.common.security.identity import Identity
from pshard.common.security.revocation import RevocationList

from pshard.certs import main

W0, W1 = Identity("worker", "worker-0"), Identity("worker", "worker-1")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_security_arguments(parser)
    return parser.parse_args(argv)


def test_revoking_lists_the_serial_and_a_revoked_node_gets_a_new_certificate(tmp_path: Path) -> None:
    made = ensure(tmp_path, [W0, W1])
    assert made[W1].crl == tmp_path / CRL_NAME and revoked_serials(tmp_path) == {}
    crl = RevocationList(tmp_path / CRL_NAME, made[W1].ca)
    old = made[W1].cert.read_bytes()
    assert not crl.revoked(old)

    serial = revoke(tmp_path, ["worker-1"])["worker-1"]
    assert set(revoked_serials(tmp_path)) == {serial}
    assert crl.revoked(old) and not crl.revoked(made[W0].cert.read_bytes())  # re-read on change

    renewed = ensure(tmp_path, [W1])[W1]  # a revoked certificate is not "still good"
    assert renewed.cert.read_bytes() != old and not crl.revoked(renewed.cert.read_bytes())
    revoke(tmp_path, [str(made[W0].cert)])  # by path too; earlier revocations are kept
    assert len(revoked_serials(tmp_path)) == 2 and crl.revoked(old)


def test_a_crl_that_becomes_unreadable_keeps_the_last_good_list(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    made = ensure(tmp_path, [W1])
    revoke(tmp_path, ["worker-1"])
    crl = RevocationList(tmp_path / CRL_NAME, made[W1].ca)
    cert = made[W1].cert.read_bytes()
    (tmp_path / CRL_NAME).write_bytes(b"-----BEGIN X509 CRL-----\nhalf")
    assert crl.revoked(cert) and "cannot be used" in caplog.text
    with pytest.raises(ClusterConfigError, match="--tls-crl"):
        RevocationList(tmp_path / CRL_NAME, made[W1].ca)


def test_the_crl_comes_from_the_flag_the_environment_or_the_tls_dir(tmp_path: Path) -> None:
    files = ensure(tmp_path / "dev", [W0])[W0]
    tls = ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]
    crl = str(files.crl)
    assert security_from_args(_parse([*tls, "--tls-crl", crl]), {}).crl == files.crl
    assert security_from_args(_parse(tls), {"PSHARD_TLS_CRL": crl}).crl == files.crl
    assert security_from_args(_parse(tls), {}).crl is None
    by_dir = security_from_args(_parse([]), {"PSHARD_TLS_DIR": str(tmp_path / "dev")}, role="worker",
                                node_id="worker-0")
    assert by_dir.crl == files.crl and by_dir.tls
    assert "CRL" in by_dir.describe()
    with pytest.raises(ClusterConfigError, match="--tls-crl: needs --tls-ca"):
        security_from_args(_parse(["--tls-crl", crl]), {})
    with pytest.raises(ClusterConfigError, match="--tls-crl: cannot use"):
        security_from_args(_parse([*tls, "--tls-crl", str(files.cert)]), {})  # not a CRL


def test_pshard_certs_revoke_names_what_it_cannot_find(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    ensure(tmp_path, [W0])
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path), "--revoke", "worker-9"])
    assert "no certificate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path)])
    assert main(["--dir", str(tmp_path), "--revoke", "worker-0"]) == 0
    assert "revoked worker-0" in capsys.readouterr().out
