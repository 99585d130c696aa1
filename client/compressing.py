"""The worker's side of gradient compression: each slice packed by its compressor, with error feedback.

Error feedback (EF-SGD): what a lossy compressor does not send of a slice is kept, per slice, as a
residual and added to the next gradient of that slice, so nothing is dropped, only delayed. The
bookkeeping is exact by construction: `acc = residual + gradient` (float32), `sent = decode(encode(acc))`
(what the server will see, unpacked as it unpacks it), `residual = acc - sent`. Top-k, random-k and
the casts send elements of `acc` as they are (or rounded to a neighbour within a factor of two), so
`sent + residual == acc` holds bit for bit; scaled sign's residual is within one float32 rounding of it.

The residuals are the worker's state (PSTrainer.state_dict()); a restarted worker that did not load
them starts from zero residuals, which loses at most the last steps' unsent parts.

Pure: numpy only (the client's transport code calls it; no gRPC here).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from pshard.common.cluster.layout import LayoutSlice
from pshard.common.compression import Compressor, PullPack
from pshard.common.errors import InvalidArgumentError, PayloadSizeError, ShapeMismatchError
from pshard.common.types import SliceKey
from pshard.common.wire import compress
from pshard.common.wire.codec import WireArray


@dataclass
class CompressionStats:
    """What compression did: bytes per slice before and after (the last step's), running totals, the
    residuals' L2 norms per parameter, and the seconds spent packing (and unpacking for the residual)."""

    slice_bytes: dict[SliceKey, tuple[int, int]] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    residual_norms: dict[str, float] = field(default_factory=dict)
    compress_s: float = 0.0
    last_compress_s: float = 0.0
    steps: int = 0

    @property
    def ratio(self) -> float:
        """Bytes before over bytes after, over every step so far (1.0 before the first)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else 1.0


class PushEncoder:
    """Packs a step's gradients slice by slice with each parameter's compressor (`plan`), keeping the
    residual of what was not sent when `error_feedback` is on. Parameters the plan leaves uncompressed
    are not touched (they travel as today, in the job's wire dtype if any)."""

    def __init__(self, plan: Mapping[str, Compressor], sizes: Mapping[str, int],
                 error_feedback: bool = True) -> None:
        self.plan = {k: c for k, c in plan.items() if c.lossy}
        self._sizes = {k: sizes[k] for k in self.plan}
        self.error_feedback = error_feedback
        self._residuals: dict[str, np.ndarray] = {}
        self.stats = CompressionStats()

    def compresses(self, key: str) -> bool:
        return key in self.plan

    def encode(self, grads: Mapping[str, np.ndarray], slices: Iterable[LayoutSlice], clock: int
               ) -> dict[SliceKey, WireArray]:
        """The packed slices of this step's compressed parameters in `grads` (flat arrays), keyed by slice.
        Called once per step: it moves the residuals on."""
        started = time.perf_counter()
        by_key: dict[str, list[LayoutSlice]] = {}
        for s in slices:
            if s.key in self.plan and s.key in grads:
                by_key.setdefault(s.key, []).append(s)
        out: dict[SliceKey, WireArray] = {}
        for key, cuts in by_key.items():
            out.update(self._encode_key(key, grads[key], cuts, clock))
        spent = time.perf_counter() - started
        self.stats.last_compress_s = spent
        self.stats.compress_s += spent
        self.stats.steps += 1
        return out

    def _encode_key(self, key: str, grad: np.ndarray, cuts: list[LayoutSlice], clock: int
                    ) -> dict[SliceKey, WireArray]:
        compressor = self.plan[key]
        acc = np.asarray(grad, dtype=np.float32).reshape(-1)
        residual = self._residuals.get(key)
        if self.error_feedback:
            # A new array (the caller's gradient is left alone) that becomes the next residual in place.
            acc = acc + residual if residual is not None else acc.copy()
        out = {}
        for s in cuts:
            part = acc[s.offset:s.offset + s.numel]
            wire = compress.encode(compressor, part, s.slice_key, clock)
            out[s.slice_key] = wire
            self.stats.slice_bytes[s.slice_key] = (s.numel * np.dtype(grad.dtype).itemsize, wire.array.nbytes)
            self.stats.bytes_before += s.numel * np.dtype(grad.dtype).itemsize
            self.stats.bytes_after += wire.array.nbytes
            if self.error_feedback:
                compress.subtract_sent(part, wire, s.slice_key, clock)  # part is now acc - sent
        if self.error_feedback:
            self._residuals[key] = acc
            self.stats.residual_norms[key] = float(np.linalg.norm(acc))
        return out

    # ---- state ----

    def state(self) -> dict[str, np.ndarray]:
        """The residuals, per parameter (copies)."""
        return {k: r.copy() for k, r in self._residuals.items()}

    def load_state(self, residuals: Mapping[str, np.ndarray]) -> None:
        """Put back residuals from `state()`; a parameter this job does not compress, or of another size,
        is refused naming it, and nothing is loaded."""
        loaded = {}
        for key, value in residuals.items():
            if key not in self.plan:
                raise InvalidArgumentError(f"compression residual {key!r}: this job does not compress it "
                                           f"(compressed: {sorted(self.plan)[:6]})")
            flat = np.asarray(value, dtype=np.float32).reshape(-1)
            if flat.size != self._sizes[key]:
                raise ShapeMismatchError(f"compression residual {key!r}: got {flat.size} elements, the "
                                         f"parameter has {self._sizes[key]}")
            loaded[key] = flat.copy()
        self._residuals = loaded


class PullDecoder:
    """The worker's side of compressed pulls (docs/guide/compression.md, Compressed pulls): its copy of
    each compressed parameter, and per slice how many pulls it applied since the copy came whole.

    A slice's first pull comes whole, in float32 (base 0); each later one is the server's packed change
    since the copy, added to it in float32 as the server adds it to its own copy of the copy, so the two
    stay equal bit for bit. What a pull leaves unsent stays on the server (its value minus the copy) for
    the next one. `lost` sends slices back to whole (a server that refused their base)."""

    def __init__(self, compressor: Compressor, keys: Iterable[str], sizes: Mapping[str, int]) -> None:
        self.compressor = compressor
        self._copies = {k: np.zeros(sizes[k], dtype=np.float32) for k in keys}
        self._bases: dict[SliceKey, int] = {}
        self.bytes_before = 0
        self.bytes_after = 0

    def pulls(self, key: str) -> bool:
        return key in self._copies

    def pack(self, s: LayoutSlice) -> PullPack:
        """How `s` is to be pulled now."""
        if s.key not in self._copies:
            return PullPack()
        base = self._bases.get(s.slice_key, 0)
        k = self.compressor.k(s.numel) if self.compressor.name == "topk" else 0
        return PullPack(self.compressor.name, k, base)

    def nbytes(self, s: LayoutSlice, pack: PullPack) -> int:
        """The bytes the reply carries for `s` pulled as `pack` (a packed one; whole ones are float32)."""
        if pack.base == 0:
            return 4 * s.numel
        return compress.packed_nbytes(pack.encoding, s.numel, pack.k)

    def apply(self, s: LayoutSlice, pack: PullPack, raw: np.ndarray, clock: int) -> np.ndarray:
        """Land a pulled slice's bytes on the copy; the copy's part of `s` (a view, to be copied out)."""
        part = self._copies[s.key][s.offset:s.offset + s.numel]
        raw = np.asarray(raw).reshape(-1).view(np.uint8)
        expected = self.nbytes(s, pack)
        if raw.nbytes != expected:
            raise PayloadSizeError(f"pulled slice {str(s.slice_key)!r}: got {raw.nbytes} bytes, "
                                   f"{pack.encoding} with base {pack.base} needs {expected}")
        if pack.base == 0:
            part[:] = raw.view(np.float32)
        else:
            compress.add_sent(part, WireArray(raw, "uint8", pack.encoding), s.slice_key, clock)
        self._bases[s.slice_key] = pack.base + 1
        self.bytes_before += 4 * s.numel
        self.bytes_after += raw.nbytes
        return part

    def lost(self, slices: Iterable[LayoutSlice]) -> None:
        """Pull these slices whole next time."""
        for s in slices:
            self._bases.pop(s.slice_key, None)

    def copy_of(self, key: str) -> np.ndarray:
        return self._copies[key].copy()

    @property
    def nbytes_held(self) -> int:
        return sum(c.nbytes for c in self._copies.values())
