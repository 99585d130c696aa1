"""Running fuzz cases against live services, and the checks that follow every case.

Two modes. `make test` (the default): each test runs a fixed number of derandomized examples, so CI
sees the same cases every run. `make fuzz` (PSHARD_FUZZ=1): the tests share PSHARD_FUZZ_CASES cases
(100,000 by default) or PSHARD_FUZZ_SECONDS, drawn from PSHARD_FUZZ_SEED (random unless given, and
printed so a failure can be replayed).
"""

from __future__ import annotations

import os
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from pshard.common.rpc.options import identity

FUZZ = os.environ.get("PSHARD_FUZZ") == "1"
FUZZ_CASES = int(os.environ.get("PSHARD_FUZZ_CASES", "100000"))
FUZZ_SECONDS = float(os.environ.get("PSHARD_FUZZ_SECONDS", "0") or 0)
FUZZ_SEED = int(os.environ.get("PSHARD_FUZZ_SEED") or random.SystemRandom().randrange(2**32))

# Statuses that mean the service failed rather than refused: an unhandled exception (UNKNOWN) or a
# broken invariant (INTERNAL).
BROKEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
# The test process's RSS may grow by this much over a module's run (the services run in it).
RSS_BUDGET_BYTES = 768 * 2**20
# A call that waits by design (a pull, a barrier, a watch) gets this long; the others get NO_HANG_S,
# and running out of it is a hang.
WAITING_CALL_S = 0.15
NO_HANG_S = 10.0


@dataclass
class Counter:
    cases: int = 0
    fuzz_tests: int = 1  # set at collection (conftest): the tests share make fuzz's budget
    started: float = 0.0


COUNTER = Counter()


def run_cases(strategy: st.SearchStrategy[Any], check: Callable[[Any], None], cases: int, name: str) -> None:
    """Run `check` on examples of `strategy`: `cases` derandomized ones, or make fuzz's share."""
    quiet = list(HealthCheck)

    def counted(example: Any) -> None:
        COUNTER.cases += 1
        check(example)

    if not FUZZ:
        # No shrinking in CI: a finding shows its first failing case at once (and an xfail'd finding
        # does not replay its request hundreds of times). Derandomized, and seeded by the test's name
        # because every test shares this function, whose source alone would give them all one seed.
        @seed(zlib.crc32(name.encode()))
        @settings(max_examples=cases, derandomize=True, deadline=None, database=None,
                  phases=(Phase.explicit, Phase.generate), suppress_health_check=quiet)
        @given(strategy)
        def ci_case(example: Any) -> None:
            counted(example)

        ci_case()
        return
    share = max(1, FUZZ_CASES // COUNTER.fuzz_tests)
    ends = time.monotonic() + FUZZ_SECONDS / COUNTER.fuzz_tests if FUZZ_SECONDS else None
    done, round_ = 0, 0
    while done < share and (ends is None or time.monotonic() < ends):
        batch = min(100, share - done)

        @seed((FUZZ_SEED ^ zlib.crc32(f"{name}/{round_}".encode())) & 0xFFFFFFFF)
        @settings(max_examples=batch, deadline=None, database=None, suppress_health_check=quiet)
        @given(strategy)
        def fuzz_case(example: Any) -> None:
            counted(example)

        fuzz_case()
        done, round_ = done + batch, round_ + 1


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str = ""

    @property
    def refused(self) -> bool:
        return self.code is not grpc.StatusCode.OK


def waits(method: MethodDescriptor) -> bool:
    """Whether a call waits by design (a pull, a barrier, a checkpoint at a clock, a watch): its request
    names a `timeout_ms`, or it streams. Read from the descriptor, so a new RPC is classed with no code."""
    streams = method.client_streaming or method.server_streaming
    return streams or "timeout_ms" in method.input_type.fields_by_name


def method_path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes, timeout_s: float) -> Outcome:
    """Send one request's bytes as they are (identity serializers): raw garbage reaches the server too."""
    path = method_path(method)
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path, request_serializer=identity,
                                          response_deserializer=identity)(payload, timeout=timeout_s)
            try:
                for _ in stream:
                    break  # the first reply is enough: a Watch goes on for ever
            finally:
                stream.cancel()
        else:
            channel.unary_unary(path, request_serializer=identity,
                                response_deserializer=identity)(payload, timeout=timeout_s)
    except grpc.RpcError as e:
        assert isinstance(e, grpc.Call)
        return Outcome(e.code(), e.details() or "")
    return Outcome(grpc.StatusCode.OK)


def assert_proper_status(outcome: Outcome, what: str, may_wait: bool) -> None:
    assert outcome.code not in BROKEN, f"{what}: {outcome.code.name}: {outcome.details[:500]}"
    if not may_wait:
        assert outcome.code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: no answer in {NO_HANG_S} s"


def assert_serving(channel: grpc.Channel, service: str, what: str) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                      timeout=NO_HANG_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"after {what}: health says {reply.status}"


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def assert_rss_within(baseline: int, what: str) -> None:
    rss = rss_bytes()
    assert rss - baseline <= RSS_BUDGET_BYTES, (
        f"after {what}: RSS {rss / 2**20:.0f} MiB, {(rss - baseline) / 2**20:.0f} MiB over the start "
        f"(budget {RSS_BUDGET_BYTES / 2**20:.0f} MiB)")


def describe(payload: Any) -> str:
    """A short form of a request for assertion messages (a case may hold megabytes)."""
    text = repr(payload) if isinstance(payload, bytes | list) else str(payload).replace("\n", " ")
    return text if len(text) <= 400 else f"{text[:400]}... ({len(text)} chars)"
