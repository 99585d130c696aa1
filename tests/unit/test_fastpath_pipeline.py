"""The worker's side of the pipelined TCP fast path, against a scripted server on a socket pair:
slices that come ahead of the summary, a reply that comes while the request is still being sent,
and replies that break the framing."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pshard.client.fast_session import FastPath
from pshard.common.errors import InvalidArgumentError
from pshard.common.wire import fastwire
from pshard.common.wire.shm import Segment

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2

WAIT_S = 10.0
N = 4 * 2**20  # 16 MB a slice: more than both socket buffers, so nothing fits in them whole
Server = Callable[[socket.socket, int], None]  # (its end of the pair, data bytes of the request)


@pytest.fixture
def path() -> Iterator[Callable[[Server], FastPath]]:
    """path(script): a tcp FastPath whose server runs `script` on a thread, once per request."""
    made: list[tuple[FastPath, socket.socket, threading.Thread]] = []

    def make(script: Server) -> FastPath:
        ours, theirs = socket.socketpair()
        for s in (ours, theirs):
            fastwire.tune(s)

        def serve() -> None:
            try:
                while True:
                    kind, _, data_len = fastwire.recv_frame_head(theirs)
                    assert kind == fastwire.REQUEST
                    script(theirs, data_len)
            except (fastwire.TransportBroken, OSError):
                return  # the worker closed the path

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        fast = FastPath("tcp", ours, None, Segment.private(0, 2 * N * 4))
        made.append((fast, theirs, thread))
        return fast

    yield make
    for fast, theirs, thread in made:
        fast.close()
        theirs.close()
        thread.join(WAIT_S)


def _header(pulled: int) -> pb.ExchangeHeader:
    return pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, pull=[tensor_pb2.SliceId() for _ in range(pulled)])


def _slice(sock: socket.socket, index: int, value: np.ndarray) -> None:
    fastwire.send_frame(sock, fastwire.SLICE, fastwire.encode_slice_meta(index), [value])


def _reply(sock: socket.socket, sizes: list[int], error: Exception | None = None) -> None:
    reply = pb.TransportReply(sizes=sizes, offsets=[0] * len(sizes))
    if error is not None:
        reply = pb.TransportReply(error_type=type(error).__name__, error_message=str(error))
    fastwire.send_frame(sock, fastwire.REPLY, reply.SerializeToString())


def _call(fast: FastPath, pulled: int, out: list[np.ndarray]) -> list[int]:
    """The call's slices that needed `place` (a size other than their array's)."""
    grads = [np.full(N, 7.0, np.float32)]
    placed: list[int] = []
    fast.call(_header(pulled), grads, lambda index, raw: placed.append(index),
              lambda index: out[index].view(np.uint8), WAIT_S)
    return placed


def test_slices_sent_while_the_request_is_still_being_written_land_in_the_callers_arrays(path):
    """The server answers slice 0 before it reads any of the request: a worker that read only after
    sending all of it would never finish (both sockets full), as would the server."""
    received = []

    def script(sock: socket.socket, data_len: int) -> None:
        _slice(sock, 0, np.full(N, 1.0, np.float32))
        data = np.empty(data_len, np.uint8)
        fastwire.recv_into(sock, data)
        received.append(data.view(np.float32))
        _slice(sock, 1, np.full(N, 2.0, np.float32))
        _reply(sock, [4 * N, 4 * N])

    fast = path(script)
    out = [np.zeros(N, np.float32), np.zeros(N, np.float32)]
    assert _call(fast, 2, out) == []  # received straight into the arrays
    np.testing.assert_array_equal(received[0], np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(out[0], np.full(N, 1.0, np.float32))
    np.testing.assert_array_equal(out[1], np.full(N, 2.0, np.float32))


def test_an_error_reply_before_the_request_is_all_sent_is_raised_and_the_path_serves_on(path):
    calls = []

    def script(sock: socket.socket, data_len: int) -> None:
        calls.append(data_len)
        if len(calls) == 1:  # refused at once, its data read (and dropped) afterwards
            _reply(sock, [], InvalidArgumentError("bad push"))
            fastwire.discard(sock, data_len)
            return
        fastwire.discard(sock, data_len)
        _slice(sock, 0, np.full(N, 3.0, np.float32))
        _reply(sock, [4 * N])

    fast = path(script)
    out = [np.zeros(N, np.float32)]
    with pytest.raises(InvalidArgumentError, match="bad push"):
        _call(fast, 1, out)
    _call(fast, 1, out)
    np.testing.assert_array_equal(out[0], np.full(N, 3.0, np.float32))
    assert calls == [4 * N, 4 * N]


def _out_of_order(sock: socket.socket, n: int) -> None:
    fastwire.discard(sock, n)
    _slice(sock, 1, np.ones(N, np.float32))


def _summary_lists_unsent(sock: socket.socket, n: int) -> None:
    fastwire.discard(sock, n)
    _slice(sock, 0, np.ones(N, np.float32))
    _reply(sock, [4 * N, 4 * N])


def _summary_lists_other_size(sock: socket.socket, n: int) -> None:
    fastwire.discard(sock, n)
    _slice(sock, 0, np.ones(N // 2, np.float32))
    _reply(sock, [4 * N])


def _closed_between_slices(sock: socket.socket, n: int) -> None:
    _slice(sock, 0, np.ones(N, np.float32))
    sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize(("script", "pulled"), [
    pytest.param(_out_of_order, 2, id="a slice out of order"),
    pytest.param(_summary_lists_unsent, 2, id="a summary listing a slice not sent"),
    pytest.param(_summary_lists_other_size, 1, id="a summary listing another size"),
    pytest.param(_closed_between_slices, 2,
                 id="the connection closed between two slices, the request half sent"),
])
def test_a_reply_that_breaks_the_framing_breaks_the_path_before_the_deadline(path, script, pulled):
    fast = path(script)
    out = [np.zeros(N, np.float32), np.zeros(N, np.float32)]
    started = time.monotonic()
    with pytest.raises(fastwire.TransportBroken):
        _call(fast, pulled, out)
    assert time.monotonic() - started < WAIT_S / 2
