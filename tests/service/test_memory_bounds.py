"""Bounded memory and backpressure of a real parameter server (issue 7).

- the requests of defect 4 (an Exchange header that promises 1 GiB; a pull naming one slice
  thousands of times) leave the process's RSS where it was;
- past its in-flight byte budget a server refuses with RESOURCE_EXHAUSTED and a retry hint, and
  PSClient waits and retries until the call goes through;
- every timeout_ms is honoured, declares and pushes over Exchange included.

The servers run in this process, so RSS is this process's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import OverloadedError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.options import EXCHANGE_METHOD, channel_options, identity
from pshard.common.rpc.status import RETRY_AFTER_KEY, error_from_rpc_error
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from tests.service.conftest import WAIT_S

MIB = 2**20
ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1))
SYNC = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
# A wait the server must end by itself (timeout_ms); the client's gRPC deadline is far longer.
TINY_MS = 100
DECLARE, PUSH_PULL = pb.EXCHANGE_OP_DECLARE, pb.EXCHANGE_OP_PUSH_PULL


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class HeldStream:
    """An Exchange call whose request frames are sent one by one, and kept open until `close()`."""

    def __init__(self, channel: grpc.Channel, timeout_s: float = WAIT_S) -> None:
        self._frames: queue.Queue[bytes | None] = queue.Queue()
        call = channel.stream_stream(EXCHANGE_METHOD, request_serializer=identity,
                                     response_deserializer=identity)
        self.call = call(self._requests(), timeout=timeout_s)
        self.replies: list[bytes] = []
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[bytes]:
        while (frame := self._frames.get()) is not None:
            yield frame

    def _read(self) -> None:
        try:
            self.replies.extend(self.call)
        except grpc.RpcError as err:
            self.error = err

    def send(self, frame: bytes) -> None:
        self._frames.put(frame)

    def result(self) -> list[bytes]:
        """The replies once the server ended the call (the request side may still be open)."""
        self._reader.join(WAIT_S)
        assert not self._reader.is_alive(), "the server did not end the stream"
        if self.error is not None:
            raise self.error
        return self.replies

    def close(self) -> grpc.RpcError | None:
        """End the request side; the call's error, if it failed."""
        self._frames.put(None)
        self._reader.join(WAIT_S)
        assert not self._reader.is_alive(), "the server did not end the stream"
        return self.error


def wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {WAIT_S} s")
        time.sleep(0.005)


# ---- defect 4: memory spent on a promise ----

def test_exchange_headers_promising_a_gibibyte_cost_no_memory(start_server, wire):
    server = start_server(ServerSettings(default_job=ASYNC))
    wire.declare(server, ASYNC, {"w": np.zeros(16, np.float32)})
    header = wire.header_frame(op=DECLARE, push=[wire.meta("huge", "float32", [2**28])], timeout_ms=5000)
    before = rss_bytes()
    streams = []
    for _ in range(3):  # three at once held 3 GiB before the fix
        stream = HeldStream(wire.channel(server))
        stream.send(header)
        stream.send(wire.data_frame(np.ones(256, np.float32)))  # ~1 KB of the promised 1 GiB
        streams.append(stream)
    wait_for(lambda: server.running.budget.in_flight >= 3 * 1024, "the three streams' first data arrived")
    during = rss_bytes()
    codes = [s.close().code() for s in streams]  # type: ignore[union-attr]
    after = rss_bytes()
    print(f"RSS before {before / MIB:.1f} MiB, with 3 streams open {during / MIB:.1f} MiB, "
          f"after {after / MIB:.1f} MiB")
    assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}  # the stream ended short of its promise
    assert during - before < 50 * MIB
    assert after - before < 50 * MIB
    assert server.running.budget.in_flight == 0


