"""Fuzzing the fast paths' framing on a live server: raw TCP frames and shared-memory doorbell frames.

Each case is one frame after a valid hello: its 20-byte header (magic, kind, metadata and data lengths:
true, or anything up to 2**64 - 1), its metadata (an ExchangeHeader generated, mutated from a valid one,
or raw bytes) and its data (over TCP inline, over shared memory written into the segment). After every
case: the server's thread is alive, health answers SERVING, the reply (if any) is a proper refusal (not
an "internal error", the fast paths' UNKNOWN), a request that was not accepted left the stored weights
and the sparse table as they were, and RSS stays within budget. A complete frame (its lengths true) is
answered or its connection closed within NO_HANG_S; one that announces more than it sends is never
served, and its connection is closed here after a short wait. The server runs with the tarpit off and
on (as deployed: a session whose requests keep being refused is not read for a while).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import strategies as st
from pshard.common.job import JobConfig
from pshard.common.rpc.options import channel_options
from pshard.common.wire import fastwire, shm

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import sparse_pb2, sparse_pb2_grpc, tensor_pb2
from tests.fuzz.exchange import claimed_sizes
from tests.fuzz.harness import (
    NO_HANG_S,
    assert_rss_within,
    assert_serving,
    describe,
    rss_bytes,
    run_cases,
)
from tests.fuzz.strategies import messages, mutated, raw_bytes, weighted
from tests.service.conftest import ServerSettings, ServerThread, Wire, start_server_thread

MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(3, dtype=np.float32)}
TABLE, DIM = "emb", 4
IDS = np.array([1, 2, 3], np.int64)
WORKER = "w0"
READER = "fuzz-fast-reader"
REGION_BYTES = 64 * 1024
CASES = 150  # per transport in make test (a third of it under the tarpit)
SHORT_WAIT_S = 0.2  # a frame that announces more than it sends: how long to see whether it is closed
F32, I64 = tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_INT64
TARPITS = {"tarpit-off": 0, "tarpit-on": 4 * 2**20}
_HEADER = struct.Struct("<4sB3xIQ")  # common/wire/fastwire.py's frame header, any field any value


def _meta(key: str, dtype: tensor_pb2.Dtype, shape: list[int]) -> pb.SliceMeta:
    return pb.SliceMeta(id=tensor_pb2.SliceId(key=key), dtype=dtype, shape=shape)


def seed_headers() -> list[pb.ExchangeHeader]:
    stamp = pb.Stamp(worker_id=WORKER)
    pulled = [tensor_pb2.SliceId(key=k) for k in MODEL]
    return [
        pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=stamp, pull=pulled,
                          push=[_meta(k, F32, list(v.shape)) for k, v in MODEL.items()]),
        pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=stamp, pull=pulled),
        pb.ExchangeHeader(op=pb.EXCHANGE_OP_TABLE, stamp=stamp,
                          table=pb.TableRequest(table=TABLE, push=True, pull=True, push_id=5),
                          push=[_meta("ids", I64, [3]), _meta("grads", F32, [3, DIM]),
                                _meta("pull", I64, [3])]),
        pb.ExchangeHeader(op=pb.EXCHANGE_OP_TABLE, stamp=stamp, table=pb.TableRequest(table=TABLE, pull=True),
                          push=[_meta("pull", I64, [3])]),
    ]


@dataclass(frozen=True)
class Frame:
    magic: bytes
    kind: int
    meta: bytes
    meta_len: int
    data_len: int
    data: bytes  # over TCP sent after the metadata; over shared memory written into the segment
    inline: bool  # TCP

    @property
    def complete(self) -> bool:
        """Its lengths are true: the server has all it announces, and must answer or close."""
        return self.meta_len == len(self.meta) and (self.data_len == len(self.data) or not self.inline)

    def wire(self) -> bytes:
        head = _HEADER.pack(self.magic, self.kind, self.meta_len, self.data_len)
        return head + self.meta + (self.data if self.inline else b"")

    def __repr__(self) -> str:
        return (f"Frame(magic {self.magic!r}, kind {self.kind}, meta {self.meta_len} announced / "
                f"{len(self.meta)} sent {describe(self.meta)}, data {self.data_len} announced / "
                f"{len(self.data)})")


def _payload(draw: st.DrawFn, header: pb.ExchangeHeader | None) -> bytes:
    sizes = claimed_sizes(header) if header is not None else None
    if sizes is None or sum(sizes) > REGION_BYTES or not draw(st.integers(0, 4)):
        return draw(st.binary(max_size=512))
    if header is not None and header.op == pb.EXCHANGE_OP_TABLE:
        # Real ids and small finite gradients, so that the table's own checks past the sizes are reached.
        return b"".join((IDS.tobytes() if m.dtype == I64 and n == 24 else
                         np.full(n // 4, 0.01, np.float32).tobytes() if n % 4 == 0 else bytes(n))
                        for m, n in zip(header.push, sizes, strict=True))
    floats = draw(st.sampled_from((0.01, -1e-3, float("nan"), 1e38)))
    return np.full(sum(sizes) // 4, floats, np.float32).tobytes() + bytes(sum(sizes) % 4)


@st.composite
def frames(draw: st.DrawFn, inline: bool) -> Frame:
    seeds = seed_headers()
    header: pb.ExchangeHeader | None = draw(weighted((5, mutated(seeds)), (2, st.sampled_from(seeds)),
                                                     (2, messages(pb.ExchangeHeader.DESCRIPTOR)),
                                                     (1, st.none())))
    meta = header.SerializeToString() if header is not None else draw(raw_bytes(seeds))
    data = _payload(draw, header)
    extremes = st.sampled_from((0, 1, 2**31, 2**32, 2**49, 2**62, 2**64 - 1, REGION_BYTES, REGION_BYTES + 1))
    true_len = len(data) if inline else 0
    data_len = draw(weighted((8, st.just(true_len)), (1, extremes), (1, st.integers(0, 2**64 - 1))))
    if inline and data_len < len(data):
        data = data[:data_len]  # what follows the data is the next frame: never more than announced
    meta_len = draw(weighted((12, st.just(len(meta))), (1, st.sampled_from(
        (0, max(0, len(meta) - 1), len(meta) + 1, fastwire.MAX_META_BYTES, fastwire.MAX_META_BYTES + 1))),
        (1, st.integers(0, 2**32 - 1))))
    meta_len = max(meta_len, len(meta)) if inline else meta_len  # a shorter one would cut the metadata
    magic = draw(weighted((20, st.just(b"PSF1")), (1, st.binary(min_size=4, max_size=4))))
    kind = draw(weighted((20, st.just(fastwire.REQUEST)), (1, st.integers(0, 255))))
    return Frame(magic, kind, meta, meta_len, data_len, data, inline)


@dataclass
class FastSession:
    sock: socket.socket
    segment: shm.Segment | None = None

    def close(self) -> None:
        self.sock.close()
        if self.segment is not None:
            self.segment.close()


@dataclass
class LiveFast:
    server: ServerThread
    wire: Wire
    reader: grpc.Channel
    shm_dir: Path
    rss_baseline: int
    weights: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    table: tuple[int, bytes] = (0, b"")
    sessions: dict[str, FastSession] = field(default_factory=dict)

    def state(self) -> tuple[dict[str, tuple[bytes, int]], tuple[int, bytes]]:
        stub = sparse_pb2_grpc.SparseTablesServiceStub(self.reader)
        rows = stub.GetTableStats(sparse_pb2.GetTableStatsRequest(table=TABLE), timeout=NO_HANG_S).rows
        pulled = stub.PullRows(sparse_pb2.PullRowsRequest(table=TABLE, ids=IDS.tobytes(), worker_id=READER),
                               timeout=NO_HANG_S).rows
        return self.wire.read(self.server, MODEL, worker=READER), (rows, pulled)

    def session(self, kind: str) -> FastSession:
        """The open session of `kind` (one claim per session: a new one after a connection is closed)."""
        if kind not in self.sessions:
            opened = self.wire.stub(self.server).OpenTransport(pb.OpenTransportRequest(
                worker_id=WORKER, kind=pb.TRANSPORT_KIND_TCP if kind == "tcp" else pb.TRANSPORT_KIND_SHM,
                request_bytes=REGION_BYTES, reply_bytes=REGION_BYTES), timeout=NO_HANG_S)
            hello = pb.TransportHello(session=opened.session, secret=opened.secret).SerializeToString()
            if kind == "tcp":
                sock = socket.create_connection(("127.0.0.1", opened.port), timeout=NO_HANG_S)
                fastwire.send_frame(sock, fastwire.HELLO, hello)
                self.sessions[kind] = FastSession(sock)
            else:
                segment = shm.Segment.create(REGION_BYTES, REGION_BYTES)
                sock = shm.connect(self.shm_dir / opened.socket, NO_HANG_S)
                shm.send_fd(sock, fastwire.encode_header(fastwire.HELLO, len(hello), 0) + hello,
                            segment.fd)  # type: ignore[arg-type]
                answer, nonce, _ = fastwire.recv_frame_head(sock)
                assert answer == fastwire.HELLO and nonce == segment.nonce, "the shm hand-off failed"
                self.sessions[kind] = FastSession(sock, segment)
        return self.sessions[kind]

    def drop(self, kind: str) -> None:
        """Close `kind`'s connection and wait until the server has ended its session: nothing it sent
        can be served after this."""
        self.sessions.pop(kind).close()
        fast = self.server.running.fast
        assert fast is not None
        deadline = time.monotonic() + NO_HANG_S
        while fast.transports():  # one session at a time here
            assert time.monotonic() < deadline, "the server kept a closed connection's session"
            time.sleep(0.005)

    def send(self, kind: str, frame: Frame) -> pb.TransportReply | None:
        """The reply to `frame`, or None when the server closed the connection or (a frame that
        announces more than it sends) said nothing in SHORT_WAIT_S; the connection is then closed."""
        session = self.session(kind)
        if session.segment is not None:
            _place(session.segment, frame)
        try:
            session.sock.sendall(frame.wire())
            reply = _reply(session.sock, NO_HANG_S if frame.complete else SHORT_WAIT_S)
        except (BrokenPipeError, ConnectionResetError, fastwire.TransportBroken):
            reply = None
        if reply is None:
            self.drop(kind)
        return reply

    def check(self, kind: str, frame: Frame) -> None:
        what = f"{kind} {frame!r}"
        reply = self.send(kind, frame)
        if reply is not None:
            assert not reply.error_message.startswith("internal error"), f"{what}: {reply.error_message}"
        assert self.server.thread.is_alive(), f"after {what}: the server's thread ended"
        assert_serving(self.reader, "", what)  # health is never held by the tarpit
        weights, table = self.state()
        if reply is None or reply.error_type:
            assert weights == self.weights, f"{what} was not accepted ({reply}) but changed the weights"
            assert table == self.table, f"{what} was not accepted ({reply}) but changed the table"
        self.weights, self.table = weights, table
        assert_rss_within(self.rss_baseline, what)


def _place(segment: shm.Segment, frame: Frame) -> None:
    """The frame's data in the segment's request region: where the server reads each pushed slice
    (page-aligned, one after another) when the metadata describes the data, else from the start."""
    try:
        sizes = claimed_sizes(pb.ExchangeHeader.FromString(frame.meta))
    except DecodeError:
        sizes = None
    data = np.frombuffer(frame.data, np.uint8)
    offsets, total = shm.packed(sizes) if sizes else ([0], 0)
    if not sizes or sum(sizes) != data.size or total > segment.request_bytes:
        segment.request[:data.size] = data
        return
    start = 0
    for offset, size in zip(offsets, sizes, strict=True):
        segment.request[offset:offset + size] = data[start:start + size]
        start += size


def _reply(sock: socket.socket, wait_s: float) -> pb.TransportReply | None:
    """The next REPLY frame (SLICE frames before it skipped); None at EOF or after `wait_s` of silence."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            if wait_s >= NO_HANG_S:
                raise AssertionError(f"a complete frame had no answer in {NO_HANG_S} s")
            return None
        sock.settimeout(NO_HANG_S)
        kind, meta, data_len = fastwire.recv_frame_head(sock)
        fastwire.discard(sock, data_len)
        if kind == fastwire.REPLY:
            return pb.TransportReply.FromString(meta)


