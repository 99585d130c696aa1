"""Shared-memory segments for the same-host fast path: layout, sealing, hand-off, orphan sweep.

A worker creates one segment per server: an anonymous memfd, sized once and then **sealed against
shrinking and growing** (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), and passes its descriptor to the
server over the server's unix socket in the shared directory (SCM_RIGHTS). Page 0 is the header
(magic, nonce, region sizes); then the request region (the worker's gradients, page-aligned one after
another in request order) and the reply region (pulled slices, at offsets the server picks and
reports). Only doorbells and small metadata cross the socket (docs/architecture.md, 11 Transports).

Why sealed memfds: the server maps memory a possibly hostile worker controls. A mapped file that its
owner truncates makes every later access past the new end a SIGBUS, which kills the server (Python
cannot recover from it). Checking the size with fstat before each access races with a truncate;
reading with pread instead of mapping costs a copy of every gradient. A seal is checked once, by the
server, on the descriptor it received (`Segment.adopt` refuses an unsealed one, or any other kind of
file); the kernel then refuses ftruncate, and growing writes, to everyone, the creator included,
so the mapping stays valid for its lifetime with no copy and no per-access check. Punching holes
stays possible but only gives zero pages back, never a fault.

Memfds have no name in any directory, so a segment cannot leak: it goes when the last process that
maps it closes or dies, however it dies. What lives in the directory is the server's unix socket;
its name carries the pid namespace and pid of its server plus a random token, so a process can tell
a dead server's orphan from a live one's and remove it (`sweep_orphans`); a pid from another pid
namespace (another container) is never judged. Same host is detected by the hand-off itself: a unix
socket only connects, and a descriptor only passes, within one kernel.

Pure: no gRPC, no protobuf.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import fcntl
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from pshard.common.errors import InvalidArgumentError

PAGE = mmap.PAGESIZE
DEFAULT_SHM_DIR = "/dev/shm"
_MAGIC = b"PSHMSEG1"
_HEADER = struct.Struct("<8s16sQQ")  # magic, nonce, request bytes, reply bytes
NONCE_BYTES = 16
_NAME = re.compile(r"^pshard-[sw]-(?P<ns>\d+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{16})\.(?:sock|seg)$")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MEMFD_NAME = "pshard-segment"  # as /proc/<pid>/maps shows the mapping: "/memfd:pshard-segment"


def align(n: int) -> int:
    """`n` rounded up to whole pages: copies between page-aligned buffers run at memory speed."""
    return -(-n // PAGE) * PAGE


def pid_namespace() -> int:
    """This process's pid namespace (0 when unknown): pids of another namespace mean nothing here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def socket_name(pid: int | None = None) -> str:
    """A fresh name for a server's hand-off socket in the shared directory."""
    return f"pshard-s-{pid_namespace()}-{pid or os.getpid()}-{secrets.token_hex(8)}.sock"


def parse_socket_name(name: str) -> tuple[int, int] | None:
    """(pid namespace, pid) of a pshard file name in the shared directory, or None for any other name."""
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
    """Remove the pshard files (sockets, and segment files of older versions) whose creator in our
    pid namespace is dead; the paths removed."""
    own_ns = pid_namespace()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            parsed = parse_socket_name(entry.name)
            if parsed is None or parsed[0] != own_ns or pid_alive(parsed[1]):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


# Hand-off sockets this process created and has not removed yet: removed at exit, whatever the path out.
_owned: set[Path] = set()
_owned_lock = threading.Lock()


def _remove_owned() -> None:
    with _owned_lock:
        for path in list(_owned):
            with contextlib.suppress(OSError):
                path.unlink()
        _owned.clear()


atexit.register(_remove_owned)


