"""Sparse embedding tables, the part client and server share: a table's config, the id hash and placement.

A table maps arbitrary int64 ids to rows of `dim` numbers. Which server holds an id is decided by a
hash of the id (jump consistent hash over a splitmix64 mix), never by `id % n`: ids that are
multiples of n, or that come in ranges, still spread evenly, and growing from n to n+1 servers
moves only 1/(n+1) of the ids. Client and server import the same function, so they always agree.

Pure: numpy only, no grpc.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
from pshard.common.compression import CASTS
from pshard.common.errors import InvalidArgumentError

TABLE_OPTIMIZERS = ("sgd", "adagrad", "adam", "lazy_adam")
INITIALIZERS = ("zeros", "uniform", "normal")
TABLE_DTYPES = ("float32", "float64")
# How a table stores and sends its rows' values (issue 22): float32 (the table's dtype, no narrowing), or
# narrower, rounded once per push (ps_server/tables/rowcodec.py). int8 rows carry a float16 scale and offset.
ROW_DTYPES = ("float32", "float16", "bfloat16", "int8")
# How pushed gradient rows travel (issue 19): as the table's dtype, or cast to 2 bytes a value (the dense
# compressors' casts, by the same names); servers widen them to float32 before applying. Top-k, random-k
# and sign have no table form: a push of rows is sparse already, and the rows it names are those that moved.
TABLE_COMPRESSIONS = ("none", *CASTS)
TTL_UNITS = ("clocks", "seconds")
CAP_POLICIES = ("lru", "lfu")
TABLE_MODES = ("async", "sync")
MAX_TABLE_DIM = 1 << 16
MAX_TABLE_NAME_CHARS = 256

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of `x + golden`, elementwise on uint64 (wrapping arithmetic)."""
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def table_hash(name: str) -> int:
    """A stable 64-bit number for a table name (crc32 is the same in every process, unlike hash())."""
    return int(mix64(np.array([zlib.crc32(name.encode())], np.uint64))[0])


def server_of(ids: np.ndarray, n_servers: int) -> np.ndarray:
    """The server (0..n-1) that holds each id: jump consistent hash (Lamport & Veach) of mix64(id)."""
    key = mix64(ids.view(np.uint64) if ids.dtype == np.int64 else ids.astype(np.int64).view(np.uint64))
    bucket = np.zeros(len(key), np.int64)
    # Each round jumps the ids still below n_servers, compacted: on a worker's split of 4,096 ids
    # for 2 servers this is 25% faster than whole-length rounds (3 of them) with their where().
    # The float arithmetic is the reference's, (b + 1) * (2**31 / top), so every id lands alike.
    where: np.ndarray | None = None  # positions of the ids still jumping (None: every id)
    jumped = bucket
    while True:
        key *= np.uint64(2862933555777941757)  # wraps: numpy does not check integer arrays' overflow
        key += np.uint64(1)
        top = (key >> np.uint64(33)).astype(np.float64)
        top += 1.0
        np.divide(float(1 << 31), top, out=top)
        if where is not None:  # the first round's buckets are all 0: (0 + 1) * x is x
            top *= jumped + 1
        nxt = top.astype(np.int64)
        keep = np.flatnonzero(nxt < n_servers)
        where = keep if where is None else where[keep]
        if not len(keep):
            return bucket
        jumped = nxt[keep]
        bucket[where] = jumped
        key = key[keep]


def row_items(a: np.ndarray) -> np.ndarray:
    """A C-contiguous (n, dim) array as n opaque items of one row's bytes each, a view: numpy takes
    and assigns such items with one memcpy each, about twice as fast as rows of numbers (a scatter of
    2,048 rows of 64 float32: 85 against 167 us)."""
    if not a.flags.c_contiguous or a.ndim != 2:
        raise ValueError(f"row_items: a C-contiguous 2-D array expected, got shape {a.shape}")
    size = a.shape[1] * a.itemsize
    item = _ITEMS.get(size)
    if item is None:  # np.dtype((np.void, n)) costs several microseconds: made once per size
        item = _ITEMS[size] = np.dtype((np.void, size))
    return a.view(item).reshape(a.shape[0])


_ITEMS: dict[int, np.dtype] = {}


