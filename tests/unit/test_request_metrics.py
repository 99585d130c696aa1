"""RequestMetrics: what the servers count per request, as Prometheus reads it."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from pshard.common.metrics import RequestMetrics, clock_lags, new_registry, request_families, status_of


class _Requests(Collector):
    def __init__(self, requests: RequestMetrics) -> None:
        self.requests = requests

    def collect(self):  # type: ignore[no-untyped-def]
        return request_families(self.requests, "ps")


def samples(requests: RequestMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = new_registry()
    registry.register(_Requests(requests))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_bytes_latency_refusals_and_staleness_per_transport() -> None:
    requests = RequestMetrics()
    requests.record("grpc", "PushPull", 100, 40, 0.002, clock=5)
    requests.record("grpc", "PushPull", 100, 0, 0.0001, "OverloadedError", clock=3)
    requests.record("shm", "Exchange", 4000, 4000, 0.0003, clock=7)
    requests.record("shm", "Exchange", 10, 0, 0.0003, "ShapeMismatchError")
    got = samples(requests)
    grpc = (("method", "PushPull"), ("transport", "grpc"))
    assert got[("pshard_ps_received_bytes_total", grpc)] == 200
    assert got[("pshard_ps_sent_bytes_total", grpc)] == 40
    assert got[("pshard_ps_request_duration_seconds_count", grpc)] == 2
    assert got[("pshard_ps_request_duration_seconds_bucket", (("le", "0.001"), *grpc))] == 1
    assert got[("pshard_ps_refused_requests_total", (("code", "RESOURCE_EXHAUSTED"),))] == 1
    assert got[("pshard_ps_refused_requests_total", (("code", "INVALID_ARGUMENT"),))] == 1
    # Clocks 5, 3 (2 behind the fastest seen), 7: staleness 0, 2, 0.
    assert got[("pshard_ps_request_staleness_clocks_count", ())] == 3
    assert got[("pshard_ps_request_staleness_clocks_sum", ())] == 2
    assert got[("pshard_ps_request_staleness_clocks_bucket", (("le", "1.0"),))] == 2
    assert requests.served == 4


def test_an_unknown_error_type_is_counted_as_unknown() -> None:
    assert status_of("NoSuchError") == "UNKNOWN"
    assert status_of("StaleGenerationError") == "FAILED_PRECONDITION"


def test_lag_is_measured_from_the_fastest_clock() -> None:
    assert clock_lags({"a": 7, "b": 4, "c": 7}) == {"a": 0, "b": 3, "c": 0}
    assert clock_lags({}) == {}


def test_unpacked_gradients_are_counted_by_encoding() -> None:
    requests = RequestMetrics()
    requests.record_unpack("topk", 80, 4000, 0.001)
    requests.record_unpack("topk", 80, 4000, 0.002)
    requests.record_unpack("sign", 36, 1024, 0.0005)
    got = samples(requests)
    assert got[("pshard_ps_packed_gradient_bytes_total", (("encoding", "topk"),))] == 160
    assert got[("pshard_ps_unpacked_gradient_bytes_total", (("encoding", "topk"),))] == 8000
    assert got[("pshard_ps_unpack_seconds_total", (("encoding", "sign"),))] == 0.0005