_SUN_PATH_MAX = 107  # sockaddr_un's path, without its terminating NUL


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """`path` as a unix socket address: a directory too deep for sockaddr_un is reached through
    /proc/self/fd (a short path that the kernel resolves to it)."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def connect(path: Path, timeout_s: float) -> socket.socket:
    """A unix stream socket connected to `path` (OSError if nobody listens there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        with _addressable(path) as address:
            sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


def listen(directory: str | Path) -> tuple[socket.socket, Path]:
    """A listening unix socket of this process in `directory` (removed by `remove`, or at exit)."""
    path = Path(directory) / socket_name()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _owned_lock:
            _owned.add(path)
        with _addressable(path) as address:
            sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        remove(path)
        raise
    return sock, path


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
    with _owned_lock:
        _owned.discard(path)


def send_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    """`data` with a copy of descriptor `fd` attached (SCM_RIGHTS): unix sockets only."""
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_with_fds(sock: socket.socket, nbytes: int, max_fds: int = 1) -> tuple[bytes, list[int]]:
    """Up to `nbytes` and the descriptors that came with them (close-on-exec; the caller owns them:
    any it does not want it must close). Extra descriptors beyond `max_fds` are closed by the kernel."""
    size = socket.CMSG_SPACE(max_fds * array.array("i").itemsize)
    data, ancillary, _flags, _addr = sock.recvmsg(nbytes, size, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


class Segment:
    """One mapped segment: `request` and `reply` are page-aligned uint8 views of its regions."""

    def __init__(self, mapping: mmap.mmap, request_bytes: int, reply_bytes: int, nonce: bytes,
                 fd: int | None = None) -> None:
        self.nonce = nonce
        self.request_bytes = request_bytes
        self.reply_bytes = reply_bytes
        self.fd = fd  # the creator's memfd, to hand to the peer (closed by `close`)
        self._mapping: mmap.mmap | None = mapping
        whole = np.frombuffer(mapping, dtype=np.uint8)
        self.request: np.ndarray = whole[PAGE:PAGE + request_bytes]
        self.reply: np.ndarray = whole[PAGE + request_bytes:PAGE + request_bytes + reply_bytes]

    @classmethod
    def create(cls, request_bytes: int, reply_bytes: int) -> Segment:
        """A new sealed memfd segment of this process, its nonce written inside."""
        request_bytes, reply_bytes = align(request_bytes), align(reply_bytes)
        size = PAGE + request_bytes + reply_bytes
        nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Reserve every page now: where memory is short this fails here, and the pair takes
            # another transport, instead of failing mid-step.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
            mapping[:_HEADER.size] = _HEADER.pack(_MAGIC, nonce, request_bytes, reply_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError:
            os.close(fd)
            raise
        return cls(mapping, request_bytes, reply_bytes, nonce, fd)

    @classmethod
    def adopt(cls, fd: int) -> Segment:
        """Map a segment whose descriptor a peer passed (always closing `fd`): InvalidArgumentError
        unless it is a regular file sealed against any change of size, with a well-formed header."""
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:  # not a memfd (or a file system without seals)
                seals = 0
            if seals & _SEALS != _SEALS:
                raise InvalidArgumentError("segment: not a memfd sealed against shrinking and growing")
            # Sealed first, measured second: the size cannot change any more.
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < PAGE:
                raise InvalidArgumentError(f"segment: {info.st_size} bytes, smaller than its header")
            size = info.st_size
            try:
                mapping = mmap.mmap(fd, size)
            except OSError as err:  # e.g. sealed against writing
                raise InvalidArgumentError(f"segment: cannot be mapped for writing: {err}") from None
        finally:
            os.close(fd)
        magic, nonce, request_bytes, reply_bytes = _HEADER.unpack_from(mapping, 0)
        if magic != _MAGIC or PAGE + request_bytes + reply_bytes != size:
            mapping.close()
            raise InvalidArgumentError(f"segment: bad header (size {size})")
        return cls(mapping, request_bytes, reply_bytes, nonce)

    @classmethod
    def private(cls, request_bytes: int, reply_bytes: int) -> Segment:
        """The same regions in this process's own memory (the TCP transport's reusable buffers);
        pages are only allocated when first written."""
        request_bytes, reply_bytes = align(request_bytes), align(reply_bytes)
        mapping = mmap.mmap(-1, PAGE + request_bytes + reply_bytes)
        return cls(mapping, request_bytes, reply_bytes, b"")

    def release_fd(self) -> None:
        """Close the creator's descriptor (once handed off: the mappings keep the memory)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Unmap: the memory goes once no process maps it or holds its descriptor."""
        self.release_fd()
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
