"""``--tensorboard DIR``: the numbers of a worker's metrics records, as TensorBoard scalars too.

`TensorBoardLog` wraps the worker's `MetricsLog`: every record written to the JSON lines is also
written, through torch's `SummaryWriter`, to ``DIR/<node id>`` (one TensorBoard run per worker, so
that several workers sharing DIR are told apart). The JSON record stays the one source, so the two
never disagree. Which numbers become which tags is the pure `scalars`:

    step  -> train/loss, train/accuracy, train/samples_per_s      at the worker's step count
    epoch -> epoch/loss, epoch/accuracy, epoch/samples_per_s      at the epoch (from 1)
    eval  -> test/accuracy, test/loss                             at the worker's step count

torch's writer needs the ``tensorboard`` package (the ``worker`` extra installs it); it is imported
only when the flag is given.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from pshard.worker.run_report import MetricsLog

# event -> (the record's field holding the x value, {record field: tag})
TAGS: dict[str, tuple[str, dict[str, str]]] = {
    "step": ("step", {"loss": "train/loss", "accuracy": "train/accuracy",
                      "samples_per_s": "train/samples_per_s"}),
    "epoch": ("epoch", {"loss": "epoch/loss", "accuracy": "epoch/accuracy",
                        "samples_per_s": "epoch/samples_per_s"}),
    "eval": ("step", {"test_accuracy": "test/accuracy", "test_loss": "test/loss"}),
}


class Scalar(NamedTuple):
    tag: str
    value: float
    step: int
    wall_time: float


def scalars(record: dict[str, Any]) -> list[Scalar]:
    """The TensorBoard scalars of one metrics record (as `MetricsLog.log` returns it).

    Non-finite values, which the JSON spells as strings ("NaN"), are written as the floats they
    are: a diverging loss shows in TensorBoard as it happened. Fields a record lacks are skipped.
    """
    spec = TAGS.get(record.get("event", ""))
    if spec is None or not isinstance(record.get(spec[0]), int):
        return []
    x_field, tags = spec
    out = []
    for field, tag in tags.items():
        value = _number(record.get(field))
        if value is not None:
            out.append(Scalar(tag, value, record[x_field], float(record["ts"])))
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.lower().replace("infinity", "inf"))
    return None


def run_dir(directory: str | Path, node_id: str) -> Path:
    """Where a worker's event files go: one subdirectory (one TensorBoard run) per worker."""
    return Path(directory) / node_id


class TensorBoardLog:
    """A `MetricsLog` whose records are also written as TensorBoard scalars to `directory`."""

    def __init__(self, log: MetricsLog, directory: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch without the tensorboard package
            raise RuntimeError("--tensorboard needs the tensorboard package (in a clone: pip install "
                               f"'.[worker]'): {e}") from e
        self._log = log
        # flush_secs: a crashed or killed worker loses at most this much of its curves.
        self._writer = SummaryWriter(log_dir=str(directory), flush_secs=10)

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = self._log.log(event, **fields)
        for scalar in scalars(record):
            self._writer.add_scalar(scalar.tag, scalar.value, scalar.step, walltime=scalar.wall_time)
        return record

    def close(self) -> None:
        self._writer.close()
        self._log.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
