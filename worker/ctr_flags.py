"""`--model ctr`'s flags, and `TrainConfig`'s ctr fields from them (the model itself: pshard.worker.ctr).

Apart from the model so that the worker's parser loads no torch: `pshard worker --help` and its usage
errors come before torch's import.
"""

from __future__ import annotations

import argparse
from typing import Any

from pshard.common.argtypes import positive_float, positive_int
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.errors import ClusterConfigError, InvalidArgumentError
from pshard.common.sparse import ROW_DTYPES
from pshard.worker.config import CTR_MODEL, Defaults
from pshard.worker.ctr_data import CtrSpec


def add_ctr_arguments(parser: argparse.ArgumentParser) -> None:
    spec = CtrSpec()
    group = parser.add_argument_group(
        "ctr", "--model ctr: a CTR model (a sparse embedding table and an MLP) on a synthetic click log of "
        f"{spec.fields} Zipf-distributed categorical fields with labels from a planted model; the chief "
        "prints the test AUC beside the planted model's (the ceiling). --data-dir is not used")
    group.add_argument("--ctr-samples", metavar="N", type=positive_int, default=spec.train_samples,
                       help=f"training impressions, over all workers (default {spec.train_samples:,})")
    group.add_argument("--ctr-test-samples", metavar="N", type=positive_int, default=spec.test_samples,
                       help=f"test impressions (default {spec.test_samples:,})")
    group.add_argument("--ctr-ids", metavar="N", type=positive_int, default=spec.num_ids,
                       help=f"distinct ids over all fields (default {spec.num_ids:,})")
    group.add_argument("--table-lr", metavar="LR", type=positive_float, default=Defaults.TABLE_LR,
                       help=f"learning rate of the table's per-row Adagrad (default {Defaults.TABLE_LR:g})")
    group.add_argument("--table-row-dtype", choices=ROW_DTYPES, default="float32",
                       help="how the servers store and send the table's rows: float32 (default), float16, "
                       "bfloat16, or int8 (a byte a value, a scale and an offset per row); updates are "
                       "applied in float32 and rounded once per push")


def ctr_settings(args: argparse.Namespace, spec: ClusterSpec) -> dict[str, Any]:
    """TrainConfig's ctr fields from the flags; what --model ctr cannot do is a configuration error."""
    try:
        log_spec = CtrSpec(seed=args.seed, num_ids=args.ctr_ids, train_samples=args.ctr_samples,
                           test_samples=args.ctr_test_samples)
    except InvalidArgumentError as e:
        raise ClusterConfigError(str(e)) from None
    if args.model == CTR_MODEL:
        if args.output:
            raise ClusterConfigError("--output: not available with --model ctr, whose embedding rows live on "
                                     "the servers (their checkpoints and table exports hold them)")
        if spec.task_type == "evaluator":
            raise ClusterConfigError("task.type: evaluator tasks do not run --model ctr; the chief scores "
                                     "the test set at the end")
    return {"ctr": log_spec, "table_lr": args.table_lr, "table_row_dtype": args.table_row_dtype}
