"""Cutting slices into Exchange data frames and back. Pure: no grpc, no I/O.

Frames are packed independently of slice boundaries: many small slices share a
frame (fewer messages), a slice bigger than a chunk spans several. The layout's
default slice bound equals the chunk size, so with `whole_slices` (what the client
and server use) every such slice lies inside one frame and the receiver reads it with
no copy at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from pshard.common.errors import PayloadSizeError
from pshard.common.wire.codec import byte_view, encode_data_frame

Buffer = bytes | memoryview | np.ndarray


class FramePacker:
    """Accumulates slice buffers into data frames of at most `chunk_bytes` payload.

    With `whole_slices`, a slice that fits in one frame never spans two: when it does
    not fit in the room left, the partly filled frame is sent first. The receiver then
    reads every such slice as a zero-copy view instead of assembling it from two frames
    (a copy, and the memory it lands in). The price is a few frames that are not full.
    """

    def __init__(self, chunk_bytes: int, *, whole_slices: bool = False) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: got {chunk_bytes}, expected > 0")
        self._chunk = chunk_bytes
        self._whole = whole_slices
        self._parts: list[memoryview] = []
        self._size = 0

    def add(self, buf: Buffer) -> list[bytes]:
        """Queue one slice; returns the frames that became full."""
        view = byte_view(buf)
        frames: list[bytes] = []
        if self._whole and self._size and self._size + len(view) > self._chunk >= len(view):
            frames.append(self._emit())
        while len(view):
            room = self._chunk - self._size
            take = view[:room]
            self._parts.append(take)
            self._size += len(take)
            view = view[len(take):]
            if self._size == self._chunk:
                frames.append(self._emit())
        return frames

    def flush(self) -> bytes | None:
        """The partly filled frame, if any (call when nothing more is ready to send)."""
        return self._emit() if self._parts else None

    def _emit(self) -> bytes:
        frame = encode_data_frame(self._parts)
        self._parts, self._size = [], 0
        return frame


def pack_frames(buffers: Iterable[Buffer], chunk_bytes: int, *,
                whole_slices: bool = False) -> Iterator[bytes]:
    packer = FramePacker(chunk_bytes, whole_slices=whole_slices)
    for buf in buffers:
        yield from packer.add(buf)
    last = packer.flush()
    if last is not None:
        yield last


class SliceReader:
    """Cuts a stream of frame payloads back into slices of known sizes.

    A slice inside one payload comes back as a zero-copy memoryview of it; one that
    spans payloads is assembled in a bytearray that grows as its bytes arrive: a header that
    announces a huge slice costs nothing until the bytes are actually sent.
    """

    def __init__(self, sizes: Sequence[int], names: Sequence[str]) -> None:
        self._sizes = list(sizes)
        self._names = list(names)
        self._index = 0
        self._partial: bytearray | None = None
        self._filled = 0
        self.received = 0
        self.expected = sum(sizes)
        self._leading = self._skip_empty()

    @property
    def pending(self) -> int:
        """Bytes held for a slice still being assembled across payloads."""
        return self._filled

    @property
    def done(self) -> bool:
        return self._index >= len(self._sizes)

    def _skip_empty(self) -> list[tuple[int, memoryview]]:
        out = []
        while not self.done and self._sizes[self._index] == 0:
            out.append((self._index, memoryview(b"")))
            self._index += 1
        return out

    def initial(self) -> list[tuple[int, memoryview]]:
        """Zero-byte slices at the front are complete before any frame arrives."""
        leading, self._leading = self._leading, []
        return leading

    def feed(self, payload: memoryview) -> list[tuple[int, memoryview]]:
        """Returns the (slice index, bytes) of every slice this payload completes."""
        done: list[tuple[int, memoryview]] = []
        self.received += len(payload)
        if self.received > self.expected:
            raise PayloadSizeError(f"stream: got at least {self.received} bytes, the header announced "
                                   f"{self.expected}")
        while len(payload):
            size = self._sizes[self._index]
            if self._partial is None and len(payload) >= size:
                done.append((self._index, payload[:size]))
                payload = payload[size:]
                self._index += 1
                done.extend(self._skip_empty())
                continue
            if self._partial is None:
                self._partial, self._filled = bytearray(), 0
            take = min(size - self._filled, len(payload))
            self._partial += payload[:take]
            self._filled += take
            payload = payload[take:]
            if self._filled == size:
                done.append((self._index, memoryview(self._partial)))
                self._partial, self._filled = None, 0
                self._index += 1
                done.extend(self._skip_empty())
        return done

    def finish(self) -> None:
        if not self.done:
            name = self._names[self._index]
            raise PayloadSizeError(f"stream ended after {self.received} bytes, the header announced "
                                   f"{self.expected} (slice {name!r} incomplete)")
