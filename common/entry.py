"""What every service entry point does alike before its event loop takes over.

- SIGTERM or SIGINT during start-up (imports, argument parsing, restoring a checkpoint) is a
  quiet stop with exit status 0, as it is once the service runs: an orchestrator that scales a
  job down while a pod starts sees no traceback. The service's loop installs its own handlers
  once it runs; those stop it gracefully.
- A listen address is tried before gRPC gets it, so a port in use is one line naming the address
  (``ClusterConfigError``, exit 2 through `exit_on_config_error`) rather than gRPC's generic
  "Failed to bind" and its C-core log line.
- A child of ``pshard launch`` stops when the launcher dies, even by SIGKILL (`die_with_launcher`):
  the launcher starts each child in its own session, so nothing else would reach it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import sys
from collections.abc import Mapping
from types import FrameType

from pshard.common.errors import ClusterConfigError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Set by the launcher in every child's environment: the pid the child must not outlive.
LAUNCHER_PID_ENV = "PSHARD_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _stop_quietly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def stop_quietly_on_signals() -> None:
    """Until the service's loop installs its own, SIGTERM and SIGINT end the process with status 0.

    Call it from the main thread of a process that is an entry point, as early as possible: it
    changes process-wide signal dispositions.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_quietly)


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """Have the kernel send SIGTERM to this process when its parent, the launcher, dies.

    Only for a process that `environ` marks as a launcher's child, on Linux. The SIGTERM then
    takes the service's usual graceful stop. A launcher that died before the request took effect
    is caught by looking for its pid. Elsewhere (no prctl) this does nothing.
    """
    pid_text = environ.get(LAUNCHER_PID_ENV, "")
    if not pid_text.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
    except PermissionError:  # alive, under another user
        pass


def metrics_address(bind: str, port: int) -> str:
    """Where a service listening on `bind` serves its metrics: the same host, `port`."""
    host = bind.rpartition(":")[0] or "0.0.0.0"
    return f"{host}:{port}"


def check_can_listen(address: str) -> None:
    """Raise ClusterConfigError naming `address` if nothing could listen there now.

    gRPC servers here bind without SO_REUSEPORT (common.rpc.options.server_options), so a port that
    another process listens on fails the same way in gRPC a moment later. SO_REUSEADDR, as gRPC
    sets it, lets a restarted service take back a port that still has connections in TIME_WAIT.
    Port 0 (any free port) always succeeds.
    """
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise ClusterConfigError(f"cannot listen on {address!r}: {port_text!r} is not a port") from None
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ClusterConfigError(f"cannot listen on {address}: {err.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as err:
                reason = "address already in use" if err.errno == errno.EADDRINUSE else err.strerror
                raise ClusterConfigError(f"cannot listen on {address}: {reason}") from None
