"""A flood for tests/e2e/test_flood.py: `python flood_client.py ADDRESS CLIENTS SECONDS`.

Each client is a thread with a channel (a connection) of its own, sending 4 MiB PushPull requests
back to back for SECONDS, with no backoff. Three kinds of client, in turn: a member of the server's
quorum pushing a gradient of a parameter the server holds, always at the same clock (the first is
applied, every later one dropped as a duplicate); a member pushing one of a parameter it does not hold
(NOT_FOUND); and an id outside the quorum pushing the held parameter (FAILED_PRECONDITION: not a live
member). Prints one line, `flood: {json}`, with the counts.

The process lowers its own priority (nice 19): the flood's clients stand for other machines, so
their CPU must not be taken from the server on a shared two-core test machine; they still send as
fast as the cores left over allow.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

import grpc
import numpy as np
from pshard.common.rpc.options import channel_options, identity
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import codec

from pshard.api.v1 import parameter_server_pb2 as pb

PUSH_PULL = "/pshard.api.v1.ParameterServerService/PushPull"
FLOOD_FLOATS = 2**20  # 4 MiB
HELD_KEY = "flood"  # the server holds it (the test declares it)


KINDS = ("duplicate", "unknown-key", "outsider")


def kind(client: int) -> str:
    return KINDS[client % len(KINDS)]


def worker_id(client: int) -> str:
    return f"outsider-{client}" if kind(client) == "outsider" else f"flood-{client}"


def members(clients: int) -> list[str]:
    """The flood's ids that the server's quorum (--workers) must name."""
    return [worker_id(c) for c in range(clients) if kind(c) != "outsider"]


def request(client: int) -> bytes:
    key = "not-held" if kind(client) == "unknown-key" else HELD_KEY
    gradient = codec.WireArray(np.full(FLOOD_FLOATS, 1e-6, np.float32), "float32")
    return pb.PushPullRequest(stamp=codec.stamp_to_proto(Stamp(worker_id(client), 0, 0)),
                              gradients=[codec.slice_tensor_to_proto(SliceKey(key), gradient)]
                              ).SerializeToString()


def main(address: str, clients: int, seconds: float) -> None:
    os.nice(19)
    codes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def run(client: int) -> None:
        body = request(client)
        # channel_options() gives each channel connections of its own: the flood is sixteen peers.
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            call = channel.unary_unary(PUSH_PULL, request_serializer=identity, response_deserializer=identity)
            while time.monotonic() < end:
                try:
                    call(body, timeout=30)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with lock:
                    codes[code] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = sum(codes.values())
    print("flood: " + json.dumps({"requests": sent, "codes": dict(codes),
                                  "mib_per_s": round(sent * FLOOD_FLOATS * 4 / 2**20 / seconds)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
