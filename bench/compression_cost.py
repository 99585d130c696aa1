"""CPU cost of each gradient compressor per 100 MB of float32 gradients (issue 19).

A compressor pays where the link is slower than it packs: this prints, per compressor, the seconds a
worker spends packing 100 MB (25 M float32) and unpacking it for its residual, the seconds a server
spends unpacking it, and the bytes that travel instead. Divide the bytes saved by the seconds spent to
get the link speed (in bytes/s) above which it stops paying. One process, one core; numpy only.

A compressed pull (`pull topk:0.01`, `pull sign`) costs the server, per worker, the change since the
worker's copy, its packing and its addition to the server's copy ("serve"), and the worker the addition
to its own ("apply"): printed per 100 MB pulled, on a change as dense as the gradients.

    python -m bench.compression_cost [--numel 25000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from pshard.common.compression import Compressor, PullPack
from pshard.common.types import SliceKey
from pshard.common.wire import compress

from bench.common import emit

COMPRESSORS = ("topk:0.01", "randomk:0.01", "sign", "bf16", "fp16")
# One slice of the default layout (4 MiB): what a worker packs at a time.
SLICE_NUMEL = 1 << 20


def seconds(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compression_cost",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    grads = np.random.default_rng(0).standard_normal(args.numel, dtype=np.float32)
    starts = range(0, args.numel, SLICE_NUMEL)
    cuts = [(SliceKey("w", i), grads[o:o + SLICE_NUMEL]) for i, o in enumerate(starts)]
    scale = 100e6 / grads.nbytes
    for name in COMPRESSORS:
        compressor = Compressor.parse(name)
        packed = [(key, compress.encode(compressor, part, key, 0), part.size) for key, part in cuts]
        pack_s = seconds(lambda c=compressor: [compress.encode(c, part, key, 0) for key, part in cuts],
                         args.repeats)
        unpack_s = seconds(lambda p=packed: [compress.decode(w, n, key, 0) for key, w, n in p], args.repeats)
        sent = sum(w.array.nbytes for _, w, _ in packed)
        emit("compression_cost", compressor=name, per_100mb_pack_s=round(pack_s * scale, 3),
             per_100mb_unpack_s=round(unpack_s * scale, 3), per_100mb_sent_mb=round(sent * scale / 1e6, 2),
             ratio=round(grads.nbytes / sent, 1),
             pays_below_gbit_s=round((grads.nbytes - sent) * 8 / 1e9 / (pack_s + 2 * unpack_s), 2))
    for name in ("topk:0.01", "sign"):
        pull_cost(name, grads, cuts, scale, args.repeats)
    return 0


def pull_cost(name: str, grads: np.ndarray, cuts: list[tuple[SliceKey, np.ndarray]], scale: float,
              repeats: int) -> None:
    """A server's serving of one worker's compressed pull of every slice, and the worker's applying it."""
    from pshard.client.compressing import PullDecoder
    from pshard.common.cluster.layout import LayoutSlice
    from pshard.ps_server.core.pull_copies import PullCopies

    compressor = Compressor.parse(name)
    copies, values = PullCopies(), [part + np.float32(1e-3) * part[::-1] for _, part in cuts]
    layout = [LayoutSlice("w", key.part, 0, key.part * SLICE_NUMEL, part.size) for key, part in cuts]
    decoder = PullDecoder(compressor, ["w"], {"w": grads.size})
    for (key, part), s in zip(cuts, layout, strict=True):
        copies.serve("w0", key, part, PullPack(), 0)  # the worker's copy: the old value
        decoder.apply(s, decoder.pack(s), part.view(np.uint8), 0)
    packs = [decoder.pack(s) for s in layout]
    served: list[object] = []

    def serve() -> None:
        served[:] = [copies.serve("w0", key, value, pack, 1)
                     for (key, _), value, pack in zip(cuts, values, packs, strict=True)]

    serve_s = seconds(serve, repeats)
    apply_s = seconds(lambda: [decoder.apply(s, pack, w.array.view(np.uint8), 1)  # type: ignore[attr-defined]
                               for s, pack, w in zip(layout, packs, served, strict=True)], repeats)
    sent = sum(w.array.nbytes for w in served)  # type: ignore[attr-defined]
    emit("compression_cost", compressor=f"pull {name}", per_100mb_serve_s=round(serve_s * scale, 3),
         per_100mb_apply_s=round(apply_s * scale, 3), per_100mb_sent_mb=round(sent * scale / 1e6, 2),
         ratio=round(grads.nbytes / sent, 1))


if __name__ == "__main__":
    sys.exit(main())
