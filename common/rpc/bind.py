"""Where a service listens when no ``--bind`` is given (docs/architecture.md, 13 Security).

Where TF_CONFIG says this task lives, when that host is an address of this machine (an IP of one of
its interfaces, or a name resolving to one; ``localhost`` stays loopback): the address other hosts
reach it by, and only that one (issue 24: a bare host bound 127.0.0.1 while TF_CONFIG named its
network address, and peers got "connection refused"). When TF_CONFIG's host is not an address of this
machine (a NAT'd name, a Kubernetes ClusterIP service): every interface, said in the log, so
``--bind`` can pin it. Without TF_CONFIG: the loopback interface outside a container or pod, so a job
started on a laptop or a shared host is not reachable from the network by accident; inside one
(``/.dockerenv``, or ``KUBERNETES_SERVICE_HOST`` set) every interface, as before.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("pshard.bind")


def in_container(environ: Mapping[str, str], dockerenv: str = "/.dockerenv") -> bool:
    return os.path.exists(dockerenv) or bool(environ.get("KUBERNETES_SERVICE_HOST"))


def _local_ip(host: str) -> str | None:
    """`host`'s address if it is one of this machine's (binding to it works), else None."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((ip, 0))
        except OSError:
            continue
        return f"[{ip}]" if family == socket.AF_INET6 else ip
    return None


def own_hosts(own_address: str | None) -> list[str]:
    """The host of a task's cluster address, for its certificate's names (none without one)."""
    return [own_address.rsplit(":", 1)[0].strip("[]")] if own_address else []


def default_bind(listen_address: str, own_address: str | None, environ: Mapping[str, str] | None = None,
                 *, dockerenv: str = "/.dockerenv") -> str:
    """The listen address for a task whose every-interface address is `listen_address`
    (ClusterSpec.listen_address, e.g. ``0.0.0.0:7100``) and whose cluster address is `own_address`."""
    env = os.environ if environ is None else environ
    port = listen_address.rsplit(":", 1)[1]
    host = own_address.rsplit(":", 1)[0].strip("[]") if own_address else ""
    if not host:
        if in_container(env, dockerenv):
            log.info("no cluster address: listening on every interface (%s); --bind pins it", listen_address)
            return listen_address
        return f"[::1]:{port}" if listen_address.startswith("[") else f"127.0.0.1:{port}"
    local = _local_ip(host)
    if local is None:
        log.warning("%s (this task's TF_CONFIG host) is not an address of this machine: listening on every "
                    "interface (%s) so peers reach it however it is routed; --bind HOST:PORT pins it", host,
                    listen_address)
        return listen_address
    return f"{local}:{port}"
