"""``pshard evaluate MODEL``: reload a model pshard saved and print its test accuracy.

Everything needed comes from the description saved with the weights (pshard.worker.saved_model):
the architecture, the data set it was trained on, and the accuracy the chief measured, which this
command reproduces. ``--data-dir`` names where Fashion-MNIST is when it is not where the training
found it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

PROG = "pshard evaluate"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Reload a model saved by a pshard chief (--output) "
                                "and evaluate it on its data set's test split.")
    p.add_argument("model", metavar="MODEL", help="the model file a chief saved (--output)")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="Fashion-MNIST IDX files (default: the directory the training used, else "
                        "$PSHARD_DATA_DIR or /usr/share/datasets/fashion-mnist)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    import torch

    from pshard.common.errors import PSError
    from pshard.worker.data import default_data_dir, load_dataset
    from pshard.worker.model import evaluate
    from pshard.worker.saved_model import SavedModelError, load_model

    try:
        model, description = load_model(args.model)
        dataset = description["input"]["dataset"]
        data_dir = args.data_dir or description["training"].get("data_dir") or default_data_dir(os.environ)
        data = load_dataset(data_dir)
        if data.name != dataset:
            raise PSError(f"data: the model was trained on {dataset!r}, {data_dir!r} holds {data.name!r} "
                          "(pass --data-dir)")
        accuracy, loss = evaluate(model, data, torch.device("cpu"))
    except SavedModelError as err:  # a file that is missing or not a model: one line, as argparse's errors
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except (PSError, KeyError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    trained = description.get("metrics", {}).get("test_accuracy")
    result = {"model": args.model, "architecture": description["model"]["name"], "dataset": data.name,
              "test_accuracy": accuracy, "test_loss": loss, "trained_test_accuracy": trained}
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"{args.model}: {result['architecture']} on {data.name}: test_accuracy={accuracy:.4f} "
              f"test_loss={loss:.4f} (at the end of training: "
              f"{'unknown' if trained is None else f'{trained:.4f}'})")
    return 0