@pytest.mark.parametrize("how", ["Pull", "PushPull", "Exchange"])
def test_a_pull_naming_one_slice_thousands_of_times_is_refused_naming_it(start_server, wire, how):
    server = start_server(ServerSettings(default_job=ASYNC))
    wire.declare(server, ASYNC, {"w": np.zeros(MIB // 4, np.float32)})  # 1 MiB
    ids = [wire.slice_id("w")] * 5000  # 5 GB of replies before the fix
    before = rss_bytes()
    with pytest.raises(grpc.RpcError) as caught:
        if how == "Pull":
            wire.stub(server).Pull(pb.PullRequest(stamp=wire.stamp("w0", 0), slices=ids), timeout=WAIT_S)
        elif how == "PushPull":
            wire.stub(server).PushPull(pb.PushPullRequest(stamp=wire.stamp("w0", 0), pull=ids),
                                       timeout=WAIT_S)
        else:
            wire.exchange(server, [wire.header_frame(op=PUSH_PULL, stamp=wire.stamp("w0", 0), pull=ids)])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "slice 'w' named 5000 times" in caught.value.details()
    assert rss_bytes() - before < 50 * MIB


def server_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_refused_requests_leave_no_memory_behind(procs, wire):
    """A refused request's bytes are freed when it ends, not when the cyclic GC gets round to it
    (grpc's abort kept each one in a reference cycle: a flood of refusals held 2 GiB).

    The server is a process of its own, so its RSS is not mixed with the senders' malloc arenas or
    with the other in-process servers of the test session. Its tarpit is off: it would refuse most of
    these requests unread (ps_server.transport.tarpit), and this is about the ones that are read."""
    server = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--no-scheduler",
                          "--workers", "w0", "--mode", "async", "--lr", "0.1", "--waste-limit-mb", "0",
                          "--log-level", "WARNING")
    port = int(server.wait_for_line(r"listening on port (\d+)", WAIT_S).group(1))
    address = f"127.0.0.1:{port}"
    with PSClient([address], "w0", timeout_s=WAIT_S, transport="grpc") as client:
        client.declare({"w": np.zeros(16, np.float32)}, ASYNC)
    refused = wire.push_request("w0", 0, {"nope": np.ones(MIB, np.float32)}).SerializeToString()
    channel = grpc.insecure_channel(address, options=channel_options())
    call = channel.unary_unary("/pshard.api.v1.ParameterServerService/Push",
                               request_serializer=identity, response_deserializer=identity)

    def send(count: int) -> None:
        for _ in range(count):
            with pytest.raises(grpc.RpcError) as caught:
                call(refused, timeout=WAIT_S)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    try:
        send(8)  # warm up grpc's and numpy's own buffers
        before = server_rss_bytes(server.pid)
        senders = [threading.Thread(target=send, args=(25,)) for _ in range(8)]  # 800 MiB in all
        for t in senders:
            t.start()
        for t in senders:
            t.join(WAIT_S * 3)
        deadline = time.monotonic() + WAIT_S
        while (grown := server_rss_bytes(server.pid) - before) >= 50 * MIB and time.monotonic() < deadline:
            time.sleep(0.05)  # the heap is trimmed once the burst is over
    finally:
        channel.close()
    assert grown < 50 * MIB, f"server RSS grew {grown / MIB:.0f} MiB after 200 refused 4 MiB pushes"


# ---- backpressure ----

def hog(wire, server, nbytes: int) -> HeldStream:
    """An Exchange push that sent `nbytes` of a bigger slice and waits: those bytes stay in flight."""
    wire.declare(server, ASYNC, {"hog": np.zeros(4 * MIB, np.float32)})  # alone: admitted past the budget
    stream = HeldStream(wire.channel(server))
    stream.send(wire.header_frame(op=PUSH_PULL, stamp=wire.stamp("hog", 0), timeout_ms=int(WAIT_S * 1000),
                                  push=[wire.meta("hog", "float32", [4 * MIB])]))
    stream.send(wire.data_frame(np.zeros(nbytes // 4, np.float32)))
    wait_for(lambda: server.running.budget.in_flight >= nbytes, "the hog's bytes are in flight")
    return stream


def test_past_its_budget_a_server_refuses_with_a_retry_hint_naming_the_budget(start_server, wire):
    server = start_server(ServerSettings(default_job=ASYNC, max_inflight_bytes=4 * MIB))
    wire.declare(server, ASYNC, {"w": np.zeros(MIB // 4, np.float32)})
    stream = hog(wire, server, 3 * MIB)
    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones(MIB // 4, np.float32)}),
                               timeout=WAIT_S)
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3.0 MiB in flight + 1.0 MiB requested > --max-inflight-mb 4.0 MiB" in err.details()
    hint = dict(err.trailing_metadata())[RETRY_AFTER_KEY]
    mapped = error_from_rpc_error(err)
    assert isinstance(mapped, OverloadedError) and mapped.retry_after_ms == int(hint) > 0
    assert wire.read(server, ["w"])["w"][1] == 0  # refused: nothing applied
    stream.close()
    assert server.running.budget.in_flight == 0
    wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones(MIB // 4, np.float32)}), timeout=WAIT_S)
    assert wire.read(server, ["w"])["w"][1] == 1


@pytest.mark.parametrize("floats", [MIB // 16, MIB], ids=["unary", "exchange"])
def test_client_backs_off_and_retries_until_the_server_has_room(start_server, new_client, wire, floats):
    server = start_server(ServerSettings(default_job=ASYNC, max_inflight_bytes=4 * MIB))
    client = new_client([server], "w0", transport="grpc")  # the budget guards the gRPC path
    client.declare({"w": np.zeros(floats, np.float32)}, ASYNC)
    stream = hog(wire, server, 4 * MIB - 1024)
    step = threading.Thread(target=client.push_pull, args=({"w": np.ones(floats, np.float32)}, 0),
                            daemon=True)
    step.start()
    wait_for(lambda: client.overload_retries >= 2, "the client was refused and retried")
    assert step.is_alive()
    stream.close()  # room again
    step.join(WAIT_S)
    assert not step.is_alive()
    assert client.last_result is not None and client.last_result.applied == 1
    assert server.running.budget.refused >= 2


def test_client_gives_up_at_its_deadline_with_the_servers_error(start_server, new_client, wire):
    server = start_server(ServerSettings(default_job=ASYNC, max_inflight_bytes=4 * MIB))
    client = new_client([server], "w0", timeout_s=0.5, transport="grpc")
    client.declare({"w": np.zeros(1024, np.float32)}, ASYNC)
    stream = hog(wire, server, 4 * MIB - 1024)
    started = time.monotonic()
    with pytest.raises(OverloadedError, match="--max-inflight-mb"):
        client.push_pull({"w": np.ones(1024, np.float32)}, 0)
    assert time.monotonic() - started < 0.5 + 0.5
    stream.close()


# ---- every timeout_ms is honoured ----

def ended_by_server(call: object) -> grpc.RpcError:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    assert time.monotonic() - started < 3.0, "the server did not end the call at its timeout_ms"
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    return caught.value


@pytest.fixture
def sync_server(start_server, wire):
    server = start_server(ServerSettings(default_job=SYNC, static_quorum={"w0": 0, "w1": 0},
                                         checkpoint_dir=None))
    wire.declare(server, SYNC, {"w": np.zeros(8, np.float32)})
    return server


def test_pull_timeout_ms(sync_server, wire):
    ended_by_server(lambda: wire.stub(sync_server).Pull(pb.PullRequest(
        stamp=wire.stamp("w0", 1), slices=[wire.slice_id("w")], timeout_ms=TINY_MS), timeout=WAIT_S))


def test_push_pull_timeout_ms(sync_server, wire):
    ended_by_server(lambda: wire.stub(sync_server).PushPull(pb.PushPullRequest(
        stamp=wire.stamp("w0", 0), gradients=[wire.tensor("w", np.ones(8, np.float32))],
        pull=[wire.slice_id("w")], timeout_ms=TINY_MS), timeout=WAIT_S))


def test_checkpoint_timeout_ms(start_server, wire, tmp_path):
    server = start_server(ServerSettings(default_job=SYNC, static_quorum={"w0": 0},
                                         checkpoint_dir=str(tmp_path)))
    wire.declare(server, SYNC, {"w": np.zeros(8, np.float32)})
    ended_by_server(lambda: wire.stub(server).Checkpoint(pb.CheckpointRequest(
        at_version=5, timeout_ms=TINY_MS), timeout=WAIT_S))


@pytest.mark.parametrize("op", ["push", "declare", "pull"])
def test_exchange_timeout_ms_ends_a_stream_whose_data_never_comes(sync_server, wire, op):
    if op == "declare":
        header = wire.header_frame(op=DECLARE, push=[wire.meta("v", "float32", [8])], timeout_ms=TINY_MS)
    elif op == "push":
        header = wire.header_frame(op=PUSH_PULL, stamp=wire.stamp("w0", 0), timeout_ms=TINY_MS,
                                   push=[wire.meta("w", "float32", [8])])
    else:
        header = wire.header_frame(op=PUSH_PULL, stamp=wire.stamp("w0", 1), timeout_ms=TINY_MS,
                                   pull=[wire.slice_id("w")])
    stream = HeldStream(wire.channel(sync_server))
    stream.send(header)  # and nothing more, the request side held open
    ended_by_server(stream.result)
    stream.close()
