"""CPU cost of each gradient compressor per 100 MB of float32 gradients (issue 19).

A compressor pays where the link is slower than it packs: this prints, per compressor, the seconds a
worker spends packing 100 MB (25 M float32) and unpacking it for its residual, the seconds a server
spends unpacking it, and the bytes that travel instead. Divide the bytes saved by the seconds spent to
get the link speed (in bytes/s) above which it stops paying. One process, one core; numpy only.

    python -m bench.compression_cost [--numel 25000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from pshard.common.compression import Compressor
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
