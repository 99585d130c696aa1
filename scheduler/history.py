"""What the scheduler remembers of its drains, joins and partition moves (issue 20, `pshard status`, the
metrics): every record in progress, however many, and the last `keep_done` done ones, so that a long job's
history stays bounded while nothing in progress is ever dropped. Pure."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from pshard.scheduler.timed import Timed

K = TypeVar("K", bound=Hashable)
R = TypeVar("R", bound=Timed)


class History(Generic[K, R]):
    """Records by key, in the order they were added; done ones beyond `keep_done` are dropped, oldest
    first, as soon as one more is done."""

    def __init__(self, keep_done: int) -> None:
        self._records: dict[K, R] = {}
        self._keep_done = keep_done

    def add(self, key: K, record: R) -> R:
        """`record` last, in place of the one `key` had wherever it stood (a restart starts it again)."""
        self._records.pop(key, None)
        self._records[key] = record
        self._trim(record)
        return record

    def replace(self, key: K, record: R) -> R:
        """`record` where `key`'s record stands (progress, or its end); KeyError when there is none."""
        if key not in self._records:
            raise KeyError(key)
        self._records[key] = record
        self._trim(record)
        return record

    def remove(self, key: K) -> R:
        """Forget `key`'s record (a roll back); KeyError when there is none."""
        return self._records.pop(key)

    def current(self, key: K) -> R | None:
        """`key`'s record while it is in progress; None when there is none or it is done."""
        record = self._records.get(key)
        return record if record is not None and not record.done else None

    def items(self) -> list[tuple[K, R]]:
        """A copy, so that the caller may `replace` while it walks them."""
        return list(self._records.items())

    def all(self) -> tuple[R, ...]:
        return tuple(self._records.values())

    def in_progress(self) -> tuple[R, ...]:
        return tuple(r for r in self._records.values() if not r.done)

    def done(self) -> tuple[R, ...]:
        return tuple(r for r in self._records.values() if r.done)

    def _trim(self, record: R) -> None:
        if not record.done:
            return  # a record in progress adds none done
        done = [k for k, r in self._records.items() if r.done]
        for old in done[:max(0, len(done) - self._keep_done)]:
            del self._records[old]
