"""The documented limits of a parameter server's requests, checked before anything is allocated.

A request that passes the transport's size checks can still ask for absurd things: a shape whose
element count overflows int64, more dimensions than numpy allows, a worker id of a megabyte, a
generation no scheduler has handed out. Each is refused here, as INVALID_ARGUMENT naming the field,
its value and the limit, before any array is made or any state moves.

`Limits()` holds the defaults; a server takes its own through `ServerSettings.limits` (embedders
and tests may tighten them). The codec checks every tensor it decodes against the defaults, so
nothing past them ever reaches numpy whatever a server's settings say.

Pure: no grpc, no environment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pshard.common.errors import InvalidArgumentError, quote
from pshard.common.rpc.options import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class Limits:
    """What one request may ask of a parameter server (docs/operations/limits.md)."""

    # Dimensions per tensor. numpy stops at 64; no layer of a real model has more than a handful.
    max_dims: int = 32
    # Elements per slice, counted with Python ints (no overflow), zero dimensions counted as one
    # so that [0, 2**62] is refused as well: numpy refuses to make even an empty array of it.
    # 2**31 float32 elements are 8 GiB, beyond any slice a layout cuts (4 MiB by default).
    max_slice_elements: int = 2**31
    # Slices named by one request (pushed and pulled counted apart): a layout has at most this many.
    max_slices_per_request: int = 65536
    # Bytes of one unary request; larger payloads use the Exchange stream (the gRPC server's
    # message limit enforces it, common.rpc.options; the in-flight budget bounds the sum of all requests).
    max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Characters of a worker id and of a parameter name (torch state_dict names are far shorter).
    max_worker_id_chars: int = 256
    max_key_chars: int = 1024
    # Generations and clocks: the scheduler hands out at most 2**62 generations (scheduler limits),
    # and a clock of 2**62 steps is beyond any run. A server following a scheduler also refuses a
    # generation beyond the newest view it has seen, and the consistency policies a clock beyond
    # what the slices have reached; these bounds are for servers without a scheduler.
    max_generation: int = 2**62
    max_clock: int = 2**62

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise InvalidArgumentError(f"limit {f.name}: got {value}, expected > 0")
        if self.max_dims > 64:
            raise InvalidArgumentError(f"limit max_dims: got {self.max_dims}, numpy allows at most 64")

    def check_shape(self, what: str | Callable[[], str], shape: Sequence[int]) -> int:
        """The element count of `shape`; InvalidArgumentError naming `what` past a limit. `what` may be
        a function that names it, called only then: a request checks every slice it pushes, and the
        quoted name of each cost more than the check (issue 18's latency drift)."""
        if len(shape) > self.max_dims:
            raise InvalidArgumentError(
                f"{_name(what)}: shape has {len(shape)} dimensions, expected at most {self.max_dims}")
        if shape and min(shape) < 0:
            raise InvalidArgumentError(f"{_name(what)}: shape {tuple(shape)} has a negative dimension")
        # Stops as soon as the count passes the limit: a shape of 32 dims of 2**62 costs no big ints.
        count = 1
        for d in shape:
            count *= max(d, 1)
            if count > self.max_slice_elements:
                raise InvalidArgumentError(
                    f"{_name(what)}: shape {_short(shape)} has more than {self.max_slice_elements} elements "
                    f"(limit max_slice_elements)")
        return math.prod(shape)

    def check_count(self, what: str, count: int) -> None:
        if count > self.max_slices_per_request:
            raise InvalidArgumentError(
                f"{what}: got {count} slices, expected at most {self.max_slices_per_request} per request")

    def check_worker_id(self, worker_id: str) -> None:
        _check_chars("stamp.worker_id", worker_id, self.max_worker_id_chars)

    def check_keys(self, what: str, keys: Iterable[str]) -> None:
        for key in keys:
            _check_chars(f"{what} key", key, self.max_key_chars)

    def check_stamp(self, worker_id: str, generation: int, clock: int) -> None:
        self.check_worker_id(worker_id)
        if generation > self.max_generation:
            raise InvalidArgumentError(
                f"worker {quote(worker_id)}: got generation {generation}, "
                f"expected at most {self.max_generation}")
        if clock > self.max_clock:
            raise InvalidArgumentError(
                f"worker {quote(worker_id)}: got clock {clock}, expected at most {self.max_clock}")


DEFAULT_LIMITS = Limits()


def _check_chars(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgumentError(
            f"{field}: got {len(value)} characters ({value[:40]!r}...), expected at most {limit}")


def _name(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def _short(shape: Sequence[int]) -> str:
    text = str(tuple(shape))
    return text if len(text) <= 200 else text[:200] + "...)"
