"""Bad input on a serving worker's Serve stream (pshard.worker.serve), from a client other than the
coordinator: bytes that are no RunRequest are refused as INVALID_ARGUMENT naming the method (not grpc's
UNKNOWN), a call naming a function that does not exist is answered with its error and the stream goes on
(also within a batch of calls in one message, answered in one message), and the worker serves its
coordinator on after both."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pshard.api.v1 import coordinator_pb2 as pb
from tests.service import coordinator_functions as f
from tests.service.coordinator_cluster import WAIT_S, cluster

SERVE = "/pshard.api.v1.WorkerService/Serve"
FIRST = 1 << 41  # schedule ids no coordinator of this test gives out


def test_a_serve_stream_refuses_bad_bytes_by_name_and_answers_an_unknown_function_with_its_error() -> None:
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            v = coordinator.create_variable("v", np.zeros(1, np.float32))
            coordinator.schedule(f.noop).fetch(WAIT_S)  # the worker is ready

            with grpc.insecure_channel(c.workers[0]) as channel:
                raw = channel.stream_stream(SERVE)
                with pytest.raises(grpc.RpcError) as refused:
                    list(raw(iter([b"\xff\xff\xff"]), timeout=WAIT_S))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
                assert f"{SERVE}: not a valid request" in refused.value.details()  # type: ignore[attr-defined]

                serve = channel.stream_stream(SERVE, pb.ServeRequest.SerializeToString,
                                              pb.ServeResponse.FromString)
                named = ((FIRST, "no_such_module_xyz:f"), (FIRST + 1, f"{f.__name__}:worker_id"))
                calls = [pb.ServeRequest(call=pb.RunRequest(schedule_id=i, function=fn)) for i, fn in named]
                answers = [a.answer for a in serve(iter(calls), timeout=WAIT_S)]
                # The same two as one batch: one message each way, the second call run after the first failed.
                batch = pb.ServeRequest(call=calls[0].call, more=[calls[1].call])
                (together,) = list(serve(iter([batch]), timeout=WAIT_S))
            for got in (answers, [together.answer, *together.more]):
                assert [a.schedule_id for a in got] == [FIRST, FIRST + 1]
                assert got[0].error.type.endswith("InvalidArgumentError")
                assert "cannot import module 'no_such_module_xyz'" in got[0].error.message
                assert got[1].result.string_value == "worker-0"

            assert coordinator.schedule(f.add, args=(v, 2.0)).fetch(WAIT_S) == 2.0  # it serves on
            assert v.read_value().tolist() == [2.0]
