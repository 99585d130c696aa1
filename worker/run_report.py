"""What a training run reports: JSON lines for machines, a progress display for people.

Both count epochs from 1, as people do: the record of the first epoch says ``"epoch": 1`` and
the console ``epoch 1/2``.

`MetricsLog` writes one JSON object per line and flushes each, so `tail -f`, a killed
worker and a crashed container all leave every event written so far. `Progress` shows a
tqdm bar only on a terminal; in a log file or `docker logs` a bar is a stream of carriage
returns, so there it prints one plain line per epoch instead.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

EVENTS = ("step", "epoch", "eval", "final")


class MetricsLog:
    """JSON lines `{"event": ..., "ts": <unix seconds>, ...}` to a file (appended) and/or a stream."""

    def __init__(
        self,
        path: str | Path | None = None,
        stream: IO[str] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        fields: dict[str, Any] | None = None,
    ) -> None:
        """`fields`: carried by every record (the worker's id and role), after event and ts."""
        self._clock = clock
        self._fields = dict(fields or {})
        self._stream = stream
        self._file: IO[str] | None = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Append: a restarted worker adds to its history instead of erasing it.
            self._file = path.open("a", encoding="utf-8")

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event and return the record as written."""
        if event not in EVENTS:
            raise ValueError(f"event: got {event!r}, expected one of {EVENTS}")
        record: dict[str, Any] = {"event": event, "ts": round(self._clock(), 6), **self._fields}
        record.update({key: _jsonable(value) for key, value in fields.items()})
        line = json.dumps(record, allow_nan=False) + "\n"
        for out in (self._file, self._stream):
            if out is not None:
                out.write(line)
                out.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Progress:
    """Per-epoch progress: a live bar on a TTY, one summary line per epoch elsewhere.

    progress.start_epoch(epoch, total_steps); progress.update(loss=...) per step;
    progress.end_epoch(loss=..., acc=...) prints `epoch 1/2: 938 steps in 21.4s, loss=0.41`.
    """

    def __init__(
        self,
        epochs: int,
        stream: IO[str] | None = None,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        live_every_s: float | None = None,
    ) -> None:
        """`live_every_s`: off a terminal, also a progress line this often (under the launcher,
        compose or Kubernetes the only sign of life between epoch lines)."""
        self.epochs = epochs
        self._live_every_s = live_every_s
        self._total: int | None = None
        self._samples = 0
        self._last_line = 0.0
        self._postfix: dict[str, float] = {}
        self._stream = stream if stream is not None else sys.stderr
        isatty = getattr(self._stream, "isatty", None)
        self.tty = tty if tty is not None else bool(isatty and isatty())
        self._clock = clock
        self._bar: tqdm | None = None
        self._epoch = 0
        self._steps = 0
        self._started = 0.0

    def start_epoch(self, epoch: int, total_steps: int | None) -> None:
        """`epoch` counts from 0; it is shown counting from 1."""
        self._close_bar()
        self._epoch, self._steps, self._started = epoch, 0, self._clock()
        self._total, self._samples, self._last_line = total_steps, 0, self._started
        if self.tty:
            self._bar = tqdm(
                total=total_steps,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                file=self._stream,
                unit="step",
                leave=False,
                dynamic_ncols=True,
            )

    def update(self, steps: int = 1, samples: int = 0, **postfix: float) -> None:
        self._steps += steps
        self._samples += samples
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=False)
            self._bar.update(steps)
        elif self._live_every_s is not None:
            now = self._clock()
            if now - self._last_line >= self._live_every_s:
                self._last_line = now
                self._live_line(now, postfix)

    def _live_line(self, now: float, postfix: dict[str, float]) -> None:
        of = f"/{self._total}" if self._total else ""
        parts = [f"epoch {self._epoch + 1}/{self.epochs}: step {self._steps}{of}"]
        parts += [f"{key}={_short(value)}" for key, value in postfix.items()]
        elapsed = now - self._started
        if self._samples and elapsed > 0:
            parts.append(f"{self._samples / elapsed:.0f} samples/s")
        self._stream.write(", ".join(parts) + "\n")
        self._stream.flush()

    def end_epoch(self, **summary: float) -> str:
        """Print and return the epoch's summary line."""
        self._close_bar()
        elapsed = self._clock() - self._started
        parts = [f"epoch {self._epoch + 1}/{self.epochs}: {self._steps} steps in {elapsed:.1f}s"]
        parts += [f"{key}={_short(value)}" for key, value in summary.items()]
        line = ", ".join(parts)
        self._stream.write(line + "\n")
        self._stream.flush()
        return line

    def close(self) -> None:
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _short(value: Any) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return f"{float(value):.4g}"
    return str(value)


def _jsonable(value: Any) -> Any:
    """Numpy/torch scalars become Python numbers; NaN and infinities become strings.

    Strings, because bare NaN (which Python's json writes by default) is not JSON and breaks
    jq and most other readers, while null would hide that a loss diverged.
    """
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        value = item()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
