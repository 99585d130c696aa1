"""Where a local launch leaves what `pshard status` needs: the certificates' folder and the last launch.

`pshard launch` turns mutual TLS on with certificates in `default_certs_dir()` and, while it runs, keeps
a small record of the launch (scheduler address, certificates' folder, job id, its pid) among them. `pshard
status` with no flags reads that record, and with only an address it looks for the certificates in the same
folder the launcher uses: so the command the launcher prints is all a user types. The record names no
secret: the private keys stay in the certificates' folder, readable by their owner only.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path


def default_certs_dir(environ: Mapping[str, str] | None = None) -> str:
    """$PSHARD_CERTS_DIR, else $XDG_CACHE_HOME/pshard/certs (~/.cache/pshard/certs)."""
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return env.get("PSHARD_CERTS_DIR") or os.path.join(cache, "pshard", "certs")


def record_path(environ: Mapping[str, str] | None = None) -> Path:
    """The last launch's record: in the default certificates' folder (one per user), pshard's own."""
    return Path(default_certs_dir(environ)) / "launch.json"


@dataclass(frozen=True)
class LaunchRecord:
    scheduler: str
    certs_dir: str | None  # None: an --insecure launch
    job_id: str
    pid: int  # the launcher's

    def status_command(self, environ: Mapping[str, str] | None = None) -> str:
        """What to type to see this job: plain `pshard status` reads this record."""
        command = f"pshard status --scheduler {self.scheduler}"
        if self.certs_dir is None:
            return command + " --insecure"
        if self.certs_dir != default_certs_dir(environ):
            return command + f" --tls-dir {self.certs_dir}"
        return command


def write_record(record: LaunchRecord, environ: Mapping[str, str] | None = None) -> Path | None:
    """Keep `record` for `pshard status`; None when the folder is not writable (status then needs flags)."""
    path = record_path(environ)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record)) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def read_record(environ: Mapping[str, str] | None = None) -> LaunchRecord | None:
    """The last launch's record, or None when there is none (or it is unreadable)."""
    try:
        raw = json.loads(record_path(environ).read_text())
        return LaunchRecord(str(raw["scheduler"]), raw["certs_dir"], str(raw["job_id"]), int(raw["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_record(pid: int, environ: Mapping[str, str] | None = None) -> None:
    """At the launcher's exit: drop the record if it is still this launcher's (a later launch may own it)."""
    record = read_record(environ)
    if record is not None and record.pid == pid:
        with contextlib.suppress(OSError):
            record_path(environ).unlink()
