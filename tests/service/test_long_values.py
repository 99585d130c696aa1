"""A 100 kB key or worker id through real services: the refusal is INVALID_ARGUMENT quoting a bounded
prefix with the value's length, not gRPC's RESOURCE_EXHAUSTED for a status message past its header
limit (which clients retry), and the server stays as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import MESSAGE_BYTES, InvalidArgumentError, error_classes
from pshard.common.job import JobConfig
from pshard.common.rpc.status import ERROR_TYPE_KEY
from pshard.ps_server.service import ServerThread

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2

from .conftest import WAIT_S, Wire

LONG = "k" * 100_000


@pytest.fixture
def wire() -> Iterator[Wire]:
    w = Wire()
    yield w
    w.close()


def _requests() -> dict[str, Callable[[Wire, ServerThread], object]]:
    bad = tensor_pb2.SliceTensor(id=tensor_pb2.SliceId(key=LONG))
    return {
        "Push": lambda w, s: w.stub(s).Push(pb.PushRequest(stamp=Wire.stamp("w0", 0), gradients=[bad]),
                                            timeout=WAIT_S),
        "Declare": lambda w, s: w.stub(s).Declare(pb.DeclareRequest(slices=[bad]), timeout=WAIT_S),
        "Pull": lambda w, s: w.stub(s).Pull(pb.PullRequest(stamp=Wire.stamp(LONG, 0),
                                                           slices=[Wire.slice_id("w")]), timeout=WAIT_S),
    }


@pytest.mark.parametrize("method", sorted(_requests()))
def test_a_100_kB_key_or_worker_id_is_refused_with_a_bounded_message(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient], wire: Wire,
        method: str) -> None:
    server = start_server()
    client = new_client([server], "w0", transport="grpc")
    client.declare({"w": np.arange(3, dtype=np.float32)}, JobConfig(mode="async"))
    with pytest.raises(grpc.RpcError) as info:
        _requests()[method](wire, server)
    call = info.value
    assert isinstance(call, grpc.Call)
    details = call.details() or ""
    assert call.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    kind = error_classes()[str(dict(call.trailing_metadata() or ())[ERROR_TYPE_KEY])]
    assert issubclass(kind, InvalidArgumentError)
    assert "100000 characters" in details and len(details.encode()) <= MESSAGE_BYTES
    np.testing.assert_array_equal(client.pull(0)["w"], np.arange(3, dtype=np.float32))  # unchanged
