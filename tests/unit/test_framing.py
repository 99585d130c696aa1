"""Slices packed into Exchange data frames and cut back: exact bytes, zero copy where possible."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pshard.common.errors import PayloadSizeError
from pshard.common.wire.codec import decode_data_frame
from pshard.common.wire.framing import Buffer, FramePacker, SliceReader, pack_frames


def make_slices(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def payloads_of(frames: list[bytes]) -> list[memoryview]:
    views = [decode_data_frame(f) for f in frames]
    assert all(v is not None for v in views)
    return views  # type: ignore[return-value]


def read_back(sizes: list[int], payloads: list[memoryview]) -> dict[int, memoryview]:
    """Every slice the reader hands out, checking each index comes once and in order."""
    reader = SliceReader(sizes, [f"s{i}" for i in range(len(sizes))])
    got = reader.initial()
    for p in payloads:
        got += reader.feed(p)
    reader.finish()
    assert reader.done
    assert [i for i, _ in got] == list(range(len(sizes)))
    return dict(got)


slice_sizes = st.lists(st.integers(0, 300) | st.just(0), max_size=12)


@settings(max_examples=200, deadline=None)
@given(sizes=slice_sizes, chunk=st.integers(1, 400), seed=st.integers(0, 2**16))
@example(sizes=[0, 0, 5, 0, 7, 0, 0], chunk=3, seed=1)  # empty slices at the front, middle and end
@example(sizes=[100, 1, 100], chunk=16, seed=2)  # chunk smaller than slices: they span frames
@example(sizes=[0, 0], chunk=8, seed=3)  # nothing to send at all
@example(sizes=[8, 8, 8], chunk=8, seed=4)  # slices exactly on frame boundaries
def test_slices_survive_packing_and_reading_byte_for_byte(sizes: list[int], chunk: int, seed: int) -> None:
    slices = make_slices(sizes, seed)

    frames = list(pack_frames(slices, chunk))
    got = read_back(sizes, payloads_of(frames))

    assert [bytes(got[i]) for i in range(len(sizes))] == slices
    total = sum(sizes)
    assert len(frames) == -(-total // chunk)
    assert all(len(p) == chunk for p in payloads_of(frames)[:-1])


@settings(max_examples=100, deadline=None)
@given(sizes=slice_sizes, chunk=st.integers(1, 400))
@example(sizes=[3, 5, 0, 4], chunk=16)
def test_a_slice_inside_one_frame_is_a_zero_copy_view_of_that_frame(sizes: list[int], chunk: int) -> None:
    frames = list(pack_frames(make_slices(sizes), chunk))

    got = read_back(sizes, payloads_of(frames))

    start = 0
    for i, size in enumerate(sizes):
        first, last = start // chunk, (start + size - 1) // chunk
        if size and first == last:
            assert got[i].obj is frames[first], (i, size, start)
        start += size


def test_typed_arrays_travel_as_their_raw_bytes() -> None:
    # .data is memoryview(array); numpy's stubs call an ndarray a Buffer only on Python 3.12 and later.
    buffers: list[Buffer] = [np.arange(5, dtype=np.float32), np.zeros((0, 3), np.float64),
                             np.array(2.5, np.float64), np.array([True, False, True]),
                             np.arange(12, dtype=np.int16).reshape(3, 4).T, np.arange(4, dtype=np.int64).data,
                             b"tail"]
    raw = [np.ascontiguousarray(b).tobytes() if isinstance(b, np.ndarray) else bytes(b) for b in buffers]

    got = read_back([len(r) for r in raw], payloads_of(list(pack_frames(buffers, 7))))

    assert [bytes(got[i]) for i in range(len(raw))] == raw


def test_empty_slices_at_the_front_are_ready_before_any_frame() -> None:
    reader = SliceReader([0, 0, 4], ["a", "b", "c"])

    assert [(i, bytes(v)) for i, v in reader.initial()] == [(0, b""), (1, b"")]
    assert reader.initial() == []
    assert [(i, bytes(v)) for i, v in reader.feed(memoryview(b"wxyz"))] == [(2, b"wxyz")]


def test_more_bytes_than_announced_fail_during_feed() -> None:
    reader = SliceReader([4, 2], ["w", "b"])
    reader.feed(memoryview(b"abcd"))

    with pytest.raises(PayloadSizeError, match="at least 7 bytes, the header announced 6"):
        reader.feed(memoryview(b"efg"))


def test_bytes_when_none_are_announced_fail_during_feed() -> None:
    reader = SliceReader([0], ["w"])

    with pytest.raises(PayloadSizeError, match="announced 0"):
        reader.feed(memoryview(b"x"))


def test_fewer_bytes_than_announced_fail_at_finish_naming_the_incomplete_slice() -> None:
    reader = SliceReader([2, 4, 3], ["fc.b", "fc.w", "out.w"])
    reader.feed(memoryview(b"ab"))
    reader.feed(memoryview(b"cde"))

    with pytest.raises(PayloadSizeError, match=r"after 5 bytes, .* announced 9 \(slice 'fc\.w' incomplete"):
        reader.finish()


def test_nothing_received_names_the_first_slice() -> None:
    reader = SliceReader([0, 4], ["empty", "w"])
    reader.initial()

    with pytest.raises(PayloadSizeError, match="slice 'w' incomplete"):
        reader.finish()


def test_empty_data_frames_are_harmless() -> None:
    reader = SliceReader([2], ["w"])

    assert reader.feed(memoryview(b"")) == []
    assert [bytes(v) for _, v in reader.feed(memoryview(b"ok"))] == [b"ok"]
    reader.finish()


# ---- FramePacker ----

def test_flush_with_nothing_queued_returns_none() -> None:
    packer = FramePacker(8)

    assert packer.flush() is None
    assert packer.add(b"") == []
    assert packer.flush() is None


def test_flush_returns_the_partly_filled_frame_once() -> None:
    packer = FramePacker(8)
    assert packer.add(b"abc") == []
    assert packer.add(b"de") == []

    frame = packer.flush()

    assert frame is not None and bytes(decode_data_frame(frame)) == b"abcde"  # type: ignore[arg-type]
    assert packer.flush() is None


def test_add_returns_each_frame_as_soon_as_it_is_full() -> None:
    packer = FramePacker(4)

    frames = packer.add(b"abcdefghij")

    assert [bytes(decode_data_frame(f)) for f in frames] == [b"abcd", b"efgh"]  # type: ignore[arg-type]
    assert packer.add(b"kl") == [packer_frame(b"ijkl")]
    assert packer.flush() is None


def packer_frame(payload: bytes) -> bytes:
    packer = FramePacker(len(payload))
    (frame,) = packer.add(payload)
    return frame


def test_frames_own_their_bytes_once_emitted() -> None:
    source = bytearray(b"abcd")
    packer = FramePacker(8)
    packer.add(source)
    frame = packer.flush()

    source[0:4] = b"zzzz"

    assert frame is not None and bytes(decode_data_frame(frame)) == b"abcd"  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [0, -1])
def test_chunk_size_must_be_positive(chunk: int) -> None:
    with pytest.raises(ValueError, match=f"chunk_bytes: got {chunk}"):
        FramePacker(chunk)
