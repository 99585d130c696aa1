"""``pshard plot RUN.jsonl [RUN2.jsonl ...] -o curves.png``: training curves of one or more runs.

Reads the JSON lines a worker writes with ``--metrics`` (pshard.worker.run_report) and draws, per
worker of each run, the training loss and the accuracy against the step and against wall time
(seconds since the run's first record). Accuracy is the test accuracy of the chief's evaluations
where the file has them, and the running training accuracy of the step records besides. Each file
is one run, which several workers may have written (``make demo``): one colour per run, one line
style per worker. A run is labelled with its directory's name (``--label`` overrides). matplotlib
is imported here only, with the Agg backend: no display is needed, and nothing else in pshard pays
for the import.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROG = "pshard plot"


class PlotError(Exception):
    """A metrics file that cannot be read or holds nothing to draw; the message names it."""


@dataclass
class Curves:
    """One worker's series in one run, each as (x, y) lists; times in seconds since the run's first record."""

    label: str
    run: str = ""  # the run it belongs to: its lines share a colour
    worker_index: int = 0  # its place among the run's workers: its line style
    loss_step: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    loss_time: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    train_acc_step: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    train_acc_time: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    test_acc_step: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    test_acc_time: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # absent, or "NaN" as the worker writes a diverged loss
    return float(value) if math.isfinite(value) else None


def _records(path: Path) -> list[dict[str, object]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise PlotError(f"{path}: {err.strerror or err}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise PlotError(f"{path}:{number}: not a JSON line: {line[:60]!r}") from None
        if isinstance(record, dict):
            records.append(record)
    return records


def _worker_curves(records: list[dict[str, object]], label: str, start: float) -> Curves:
    curves = Curves(label)
    last_step = 0.0
    for r in records:
        ts, step = _number(r.get("ts")), _number(r.get("step"))
        if r.get("event") == "step" and step is not None and ts is not None:
            last_step = step
            for value, by_step, by_time in ((_number(r.get("loss")), curves.loss_step, curves.loss_time),
                                            (_number(r.get("accuracy")), curves.train_acc_step,
                                             curves.train_acc_time)):
                if value is not None:
                    by_step[0].append(step)
                    by_step[1].append(value)
                    by_time[0].append(ts - start)
                    by_time[1].append(value)
        elif r.get("event") == "eval" and ts is not None and (
                acc := _number(r.get("test_accuracy"))) is not None:
            curves.test_acc_step[0].append(step if step is not None else last_step)
            curves.test_acc_step[1].append(acc)
            curves.test_acc_time[0].append(ts - start)
            curves.test_acc_time[1].append(acc)
    return curves


def read_run(path: Path, label: str | None = None) -> list[Curves]:
    """A run's curves from its metrics file, one per worker that wrote to it, by name.

    Workers launched with one ``--metrics`` path (as ``make demo`` does) share a file: their steps
    interleave, so they are split by each record's ``worker`` field, or the lines would zig-zag
    between workers. A file of one worker gives one curve labelled `label` (default: the file's
    stem); several give ``"<label> <worker>"``. Times are seconds since the file's first record, so
    the workers of one run share a time axis. Raises PlotError when there is nothing to plot.
    """
    records = _records(path)
    label = label or path.stem
    stamps = [t for r in records if (t := _number(r.get("ts"))) is not None]
    start = min(stamps, default=0.0)
    by_worker: dict[str, list[dict[str, object]]] = {}
    for r in records:
        by_worker.setdefault(str(r.get("worker", "")), []).append(r)
    runs = []
    for index, (worker, mine) in enumerate(sorted(by_worker.items())):  # worker-0 first: solid lines
        curves = _worker_curves(mine, label if len(by_worker) == 1 else f"{label} {worker}", start)
        curves.run, curves.worker_index = label, index
        if curves.loss_step[0] or curves.test_acc_step[0]:
            runs.append(curves)
    if not runs:
        raise PlotError(f"{path}: no 'step' or 'eval' records with numbers to plot "
                        "(was it written by 'pshard worker --metrics'?)")
    return runs


def run_labels(paths: Sequence[Path]) -> list[str]:
    """A legend label per metrics file: its run directory's name (``runs/sync/metrics.jsonl`` -> sync).

    Runs are kept in one directory each (a launch's ``--metrics runs/<run>/metrics.jsonl``), and the
    files in them are named after what wrote them (metrics, worker-0), which tells runs apart by
    nothing. Files that share a directory are labelled by their stems instead, and files whose stems
    collide too by their paths, so that no two runs ever share a label.
    """
    for candidates in ([p.absolute().parent.name for p in paths], [p.stem for p in paths]):
        if all(candidates) and len(set(candidates)) == len(candidates):
            return candidates
    return [str(p) for p in paths]


_STYLES = ("-", "--", ":", "-.")  # a run's workers, in order: one colour per run, one style per worker


def plot(runs: Sequence[Curves], output: Path, title: str | None = None) -> Path:
    """Draw loss and accuracy against step and wall time into `output` (PNG, or what its suffix says)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharey="row")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    run_colors = {name: colors[i % len(colors)] for i, name in enumerate(dict.fromkeys(r.run for r in runs))}
    for run in runs:
        color, style = run_colors[run.run], _STYLES[run.worker_index % len(_STYLES)]
        for column, (loss, train, test) in enumerate((
                (run.loss_step, run.train_acc_step, run.test_acc_step),
                (run.loss_time, run.train_acc_time, run.test_acc_time))):
            axes[0][column].plot(*loss, color=color, linestyle=style, label=run.label, linewidth=1.2)
            axes[1][column].plot(*train, color=color, linestyle=style, label=f"{run.label} (train)",
                                 linewidth=1.0, alpha=0.6)
            if test[0]:
                axes[1][column].plot(*test, color=color, marker="o", linestyle=style,
                                     label=f"{run.label} (test)")
    for column, xlabel in enumerate(("step", "wall time (s)")):
        axes[0][column].set_title(f"training loss by {xlabel.split(' (')[0]}")
        axes[1][column].set_title(f"accuracy by {xlabel.split(' (')[0]}")
        axes[1][column].set_xlabel(xlabel)
        for row in (0, 1):
            axes[row][column].grid(True, alpha=0.3)
    axes[0][0].set_ylabel("loss")
    axes[1][0].set_ylabel("accuracy")
    axes[0][0].legend(fontsize="small")
    axes[1][1].legend(fontsize="small", loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=80)
    plt.close(fig)
    return output


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Plot loss and accuracy against step and wall time "
                                "from metrics JSON lines (pshard worker --metrics), one run per file.")
    p.add_argument("runs", metavar="RUN.jsonl", nargs="+", type=Path,
                   help="metrics files, one per run; a file several workers wrote gives a line per worker")
    p.add_argument("-o", "--output", metavar="PNG", type=Path, default=Path("curves.png"),
                   help="image to write (default curves.png)")
    p.add_argument("--label", action="append", default=None,
                   help="a run's legend label, once per file in order (default: the name of the file's "
                   "directory, e.g. sync for runs/sync/metrics.jsonl; the file's name where files share one)")
    p.add_argument("--title", help="the figure's title")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    labels = args.label or []
    if labels and len(labels) != len(args.runs):
        parser.error(f"--label: got {len(labels)}, expected one per run ({len(args.runs)})")
    labels = labels or run_labels(args.runs)
    try:
        runs = [curves for path, label in zip(args.runs, labels, strict=True)
                for curves in read_run(path, label)]
    except PlotError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        out = plot(runs, args.output, args.title)
    except ImportError:
        print(f"{prog}: error: matplotlib is not installed (in a clone: pip install '.[plot]')",
              file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
