"""How an admin command (`pshard status`, `pshard drain`, `pshard rebalance`) reaches its scheduler.

The scheduler: --scheduler, else TF_CONFIG's, else the running `pshard launch`'s. The credential, as the
`admin` role: the flags or PSHARD_* variables, else that launch's (pshard.launcher.record), so the command
the launcher prints works as it is. Then a channel to it, and the first message of its Watch stream, which
carries the view and everything the scheduler reports (drains, joins, loads, moves).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pshard.common.security.credentials import (
    ENV_CA,
    ENV_CERT,
    ENV_INSECURE,
    ENV_KEY,
    ENV_TLS_DIR,
    ENV_TOKEN,
    SecurityConfig,
    security_from_args,
)
from pshard.launcher.record import find_record, records_dir

if TYPE_CHECKING:
    from pshard.api.v1.scheduler_pb2 import WatchResponse
    from pshard.api.v1.scheduler_pb2_grpc import SchedulerServiceStub

_SECURITY_FLAGS = ("tls_cert", "tls_key", "tls_ca", "token_file", "tls_dir", "insecure")


def add_scheduler_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="HOST:PORT",
                   help="the scheduler (default: TF_CONFIG's, else the one 'pshard launch' is running)")


def parse_admin_args(p: argparse.ArgumentParser, argv: Sequence[str] | None,
                     environ: Mapping[str, str] | None = None
                     ) -> tuple[argparse.Namespace, str, SecurityConfig]:
    """The command's flags, its scheduler and its credential; like a bad flag, a scheduler or credential
    that cannot be found (a bad TF_CONFIG names its field) ends the command: `PROG: error: ...`, exit 2."""
    args = p.parse_args(argv)
    try:
        scheduler, security = admin_target(args, os.environ if environ is None else environ)
    except Exception as err:  # a bad TF_CONFIG, a credential file that is not there: the message says which
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return args, scheduler, security


def admin_target(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, SecurityConfig]:
    """The scheduler an admin command talks to, and its credentials as the `admin` role: from the flags,
    else TF_CONFIG, else the running `pshard launch`. Raises on a bad TF_CONFIG, naming its field."""
    scheduler = _scheduler_address(args, environ)
    _launcher_security(args, scheduler, environ)
    return scheduler, security_from_args(args, environ, role="admin")


@contextmanager
def scheduler_stub(scheduler: str, security: SecurityConfig) -> Iterator[SchedulerServiceStub]:
    """A stub on a channel to `scheduler`, closed on the way out."""
    from pshard.api.v1 import scheduler_pb2_grpc

    with security.channel(scheduler) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


def first_watch(stub: SchedulerServiceStub, timeout_s: float) -> WatchResponse:
    """The scheduler's current view and reports: the first message of a Watch, whose stream is then
    cancelled (an admin command reads once)."""
    from pshard.api.v1 import scheduler_pb2

    stream = stub.Watch(scheduler_pb2.WatchRequest(), timeout=timeout_s)
    try:
        return next(iter(stream))
    finally:
        stream.cancel()


def rpc_failure(err: Exception) -> str:
    """Why a call to the scheduler failed, for the command's error line: a gRPC error's code and details."""
    code = getattr(err, "code", None)
    return f"{code().name}: {err.details()}" if callable(code) else str(err)  # type: ignore[attr-defined]


def _scheduler_address(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if args.scheduler:
        return str(args.scheduler)
    raw = environ.get("TF_CONFIG")
    if raw:
        from pshard.common.cluster.spec import ClusterSpec

        return ClusterSpec.from_tf_config(raw).scheduler_address
    record = find_record(environ)
    if record is not None:
        return record.scheduler
    raise ValueError(f"no scheduler: pass --scheduler HOST:PORT or set TF_CONFIG (no 'pshard launch' is "
                     f"running: a running one keeps a record in {records_dir(environ)})")


def _launcher_security(args: argparse.Namespace, scheduler: str, environ: Mapping[str, str]) -> None:
    """No credentials given, and `scheduler` is a running `pshard launch`'s: that launch's (its certificates'
    folder holds an admin's), or none for an --insecure launch (pshard.launcher.record). Anything given
    explicitly (flags or PSHARD_TLS_* / PSHARD_TOKEN_FILE / PSHARD_TLS_DIR / PSHARD_INSECURE) wins."""
    if any(getattr(args, flag, None) is not None for flag in _SECURITY_FLAGS) or any(
            environ.get(var) for var in (ENV_CERT, ENV_KEY, ENV_CA, ENV_TOKEN, ENV_TLS_DIR, ENV_INSECURE)):
        return
    record = find_record(environ, scheduler)
    if record is None:
        return
    if record.certs_dir is None:
        args.insecure = True
    else:
        args.tls_dir = record.certs_dir
