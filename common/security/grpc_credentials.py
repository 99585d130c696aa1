"""The gRPC half of `SecurityConfig` (pshard.common.security.credentials): server credentials that follow
certificate rotation, and client channels carrying TLS and the token.

Apart from the configuration so that parsing the security flags loads no grpc: every command's --help and
usage errors come before it (importing grpc costs a few hundred ms on a loaded host). `SecurityConfig`'s
methods import this module when a process first serves or dials.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from pshard.common.security.credentials import check_pair

log = logging.getLogger("pshard.security")

TOKEN_METADATA_KEY = "authorization"
_BEARER = "Bearer "


def rotating_server_credentials(cert: Path, key: Path, ca: Path, *,
                                require_client_certificate: bool) -> grpc.ServerCredentials:
    """Dynamic server credentials: the key and chain are re-read when their files change."""
    fetcher = _CertificateFetcher(cert, key, ca)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial(), fetcher, require_client_authentication=require_client_certificate)


def tls_channel_credentials(ca: bytes, key: bytes, cert: bytes, token: str | None) -> grpc.ChannelCredentials:
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if token is None:
        return creds
    return grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_TokenPlugin(token)))


def secure_channel(target: str, credentials: grpc.ChannelCredentials,
                   options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    return grpc.secure_channel(target, credentials, options=list(options))


def plain_channel(target: str, token: str | None, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    channel = grpc.insecure_channel(target, options=list(options))
    if token is None:
        return channel
    # Call credentials need a secure channel; without TLS the token rides in plain metadata.
    return grpc.intercept_channel(channel, _TokenMetadata(token))


class _CertificateFetcher:
    """gRPC asks at every handshake; a new configuration is returned only when a file's mtime moved."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        self._files = (cert, key, ca)
        self._lock = threading.Lock()
        self._stamp = self._mtimes()

    def _mtimes(self) -> tuple[int, ...]:
        return tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in self._files)

    def _config(self) -> Any:
        cert, key, ca = (p.read_bytes() for p in self._files)
        check_pair(cert, key)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def initial(self) -> Any:
        return self._config()

    def __call__(self) -> Any:
        with self._lock:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            try:
                config = self._config()
            except (OSError, ValueError) as e:  # half-written files: keep serving the old ones
                log.warning("TLS files changed but cannot be read yet (%s); keeping the current ones", e)
                return None
            self._stamp = stamp
            log.info("TLS certificate files changed: new handshakes use them")
            return config


class _TokenPlugin(grpc.AuthMetadataPlugin):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._metadata = ((TOKEN_METADATA_KEY, _BEARER + token),)

    def __call__(self, context: Any, callback: Any) -> None:
        callback(self._metadata, None)


def _with_token(details: Any, token: str) -> Any:
    metadata = [*(details.metadata or ()), (TOKEN_METADATA_KEY, _BEARER + token)]
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
        getattr(details, "compression", None))


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._token), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_token(details, self._token), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_token(details, self._token), requests)
