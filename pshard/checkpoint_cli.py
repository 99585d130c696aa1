"""``pshard checkpoint``: list, export and prune the global checkpoints under a directory.

    pshard checkpoint list ROOT                 committed checkpoints (checksums verified) and torn ones
    pshard checkpoint export ROOT --out DIR     the newest committed one (or --clock N) as a torch
                                                state_dict (DIR/model.pt) and the sparse tables'
                                                ids.npy / rows.npy (DIR/tables/<table>/)
    pshard checkpoint prune ROOT --keep-checkpoints K
    pshard checkpoint compact ROOT              fold the newest (or --clock N) incremental checkpoint's
                                                chain into a new full one beside it

The format is pshard.common.checkpoint_store (docs/architecture.md, 9 Failures): the export needs no
server and does not depend on how many servers wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pshard.common import checkpoint_store as ckpt
from pshard.common.argtypes import non_negative_int, positive_int

PROG = "pshard checkpoint"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="list, export or prune global checkpoints")
    sub = p.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="committed checkpoints (checksums verified) and torn ones")
    listing.add_argument("root", help="the checkpoint root (the chief's --global-checkpoint-dir)")
    listing.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    export = sub.add_parser("export", help="a torch state_dict of the dense parameters, and the tables")
    export.add_argument("root", help="the checkpoint root, or one checkpoint's directory")
    export.add_argument("--out", required=True, help="directory to write model.pt and tables/ into")
    export.add_argument("--clock", type=non_negative_int,
                        help="the checkpoint at this clock (default: the newest)")
    prune = sub.add_parser("prune", help="delete all but the newest K committed checkpoints")
    prune.add_argument("root", help="the checkpoint root")
    prune.add_argument("--keep-checkpoints", type=positive_int, required=True, metavar="K",
                       help="how many to keep")
    compact = sub.add_parser("compact", help="fold an incremental checkpoint's chain into a new full one")
    compact.add_argument("root", help="the checkpoint root, or one checkpoint's directory")
    compact.add_argument("--clock", type=non_negative_int,
                         help="the checkpoint at this clock (default: the newest)")
    return p


def choose(root: Path, clock: int | None) -> ckpt.Checkpoint:
    """The committed checkpoint in `root` (a checkpoint directory) or under it (newest, or at `clock`)."""
    if (root / ckpt.MANIFEST).exists():
        return ckpt.load_manifest(root, verify=True)
    committed, torn = ckpt.scan(root, verify=True)
    for t in torn:
        print(f"{PROG}: ignoring torn checkpoint {t.path}: {t.reason}", file=sys.stderr)
    if clock is not None:
        committed = [c for c in committed if c.clock == clock]
    if not committed:
        at = f" at clock {clock}" if clock is not None else ""
        raise ckpt.CheckpointError(f"no committed checkpoint{at} in {root}")
    return committed[-1]


def export(checkpoint: ckpt.Checkpoint, out: Path) -> tuple[Path, dict[str, int]]:
    """Write `out/model.pt` (a plain state_dict: name -> tensor in the parameter's shape and dtype)
    and `out/tables/<table>/{ids,rows}.npy` (the live rows of every part, in the sparse table
    export's format); (the state_dict's path, rows per table)."""
    import torch  # only here: listing and pruning need no torch

    out.mkdir(parents=True, exist_ok=True)
    links = ckpt.chain(checkpoint)  # an incremental checkpoint is read with every link, all verified
    with ckpt.DenseReader(checkpoint, links) as reader:
        state = {key: torch.from_numpy(np.ascontiguousarray(reader.full(key))) for key in reader.keys}
    model = out / "model.pt"
    torch.save(state, model)
    rows: dict[str, int] = {}
    for name, chunks in ckpt.table_rows(checkpoint, links).items():
        folder = out / "tables" / _file_name(name)
        folder.mkdir(parents=True, exist_ok=True)
        ids = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
        values = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros((0, 0), np.float32)
        np.save(folder / "ids.npy", ids)
        np.save(folder / "rows.npy", values)
        rows[name] = len(ids)
    return model, rows


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    root = Path(args.root)
    try:
        if args.action == "list":
            committed, torn = ckpt.scan(root, verify=True)
            if args.json:
                print(json.dumps({"committed": [{"path": str(c.path), "clock": c.clock, "servers": c.servers,
                                                 "job_id": c.job.job_id, "parent": c.parent}
                                                for c in committed],
                                  "torn": [{"path": str(t.path), "reason": t.reason} for t in torn]}))
            else:
                for c in committed:
                    chained = f" incremental-over={c.parent}" if c.parent else ""
                    print(f"committed clock={c.clock} servers={c.servers} job={c.job.job_id or '-'}{chained} "
                          f"{c.path}")
                for t in torn:
                    print(f"torn {t.path}: {t.reason}")
        elif args.action == "export":
            checkpoint = choose(root, args.clock)
            model, rows = export(checkpoint, Path(args.out))
            print(f"exported clock {checkpoint.clock} of {checkpoint.path}: {model}"
                  + "".join(f", table {n}: {r} rows" for n, r in rows.items()))
        elif args.action == "compact":
            from pshard.ps_server.checkpoints.compaction import compact  # the server's part writer

            checkpoint = choose(root, args.clock)
            if checkpoint.parent is None:
                print(f"{checkpoint.path} is a full checkpoint already: nothing to fold")
            else:
                folded = compact(checkpoint)
                print(f"folded the {checkpoint.depth + 1} links of {checkpoint.path} into {folded.path} "
                      "(prune removes the chain)")
        else:
            for gone in ckpt.retain(root, args.keep_checkpoints):
                print(f"removed {gone}")
    except OSError as err:  # a file or directory that cannot be read or written: exit 2, as usage errors
        print(f"{prog}: error: {err.filename or args.root}: {err.strerror or err}", file=sys.stderr)
        return 2
    except (ckpt.CheckpointError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
