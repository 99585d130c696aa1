"""Real parameter servers for the service tests: in-process, on 127.0.0.1 port 0, stopped after each test.

Tests talk to them through real channels: plain generated stubs for the unary methods,
raw frames for Exchange (the `wire` fixture) and PSClient. Every wait has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig
from pshard.common.rpc.options import DEFAULT_MAX_MESSAGE_BYTES, EXCHANGE_METHOD, channel_options, identity
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import codec
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.api.v1 import tensor_pb2

# Upper bound for anything that should take milliseconds; only a hang ever uses it up.
WAIT_S = 10.0


@pytest.fixture
def quick_scheduler() -> Iterator[SchedulerHandle]:
    """A real scheduler in this process: heartbeats every 50 ms, nobody declared dead for 10 s."""
    handle = start_scheduler_thread(heartbeat_interval_s=0.05, heartbeat_timeout_s=10.0)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """start_server(settings, bind=..., max_message_bytes=...) -> a running ServerThread."""
    servers: list[ServerThread] = []

    def start(settings: ServerSettings | None = None, *, bind: str = "127.0.0.1:0",
              max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ServerThread:
        server = start_server_thread(settings or ServerSettings(), bind, max_message_bytes)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0.2)


@pytest.fixture
def new_client() -> Iterator[Callable[..., PSClient]]:
    """new_client(servers, worker_id, **kwargs) -> a PSClient closed after the test."""
    clients: list[PSClient] = []

    def make(servers: Sequence[ServerThread | str], worker_id: str, **kwargs: object) -> PSClient:
        kwargs.setdefault("timeout_s", WAIT_S)
        kwargs.setdefault("retry_budget_s", WAIT_S)
        addresses = [s if isinstance(s, str) else s.address for s in servers]
        client = PSClient(addresses, worker_id, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


class Wire:
    """Plain gRPC access to parameter servers: generated stubs and raw Exchange frames."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def channel(self, server: ServerThread | str) -> grpc.Channel:
        address = server if isinstance(server, str) else server.address
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address, options=channel_options())
        return self._channels[address]

    def stub(self, server: ServerThread | str) -> pb_grpc.ParameterServerServiceStub:
        return pb_grpc.ParameterServerServiceStub(self.channel(server))

    def exchange(self, server: ServerThread | str, frames: Iterable[bytes],
                 timeout_s: float = WAIT_S) -> list[bytes]:
        """Send `frames` on one Exchange stream; every frame the server answers (raises RpcError)."""
        call = self.channel(server).stream_stream(
            EXCHANGE_METHOD, request_serializer=identity, response_deserializer=identity)
        return list(call(iter(list(frames)), timeout=timeout_s))

    def stats(self, server: ServerThread | str) -> pb.GetStatsResponse:
        return self.stub(server).GetStats(pb.GetStatsRequest(), timeout=WAIT_S)

    def wait_stats(self, server: ServerThread | str, condition: Callable[[pb.GetStatsResponse], bool],
                   what: str) -> pb.GetStatsResponse:
        """Poll GetStats until `condition` holds (e.g. a pull is parked); fail after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            stats = self.stats(server)
            if condition(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached within {WAIT_S} s; last stats: {stats}")
            time.sleep(0.005)

    # ---- building requests ----

    @staticmethod
    def stamp(worker: str, clock: int, generation: int = 0) -> pb.Stamp:
        return codec.stamp_to_proto(Stamp(worker, generation, clock))

    @staticmethod
    def tensor(key: str, array: np.ndarray, part: int = 0) -> tensor_pb2.SliceTensor:
        wire_array = codec.WireArray(array, codec.dtype_name_of(array))
        return codec.slice_tensor_to_proto(SliceKey(key, part), wire_array)

    @classmethod
    def push_request(cls, worker: str, clock: int, grads: dict[str, np.ndarray],
                     generation: int = 0) -> pb.PushRequest:
        return pb.PushRequest(stamp=cls.stamp(worker, clock, generation),
                              gradients=[cls.tensor(k, v) for k, v in grads.items()])

    @staticmethod
    def slice_id(key: str, part: int = 0) -> tensor_pb2.SliceId:
        return codec.slice_id_to_proto(SliceKey(key, part))

    @staticmethod
    def meta(key: str, dtype: str, shape: Sequence[int], part: int = 0) -> pb.SliceMeta:
        return pb.SliceMeta(id=codec.slice_id_to_proto(SliceKey(key, part)),
                            dtype=codec.dtype_to_proto(dtype), shape=list(shape))

    @staticmethod
    def header_frame(**fields: Any) -> bytes:  # ExchangeHeader's own keyword arguments, each its own type
        return codec.encode_frame(pb.ExchangeRequest(header=pb.ExchangeHeader(**fields)))

    @staticmethod
    def data_frame(*parts: bytes | np.ndarray) -> bytes:
        return codec.encode_data_frame(parts)

    @staticmethod
    def summary(frames: Sequence[bytes]) -> pb.ExchangeSummary:
        last = codec.decode_response_frame(frames[-1])
        assert last.WhichOneof("body") == "summary", f"last frame is {last.WhichOneof('body')}"
        return last.summary

    def declare(self, server: ServerThread | str, job: JobConfig | None,
                params: dict[str, np.ndarray]) -> pb.DeclareResponse:
        request = pb.DeclareRequest(slices=[self.tensor(k, v) for k, v in params.items()])
        if job is not None:
            request.config.CopyFrom(codec.job_to_proto(job))
        return self.stub(server).Declare(request, timeout=WAIT_S)

    def read(self, server: ServerThread | str, keys: Iterable[str], worker: str = "w0",
             generation: int = 0, clock: int = 0) -> dict[str, tuple[bytes, int]]:
        """Each key's stored bytes and version, read back through a plain unary Pull."""
        keys = list(keys)
        reply = self.stub(server).Pull(pb.PullRequest(
            stamp=self.stamp(worker, clock, generation), slices=[self.slice_id(k) for k in keys]),
            timeout=WAIT_S)
        return {s.id.key: (s.tensor.data, s.version) for s in reply.slices}

    @staticmethod
    def array(reply_slice: tensor_pb2.SliceTensor) -> np.ndarray:
        return codec.tensor_from_proto(reply_slice.tensor).array


@pytest.fixture
def wire() -> Iterator[Wire]:
    helper = Wire()
    yield helper
    helper.close()

