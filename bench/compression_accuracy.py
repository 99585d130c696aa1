"""Test accuracy with compressed gradients against uncompressed training, same epochs and seed (issue 19).

Fashion-MNIST, `pshard launch --ps 2 --workers 2`, sync mode, the same flags and seed for every run; only
`--compression` differs (error feedback on). Prints one JSON line per compressor with the chief's test
accuracy, its gap to `none` in percentage points, and the compression ratio the workers saw; exits 1 when
a gap is past the bar.

The issue's bar is 0.5 pp. It is a statement about the end of training: top-k at 1 % sends each element
about every hundredth step, so it starts behind (the MLP: 4.9 pp after 1 epoch, 2.2 after 3, 1.5 after 8)
and catches up (0.38 pp after 15 epochs; sign at lr 0.005, 0.42 pp); give it the epochs (`--epochs`).

A compressor written NAME/PULL compresses the pulls too (`--pull-compression PULL`): "topk:0.01/topk:0.01".

    python -m bench.compression_accuracy [--epochs 15] [--model mlp] [--compression topk:0.01 sign]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.common import emit

DATA_DIR = Path(os.environ.get("DATA_DIR", "/usr/share/datasets/fashion-mnist"))
BAR_PP = 0.5
_FINAL = re.compile(r"^\[(worker-\d+)\] final: (.*)$")


def train(compression: str, epochs: int, model: str, timeout_s: float, lr: float = 0.05
          ) -> dict[str, dict[str, str]]:
    """Each worker's final-line fields after one launch with `compression`."""
    compression, _, pull = compression.partition("/")
    cmd = [sys.executable, "-m", "pshard.launcher", "--ps", "2", "--workers", "2", "--",
           "--mode", "sync", "--model", model, "--epochs", str(epochs), "--seed", "0", "--optimizer", "sgd",
           "--lr", str(lr), "--momentum", "0.9", "--data-dir", str(DATA_DIR), "--compression", compression,
           "--pull-compression", pull or "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if out.returncode != 0:
        raise SystemExit(f"{compression}: the launch failed ({out.returncode}):\n{out.stdout[-4000:]}")
    finals = {}
    for line in out.stdout.splitlines():
        if m := _FINAL.match(line):
            finals[m.group(1)] = dict(part.split("=", 1) for part in m.group(2).split() if "=" in part)
    return finals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compression_accuracy",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--compression", nargs="+", default=["topk:0.01", "sign"])
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--sign-lr", type=float, default=None,
                   help="the lr of the sign runs (default: the others'). Scaled sign moves every weight each "
                        "step: with momentum 0.9 it diverged at lr 0.05 and trained at 0.005")
    args = p.parse_args(argv)
    if not (DATA_DIR / "train-images-idx3-ubyte.gz").exists():
        raise SystemExit(f"Fashion-MNIST is not in {DATA_DIR} (make data)")
    base = float(train("none", args.epochs, args.model, args.timeout_s)["worker-0"]["test_accuracy"])
    emit("compression_accuracy", compression="none", epochs=args.epochs, model=args.model, test_accuracy=base)
    worst = 0.0
    for compression in args.compression:
        lr = args.sign_lr if compression.startswith("sign") and args.sign_lr is not None else 0.05
        finals = train(compression, args.epochs, args.model, args.timeout_s, lr)
        accuracy = float(finals["worker-0"]["test_accuracy"])
        gap_pp = round((base - accuracy) * 100, 2)
        worst = max(worst, gap_pp)
        emit("compression_accuracy", compression=compression, epochs=args.epochs, model=args.model, lr=lr,
             test_accuracy=accuracy, gap_pp=gap_pp, bar_pp=BAR_PP,
             compression_ratio=float(finals["worker-0"].get("compression_ratio", "1")))
    return 0 if worst <= BAR_PP else 1


if __name__ == "__main__":
    sys.exit(main())
