"""Where a local launch leaves what `pshard status` needs: the certificates' folder and the last launch.

`pshard launch` turns mutual TLS on with certificates in `default_certs_dir()` and, while it runs, keeps
a small record of the launch (scheduler address, certificates' folder or none for --insecure, job id, its
pid) in `launches/<pid>.json` beside them. `pshard status` with no flags shows the newest running launch, and
with the address the launcher prints it finds that launch's credentials: so the printed command is all a
user types. Other addresses get no guess (TLS towards a plain server would only fail). The record names no
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


def records_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where running launches keep their records: beside the default certificates' folder (by default
    ~/.cache/pshard/launches), not in it, so that an --insecure launch makes no certificates' folder."""
    return Path(default_certs_dir(environ)).parent / "launches"


@dataclass(frozen=True)
class LaunchRecord:
    scheduler: str
    certs_dir: str | None  # None: an --insecure launch
    job_id: str
    pid: int  # the launcher's

    def status_command(self, environ: Mapping[str, str] | None = None) -> str:
        """What to type to see this job: `pshard status` finds this record by the address."""
        command = f"pshard status --scheduler {self.scheduler}"
        if self.certs_dir is None or self.certs_dir == default_certs_dir(environ):
            return command
        return command + f" --tls-dir {self.certs_dir}"


def write_record(record: LaunchRecord, environ: Mapping[str, str] | None = None) -> Path | None:
    """Keep `record` while the launch runs; None when the folder is not writable (status then needs flags)."""
    path = records_dir(environ) / f"{record.pid}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(record)) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def find_record(environ: Mapping[str, str] | None = None,
                scheduler: str | None = None) -> LaunchRecord | None:
    """The running launch whose scheduler is `scheduler`, or (None) the newest running launch.

    A record whose launcher is gone (SIGKILLed, so it could not remove it) is ignored."""
    try:
        paths = sorted(records_dir(environ).glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for path in paths:
        record = _read(path)
        if record is not None and _alive(record.pid) and scheduler in (None, record.scheduler):
            return record
    return None


def remove_record(pid: int, environ: Mapping[str, str] | None = None) -> None:
    """At the launcher's exit: its record goes."""
    with contextlib.suppress(OSError):
        (records_dir(environ) / f"{pid}.json").unlink()


def _read(path: Path) -> LaunchRecord | None:
    try:
        raw = json.loads(path.read_text())
        return LaunchRecord(str(raw["scheduler"]), raw["certs_dir"], str(raw["job_id"]), int(raw["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number: not our launcher
        return False
    return True
