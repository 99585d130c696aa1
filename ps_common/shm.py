"""Shared-memory segments for the same-host fast path: layout, nonce, naming, orphan sweep.

A worker creates one segment per server: a file in a shared directory (/dev/shm by default),
mapped by both processes. Page 0 is the header (magic, nonce, region sizes); then the request
region (the worker's gradients, page-aligned one after another in request order) and the reply
region (pulled slices, at offsets the server picks and reports). Only doorbells and small
metadata cross a socket (docs/architecture.md, 11 Transports).

Names carry the creator's pid namespace and pid plus a random token, so a process can tell a
dead creator's orphan from a live peer's segment and remove it (`sweep_orphans`); a pid from
another pid namespace (another container) is never judged.

Pure: no gRPC, no protobuf.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import struct
import threading
from pathlib import Path

import numpy as np
from pshard.common.errors import InvalidArgumentError

PAGE = mmap.PAGESIZE
DEFAULT_SHM_DIR = "/dev/shm"
_MAGIC = b"PSHMSEG1"
_HEADER = struct.Struct("<8s16sQQ")  # magic, nonce, request bytes, reply bytes
NONCE_BYTES = 16
_NAME = re.compile(r"^pshard-w-(?P<ns>\d+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{16})\.seg$")


def align(n: int) -> int:
    """`n` rounded up to whole pages: copies between page-aligned buffers run at memory speed."""
    return -(-n // PAGE) * PAGE


def pid_namespace() -> int:
    """This process's pid namespace (0 when unknown): pids of another namespace mean nothing here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(pid: int | None = None) -> str:
    return f"pshard-w-{pid_namespace()}-{pid or os.getpid()}-{secrets.token_hex(8)}.seg"


def parse_segment_name(name: str) -> tuple[int, int] | None:
    """(pid namespace, pid) of a segment file name, or None for any other name."""
    m = _NAME.match(name)
    return (int(m["ns"]), int(m["pid"])) if m else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_orphans(directory: str | Path) -> list[Path]:
    """Remove the segments whose creator (in our pid namespace) is dead; the paths removed."""
    own_ns = pid_namespace()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            parsed = parse_segment_name(entry.name)
            if parsed is None or parsed[0] != own_ns or pid_alive(parsed[1]):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


# Segments this process created and has not removed yet: removed at exit, whatever the path out.
_owned: set[Path] = set()
_owned_lock = threading.Lock()


def _remove_owned() -> None:
    with _owned_lock:
        for path in list(_owned):
            with contextlib.suppress(OSError):
                path.unlink()
        _owned.clear()


atexit.register(_remove_owned)


class Segment:
    """One mapped segment: `request` and `reply` are page-aligned uint8 views of its regions."""

    def __init__(self, path: Path | None, mapping: mmap.mmap, request_bytes: int, reply_bytes: int,
                 nonce: bytes, owner: bool) -> None:
        self.path = path
        self.nonce = nonce
        self.request_bytes = request_bytes
        self.reply_bytes = reply_bytes
        self._owner = owner
        self._mapping: mmap.mmap | None = mapping
        whole = np.frombuffer(mapping, dtype=np.uint8)
        self.request: np.ndarray = whole[PAGE:PAGE + request_bytes]
        self.reply: np.ndarray = whole[PAGE + request_bytes:PAGE + request_bytes + reply_bytes]

    @classmethod
    def create(cls, directory: str | Path, request_bytes: int, reply_bytes: int) -> Segment:
        """A new segment of this process (removed by `close`, or at exit), its nonce written inside."""
        request_bytes, reply_bytes = align(request_bytes), align(reply_bytes)
        path = Path(directory) / segment_name()
        nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        with _owned_lock:
            _owned.add(path)
        try:
            # Reserve every page now: on a tmpfs too small (Docker's default /dev/shm is 64 MB) this
            # fails here, and the pair takes another transport, instead of a SIGBUS mid-step.
            os.posix_fallocate(fd, 0, PAGE + request_bytes + reply_bytes)
            mapping = mmap.mmap(fd, PAGE + request_bytes + reply_bytes)
        except OSError:
            cls._forget(path)
            raise
        finally:
            os.close(fd)
        mapping[:_HEADER.size] = _HEADER.pack(_MAGIC, nonce, request_bytes, reply_bytes)
        return cls(path, mapping, request_bytes, reply_bytes, nonce, owner=True)

    @classmethod
    def open(cls, directory: str | Path, name: str) -> Segment:
        """Map a peer's segment by file name (no path: only files of `directory` can be opened)."""
        if parse_segment_name(name) is None:
            raise InvalidArgumentError(f"segment: got {name!r}, not a pshard segment name")
        path = Path(directory) / name
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                raise InvalidArgumentError(f"segment {name!r}: {size} bytes, smaller than its header")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, nonce, request_bytes, reply_bytes = _HEADER.unpack_from(mapping, 0)
        if magic != _MAGIC or PAGE + request_bytes + reply_bytes != size:
            mapping.close()
            raise InvalidArgumentError(f"segment {name!r}: bad header (size {size})")
        return cls(path, mapping, request_bytes, reply_bytes, nonce, owner=False)

    @classmethod
    def private(cls, request_bytes: int, reply_bytes: int) -> Segment:
        """The same regions in this process's own memory (the TCP transport's reusable buffers);
        pages are only allocated when first written."""
        request_bytes, reply_bytes = align(request_bytes), align(reply_bytes)
        mapping = mmap.mmap(-1, PAGE + request_bytes + reply_bytes)
        return cls(None, mapping, request_bytes, reply_bytes, b"", owner=False)

    @staticmethod
    def _forget(path: Path | None) -> None:
        if path is None:
            return
        with contextlib.suppress(OSError):
            path.unlink()
        with _owned_lock:
            _owned.discard(path)

    def unlink(self) -> None:
        """Remove the file (either side may: the survivor cleans up); the mapping stays valid."""
        self._forget(self.path)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap (and remove the file: by default only when this process created it)."""
        if unlink if unlink is not None else self._owner:
            self.unlink()
        mapping, self._mapping = self._mapping, None
        self.request = self.reply = np.empty(0, np.uint8)
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still alive elsewhere: GC unmaps later
                mapping.close()

    @property
    def closed(self) -> bool:
        return self._mapping is None


def packed(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of buffers of `sizes` laid out one after another, each page-aligned; total bytes."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += align(size)
    return offsets, end