@pytest.fixture(scope="module", params=list(TARPITS))
def live(request: pytest.FixtureRequest) -> Iterator[LiveFast]:
    base = Path(shm.DEFAULT_SHM_DIR)
    shm_dir = Path(tempfile.mkdtemp(prefix="pshard-fuzz-", dir=base if os.access(base, os.W_OK) else None))
    settings = ServerSettings(default_job=JobConfig(mode="async"), pull_timeout_s=0.1, shm_dir=str(shm_dir),
                              waste_limit_bytes=TARPITS[request.param])
    server = start_server_thread(settings)
    wire = Wire()
    try:
        wire.declare(server, None, MODEL)
        with grpc.insecure_channel(server.address, options=[*channel_options(), ("pshard.fuzz.reader", 2)]
                                   ) as reader:
            stub = sparse_pb2_grpc.SparseTablesServiceStub(reader)
            spec = sparse_pb2.TableSpec(name=TABLE, dim=DIM, dtype=sparse_pb2.TABLE_DTYPE_FLOAT32,
                                        optimizer=sparse_pb2.TABLE_OPTIMIZER_SGD, lr=0.1, init_scale=0.1,
                                        initializer=sparse_pb2.TABLE_INITIALIZER_UNIFORM,
                                        mode=sparse_pb2.TABLE_MODE_ASYNC)
            stub.DeclareTable(sparse_pb2.DeclareTableRequest(spec=spec), timeout=NO_HANG_S)
            stub.PushRows(sparse_pb2.PushRowsRequest(table=TABLE, ids=IDS.tobytes(), worker_id=WORKER,
                                                     grads=bytes(IDS.size * DIM * 4), push_id=1),
                          timeout=NO_HANG_S)
            live = LiveFast(server, wire, reader, shm_dir, rss_bytes())
            live.weights, live.table = live.state()
            yield live
            for kind in list(live.sessions):
                live.drop(kind)
    finally:
        wire.close()
        server.stop(grace_s=0.2)
        for child in shm_dir.iterdir():
            child.unlink()
        shm_dir.rmdir()


