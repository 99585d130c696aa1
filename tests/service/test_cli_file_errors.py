"""File and value errors of the entry points as real processes: one line, exit status 2, no traceback
(non-PEM TLS files, a read-only disk under `pshard certs`, a message limit gRPC cannot take)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pshard.common.security.ca import ensure
from pshard.common.security.identity import parse_identity

from tests.service.entrypoints import REPO, WAIT_S, child_env
from tests.service.mounts import tmpfs

PS = "python -m pshard.ps_server"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=WAIT_S)


def _one_error_line(result: subprocess.CompletedProcess[str], prog: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"{prog}: error: "), result.stderr
    return result.stderr.strip()


def test_a_message_limit_grpc_cannot_take_is_a_usage_error() -> None:
    result = _run("-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--max-message-mb", "100000")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"{PS}: error: argument --max-message-mb: got '100000', expected a whole number in 1..2047")


@pytest.mark.parametrize(("spoil", "flag", "kind"), [
    ("cert", "--tls-cert", "a PEM certificate"),
    ("key", "--tls-key", "an unencrypted PEM private key"),
    ("ca", "--tls-ca", "PEM certificates"),
    ("swap", "--tls-key", "the key of --tls-cert"),
])
def test_tls_files_that_are_not_pem_of_their_kind_are_one_line_naming_flag_and_file(
        tmp_path: Path, spoil: str, flag: str, kind: str) -> None:
    made = ensure(tmp_path / "certs", [parse_identity("ps/ps-0", "test"), parse_identity("ps/ps-1", "test")])
    own, other = made.values()
    files = {"cert": own.cert, "key": own.key, "ca": own.ca}
    if spoil == "swap":  # a PEM key, but another node's
        files["key"] = other.key
    else:
        files[spoil] = tmp_path / f"{spoil}.txt"
        files[spoil].write_text("this is not PEM\n")
    result = _run("-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--tls-cert", str(files["cert"]),
                  "--tls-key", str(files["key"]), "--tls-ca", str(files["ca"]))
    line = _one_error_line(result, PS)
    spoiled = files["key" if spoil == "swap" else spoil]
    assert line.startswith(f"{PS}: error: {flag}: {str(spoiled)!r} is not {kind}"), line


def test_pshard_certs_on_a_read_only_disk_is_one_line_naming_the_path(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", read_only=True) as disk:
        result = _run("-m", "pshard", "certs", "--dir", str(disk / "certs"), "worker/worker-0")
    line = _one_error_line(result, "pshard certs")
    assert line == f"pshard certs: error: --dir: cannot write {str(disk / 'certs')!r}: Read-only file system"


def test_a_token_file_that_is_not_text_is_one_line(tmp_path: Path) -> None:
    token = tmp_path / "tokens"
    token.write_bytes(b"\xff\xfe\x00 worker s3cret\n")
    result = _run("-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--token-file", str(token))
    line = _one_error_line(result, PS)
    assert line == f"{PS}: error: --token-file: {str(token)!r} is not UTF-8 text (byte 0)"


def test_evaluating_a_file_that_is_not_a_saved_model_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "model.pt"
    model.write_text("not a model\n")
    line = _one_error_line(_run("-m", "pshard", "evaluate", str(model)), "pshard evaluate")
    assert line.startswith(f"pshard evaluate: error: {model}: not a model pshard saved"), line


def test_the_launcher_refuses_a_read_only_checkpoint_dir_before_starting_anything(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", read_only=True) as disk:
        result = _run("-m", "pshard", "launch", "--ps", "1", "--workers", "1", "--checkpoint-dir",
                      str(disk / "ckpt"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and not result.stdout, result
    assert result.stderr.splitlines()[-1] == (
        f"pshard launch: error: --checkpoint-dir: {str(disk / 'ckpt')!r} is not a writable directory "
        "(Read-only file system)")
