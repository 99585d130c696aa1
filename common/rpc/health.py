"""A standard gRPC health probe: `pshard health HOST:PORT [--service NAME] [--timeout-s S]`.

(`python -m pshard.common.rpc.health` is the same probe.)

Exit 0 when the server answers SERVING; exit 1 otherwise, with one line on stderr saying
why. That is the contract of a Docker (or Kubernetes exec) health check, and it keeps the
images free of a separate grpc_health_probe binary. It speaks grpc.health.v1, so it probes
any gRPC server that registers the standard health service, not only pshard's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pshard.common.argtypes import positive_float
from pshard.common.errors import PSError
from pshard.common.security.credentials import SecurityConfig, add_security_arguments, security_from_args

DEFAULT_TIMEOUT_S = 3.0


def probe(target: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
          security: SecurityConfig | None = None) -> tuple[bool, str]:
    """(serving, one-line reason). `service` "" asks about the server as a whole. A TLS server needs
    `security` for the handshake (the container's PSHARD_TLS_* files); the health service itself
    asks for no role."""
    # grpc loads here rather than with the module: `pshard health --help` and its usage errors come first.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = f"service {service!r}" if service else "server"
    with (security or SecurityConfig()).channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # No wait_for_ready: a closed port fails at once with UNAVAILABLE instead of
            # using up the whole timeout, and the health check's own retries do the waiting.
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False, f"{target}: {name}: no answer within {timeout_s:g}s"
            status = code.name if code is not None else "ERROR"
            detail = _one_line(details or "")
            return False, f"{target}: {name}: {status}" + (f": {detail}" if detail else "")
    status_name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {name}: {status_name}"


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m pshard.common.rpc.health") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Ask a gRPC server's standard health service (grpc.health.v1) whether it is SERVING. "
        "Exit 0 if so, 1 otherwise with a one-line reason on stderr.",
    )
    parser.add_argument(
        "target", metavar="HOST:PORT", type=_target, help="address of the server, e.g. localhost:7100"
    )
    parser.add_argument(
        "--service", default="", help="service name to ask about (default: the server as a whole)"
    )
    parser.add_argument(
        "--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S, help="deadline of the check, seconds"
    )
    add_security_arguments(parser)
    try:
        args = parser.parse_args(argv)
        security = security_from_args(args)
    except SystemExit as exc:
        # argparse exits 2 on a usage error, but Docker reserves health-check exit code 2;
        # a misconfigured probe is simply "not healthy". --help still exits 0.
        return 1 if exc.code else 0
    except PSError as exc:  # unreadable TLS files: not healthy, and why
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    serving, reason = probe(args.target, args.service, args.timeout_s, security)
    print(reason, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


def _target(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return value


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