def test_the_valid_seed_frames_are_accepted(live):
    """The mutations start from frames that work (else the fuzzer would only test refusals)."""
    for kind in ("tcp", "shm"):
        for header in seed_headers():
            sizes = claimed_sizes(header) or []
            data = (IDS.tobytes() + np.full(3 * DIM, 0.01, np.float32).tobytes() + IDS.tobytes()
                    if header.op == pb.EXCHANGE_OP_TABLE and header.table.push
                    else IDS.tobytes() if header.op == pb.EXCHANGE_OP_TABLE
                    else np.full(sum(sizes) // 4, 0.01, np.float32).tobytes())
            meta = header.SerializeToString()
            frame = Frame(b"PSF1", fastwire.REQUEST, meta, len(meta), len(data) if kind == "tcp" else 0, data,
                          kind == "tcp")
            reply = live.send(kind, frame)
            assert reply is not None and not reply.error_type, (kind, header, reply)
        live.drop(kind)
    live.weights, live.table = live.state()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_fast_path_frames_are_refused_cleanly(live, kind):
    cases = CASES if not live.server.running.tarpit else CASES // 3
    try:
        run_cases(frames(inline=kind == "tcp"), lambda frame: live.check(kind, frame), cases, f"fast-{kind}")
    finally:
        if kind in live.sessions:
            live.drop(kind)
