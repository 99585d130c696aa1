"""gRPC channel/server options and the Exchange method's raw (identity) serializers."""

from __future__ import annotations

# Unary messages (Declare/Push/Pull from plain clients) may be this large. Bigger
# payloads use the Exchange stream, whose frames stay at CHUNK_BYTES.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
# 4 MiB frames: on these machines a stream of 1-4 MiB messages moves bytes several
# times faster than one huge message, and the layout's slices fit in one frame.
CHUNK_BYTES = 4 * 2**20
# Room for a frame's own header on top of a full chunk.
FRAME_SLACK_BYTES = 64 * 1024

EXCHANGE_METHOD = "/pshard.api.v1.ParameterServerService/Exchange"


def _common(max_message_bytes: int) -> list[tuple[str, int]]:
    limit = max(max_message_bytes, CHUNK_BYTES + FRAME_SLACK_BYTES)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # Keepalive well under common 4-10 min idle cut-offs of NATs and load balancers (gRPC's
        # default is 2 h), so a sync pull that waits minutes for a slow peer keeps its connection.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        *_common(max_message_bytes),
        # Accept the clients' 30 s keepalive pings instead of answering GOAWAY "too_many_pings".
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # A restarted server must be able to take its port back at once.
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        *_common(max_message_bytes),
        # Back off at most 2 s between reconnects, so a restarted server is found quickly.
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        # Connections of this channel's own. gRPC otherwise shares one per (target, options) among
        # the process's channels, with its state: a new channel to a server restarted at a dead
        # one's address inherited the dead one's "connection refused" and backoff, and its first
        # calls failed at once (seen in CI: a test's stats call, a port an earlier test had used).
        ("grpc.use_local_subchannel_pool", 1),
    ]


def identity(data: bytes) -> bytes:
    """Exchange frames are encoded by common.wire.codec; grpc must pass them through untouched."""
    return data
