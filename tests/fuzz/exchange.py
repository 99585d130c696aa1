"""Exchange streams for the fuzzer: a header frame and data frames, truncated, reordered or oversized.

A stream is drawn with the slices it delivers whole: the Exchange applies a push slice by slice
once its header is validated (the one documented exception to "rejected means unchanged"), so a
refused stream may have changed exactly those keys and no other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st
from pshard.common.cluster.layout import ITEMSIZE

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2
from tests.fuzz.strategies import messages, mutated, weighted

# What a stream that claims more than it sends holds the server to: big enough to show memory kept
# for a promise (64 MiB, issue 7 defect 4), small enough that a server that keeps it stays alive here.
PROMISED_BYTES = 64 * 2**20
OVERSIZED_FRAME_BYTES = 5 * 2**20  # past one 4 MiB chunk
_DTYPE_NAMES = {v.number: v.name.removeprefix("DTYPE_").lower() for v in tensor_pb2.Dtype.DESCRIPTOR.values}


@dataclass(frozen=True)
class Stream:
    frames: tuple[bytes, ...]
    whole: frozenset[str]  # keys whose bytes the stream delivers completely, in header order
    shape: str  # how the stream was built, for messages

    def __repr__(self) -> str:
        sizes = [len(f) for f in self.frames]
        head = self.frames[0][:200] if self.frames else b""
        return f"Stream({self.shape}, frame sizes {sizes}, first frame {head!r})"


def claimed_sizes(header: pb.ExchangeHeader) -> list[int] | None:
    """Bytes each push slice claims, or None once one cannot be computed (the header is invalid)."""
    sizes = []
    for meta in header.push:
        dtype = _DTYPE_NAMES.get(meta.dtype, "")
        if dtype not in ITEMSIZE or any(d < 0 for d in meta.shape) or len(meta.shape) > 64:
            return None
        sizes.append(math.prod(meta.shape) * ITEMSIZE[dtype])
    return sizes


def header_frame(header: pb.ExchangeHeader) -> bytes:
    return pb.ExchangeRequest(header=header).SerializeToString()


def data_frame(data: bytes) -> bytes:
    return pb.ExchangeRequest(data=data).SerializeToString()


def _whole(header: pb.ExchangeHeader, sizes: Sequence[int] | None, delivered: int) -> frozenset[str]:
    if sizes is None:
        return frozenset()
    keys, end = set(), 0
    for meta, size in zip(header.push, sizes, strict=True):
        end += size
        if end > delivered:
            break
        keys.add(meta.id.key)
    return frozenset(keys)


@st.composite
def streams(draw: st.DrawFn, valid: Sequence[pb.ExchangeHeader]) -> Stream:
    header = draw(weighted((1, messages(pb.ExchangeHeader.DESCRIPTOR)), (2, mutated(valid))))
    sizes = claimed_sizes(header)
    claimed = sum(sizes) if sizes is not None else None
    how = draw(st.sampled_from(("whole", "truncated", "oversized", "data first", "two headers",
                                "summary", "garbage frame", "header only", "empty", "huge frame",
                                "promise")))
    if how == "promise":  # a header claiming 64 MiB, and then nothing
        header.push.add(id=tensor_pb2.SliceId(key="w"), dtype=tensor_pb2.DTYPE_UINT8, shape=[PROMISED_BYTES])
        return Stream((header_frame(header),), frozenset(), how)
    if claimed is not None and claimed <= 2**20:
        payload = draw(st.binary(min_size=claimed, max_size=claimed)) if claimed <= 256 else bytes(claimed)
    else:
        payload = draw(st.binary(max_size=64))
    if how == "truncated":
        payload = payload[:draw(st.integers(0, max(0, len(payload) - 1)))]
    elif how == "oversized":
        payload += draw(st.binary(min_size=1, max_size=64))
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=2)))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    parts = [p for p in pieces if p or not cuts]
    data = [data_frame(p) for p in parts]
    head = header_frame(header)
    delivered = len(payload)
    if how == "data first":
        frames, delivered = [*data, head], 0
    elif how == "two headers":
        frames = [head, head, *data]
        delivered = 0
    elif how == "summary":
        summary = pb.ExchangeResponse(summary=pb.ExchangeSummary(applied=1))  # a server's message
        frames = [head, *data, summary.SerializeToString()]
    elif how == "garbage frame":
        at = draw(st.integers(1, len(data) + 1))
        frames = [head, *data]
        frames.insert(at, draw(st.binary(min_size=1, max_size=32)))
        delivered = sum(len(p) for p in parts[:at - 1])
    elif how == "header only":
        frames, delivered = [head], 0
    elif how == "empty":
        frames, delivered = [], 0
    elif how == "huge frame":
        frames = [head, data_frame(bytes(OVERSIZED_FRAME_BYTES))]
        delivered = OVERSIZED_FRAME_BYTES
    else:
        frames = [head, *data]
    return Stream(tuple(frames), _whole(header, sizes, delivered), how)