def take_rows(a: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """a[rows] (rows within bounds), into `out` when given: row_items' gather."""
    if out is None:
        out = np.empty((len(rows), a.shape[1]), a.dtype)
    np.take(row_items(a), rows, out=row_items(out), mode="clip")  # "raise" would buffer `out`
    return out


def put_rows(a: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """a[rows] = values (rows within bounds and distinct; values C-contiguous): row_items' scatter."""
    row_items(a)[rows] = row_items(values)


@dataclass(frozen=True)
class TableConfig:
    """Everything a table is declared with; the first declaration wins and later ones must be equal."""

    name: str
    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"  # zeros, uniform in [-init_scale, init_scale), normal(0, init_scale)
    init_scale: float = 0.01
    seed: int = 0
    optimizer: str = "sgd"  # sgd, adagrad, adam (torch SparseAdam: one step count), lazy_adam (per row)
    lr: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    admit_after: int = 1  # pushes that must see an id before it becomes a row
    # Size of the admission counts per server (a count-min sketch, ps_server/tables/admission.py): fixed
    # whatever the id stream; more memory, fewer early admissions and a longer memory of sightings.
    admit_memory_mb: float = 4.0
    admit_prob: float = 1.0  # chance that a sighting of a not-yet-admitted id admits it
    ttl: float = 0.0  # 0: rows never expire
    ttl_unit: str = "clocks"
    max_rows: int = 0  # per server; 0: no cap
    cap_policy: str = "lru"
    log_evictions: bool = False  # append evicted ids to a file next to the server's checkpoint
    allow_nonfinite: bool = False
    mode: str = "async"
    # Stored and pulled form of the values (ROW_DTYPES); optimizer state stays in `dtype`.
    row_dtype: str = "float32"
    # How pushed gradient rows travel (TABLE_COMPRESSIONS); the servers apply them in float32.
    compression: str = "none"
    # RAM for rows per server, in MiB (values, optimizer state and stamps; ps_server/tables/disktier.py):
    # rows beyond it spill to the server's --table-dir and come back on touch. 0: every row in RAM.
    memory_mb: float = 0.0

    def __post_init__(self) -> None:
        def bad(field: str, got: object, expected: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"table {self.name!r}: {field}: got {got!r}, expected {expected}")

        if not self.name or len(self.name) > MAX_TABLE_NAME_CHARS:
            raise bad("name", self.name, f"1 to {MAX_TABLE_NAME_CHARS} characters")
        if not 1 <= self.dim <= MAX_TABLE_DIM:
            raise bad("dim", self.dim, f"1 to {MAX_TABLE_DIM}")
        allowed: tuple[str, ...]
        for field, value, allowed in (("dtype", self.dtype, TABLE_DTYPES),
                                      ("initializer", self.initializer, INITIALIZERS),
                                      ("optimizer", self.optimizer, TABLE_OPTIMIZERS),
                                      ("ttl_unit", self.ttl_unit, TTL_UNITS),
                                      ("cap_policy", self.cap_policy, CAP_POLICIES),
                                      ("mode", self.mode, TABLE_MODES),
                                      ("row_dtype", self.row_dtype, ROW_DTYPES),
                                      ("compression", self.compression, TABLE_COMPRESSIONS)):
            if value not in allowed:
                raise bad(field, value, f"one of {allowed}")
        ranges: tuple[tuple[str, float, float, float], ...] = (
            ("lr", self.lr, 0.0, 1e3), ("eps", self.eps, 1e-30, 1.0),
            ("init_scale", self.init_scale, 0.0, 1e3),
            ("initial_accumulator_value", self.initial_accumulator_value, 0.0, 1e6),
            ("beta1", self.betas[0], 0.0, 0.999999), ("beta2", self.betas[1], 0.0, 0.999999),
            ("admit_prob", self.admit_prob, 1e-9, 1.0), ("ttl", self.ttl, 0.0, 1e12),
            # A declaration allocates it at once: bounded, so that a hostile one cannot take the host.
            ("admit_memory_mb", self.admit_memory_mb, 0.001, 1024.0),
            ("memory_mb", self.memory_mb, 0.0, float(1 << 30)))
        for field, number, low, high in ranges:
            if not (math.isfinite(number) and low <= number <= high):
                raise bad(field, number, f"a number in [{low}, {high}]")
        if not 1 <= self.admit_after <= 1 << 30:
            raise bad("admit_after", self.admit_after, "1 to 2**30")
        if not 0 <= self.max_rows <= 1 << 31:
            raise bad("max_rows", self.max_rows, "0 (no cap) to 2**31")
        if not 0 <= self.seed < 1 << 63:
            raise bad("seed", self.seed, "0 to 2**63-1")
        if self.narrow and self.dtype != "float32":
            raise bad("row_dtype", self.row_dtype, f"float32 with dtype {self.dtype!r} (narrower rows are "
                      "rounded from float32)")
        if self.compression != "none" and self.dtype != "float32":
            raise bad("compression", self.compression, f"'none' with dtype {self.dtype!r} (gradients are "
                      "cast from float32)")
        if self.row_dtype == "int8" and self.allow_nonfinite:
            raise bad("row_dtype", self.row_dtype, "not int8 with allow_nonfinite (an int8 row cannot hold "
                      "a NaN or an infinity)")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def grad_dtype(self) -> np.dtype:
        """The dtype pushed gradient rows travel in: the table's, float16, or bfloat16's bits (uint16)."""
        if self.compression == "bf16":
            return np.dtype("<u2")
        return np.dtype("<f2") if self.compression == "fp16" else self.np_dtype

    @property
    def narrow(self) -> bool:
        """Whether rows are stored and sent narrower than float32 (row_dtype)."""
        return self.row_dtype != "float32"

    @property
    def row_layout(self) -> tuple[np.dtype, int]:
        """(dtype, width) of a row as stored and sent: (dtype, dim) when not narrow, else opaque bytes,
        (uint8, row_bytes): float16 and bfloat16 2 bytes a value (little-endian), int8 a byte a
        value then its float16 scale and offset (ps_server/tables/rowcodec.py writes them,
        common/wire/sparse_codec.py reads them)."""
        if not self.narrow:
            return self.np_dtype, self.dim
        return np.dtype(np.uint8), self.dim + 4 if self.row_dtype == "int8" else 2 * self.dim

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's values as stored and sent."""
        dtype, width = self.row_layout
        return dtype.itemsize * width
