"""Training data: Fashion-MNIST from IDX files, sharded per worker like torch's DistributedSampler.

The dataset ships as a Debian package (`dataset-fashion-mnist`, baked into the worker
image), so nothing is downloaded at run time. Where it is missing, scikit-learn's bundled
8x8 digits stand in, with one warning, so a fresh checkout can still train end to end.

This module reads no environment variables: the CLI calls `default_data_dir(os.environ)`
and passes the result in. Arrays are numpy; the torch side wraps them with
`torch.from_numpy` (no copy).
"""

from __future__ import annotations

import gzip
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pshard.common.errors import PSError

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DATA_DIR_ENV = "PSHARD_DATA_DIR"

# The four files of the original distribution; each may be gzipped (as Debian ships them) or plain.
_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

# IDX dtype codes (third byte of the magic number). Multi-byte values are big-endian.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_DIGITS_TEST_FRACTION = 0.2
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_DIGITS_SPLIT_SEED = 0


class DatasetError(PSError):
    """A dataset file is unreadable, truncated or not what its name says; the message names the file."""

    status = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class Dataset:
    """Images as float32 NCHW, normalised with the training set's mean and std; labels as int64."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    image_shape: tuple[int, int, int]
    # How raw pixels became the arrays above: x / pixel_max, then (x - mean) / std. A saved model
    # records these, so it can be used on new images without this module.
    pixel_max: float = 1.0
    mean: float = 0.0
    std: float = 1.0
    class_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if x.shape[1:] != self.image_shape or len(x) != len(y):
                raise DatasetError(
                    f"{self.name} {split}: images {x.shape} and labels {y.shape} "
                    f"do not match image_shape {self.image_shape}"
                )


def default_data_dir(environ: Mapping[str, str]) -> str:
    """`$PSHARD_DATA_DIR` if set and non-empty, else where Debian's package puts Fashion-MNIST."""
    return environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR


def read_idx(path: str | Path) -> np.ndarray:
    """Parse one IDX file (gzipped if its name ends in .gz) into an array of its declared dtype and dims.

    Strict: the magic number, the dtype code and the byte count must all agree with the header,
    so a truncated download fails here, naming the file, rather than as a reshape error later.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as exc:  # BadGzipFile is an OSError; a cut-off gzip stream is an EOFError
        raise DatasetError(f"{path}: cannot read: {exc}") from exc
    if len(raw) < 4:
        raise DatasetError(f"{path}: expected a 4-byte IDX magic number, found {len(raw)} bytes")
    zero, code, ndim = int.from_bytes(raw[0:2], "big"), raw[2], raw[3]
    if zero != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise DatasetError(
            f"{path}: expected IDX magic 0x0000 + dtype code in "
            f"{{{', '.join(f'0x{c:02X}' for c in _IDX_DTYPES)}}} + ndim >= 1, found 0x{raw[:4].hex().upper()}"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: expected {header} header bytes for {ndim} dims, found {len(raw)}")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise DatasetError(
            f"{path}: header declares dims {dims} of {dtype.name} ({expected} bytes in all), "
            f"found {len(raw)} bytes"
        )
    # Native byte order so that torch.from_numpy accepts the array downstream.
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def load_dataset(data_dir: str | Path | None = None) -> Dataset:
    """Fashion-MNIST from `data_dir` (default: Debian's location); the bundled digits if it is absent.

    A directory holding only some of the four files is an error, not a fallback: training on
    8x8 digits because one file went missing would be a quiet surprise.
    """
    root = Path(data_dir) if data_dir is not None else Path(DEFAULT_DATA_DIR)
    found = {field: _find(root, stem) for field, stem in _FILES.items()}
    if all(p is None for p in found.values()):
        log.warning(
            "fashion-mnist not found in %s; falling back to scikit-learn's bundled digits (8x8, 1797 images)",
            root,
        )
        return _load_digits()
    missing = [_FILES[f] for f, p in found.items() if p is None]
    if missing:
        raise DatasetError(f"{root}: incomplete fashion-mnist, missing {missing} (plain or .gz)")
    arrays = {field: read_idx(p) for field, p in found.items() if p is not None}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DatasetError(
                f"{found[f'{split}_x']} and {found[f'{split}_y']}: expected (N, H, W) images and "
                f"(N,) labels, found {images.shape} and {labels.shape}"
            )
        if labels.size and (labels.min() < 0 or labels.max() >= 10):
            raise DatasetError(
                f"{found[f'{split}_y']}: expected labels in [0, 10), found [{labels.min()}, {labels.max()}]"
            )
    train_x = arrays["train_x"].astype(np.float32) / 255.0
    test_x = arrays["test_x"].astype(np.float32) / 255.0
    return _normalised("fashion-mnist", train_x, arrays["train_y"], test_x, arrays["test_y"], num_classes=10,
                       pixel_max=255.0, class_names=FASHION_MNIST_CLASSES)


def shard(n: int, rank: int, world_size: int, epoch: int, seed: int) -> np.ndarray:
    """This worker's sample indices for one epoch: DistributedSampler(shuffle=True) without padding.

    Every worker draws the same permutation (seeded by seed and epoch) and takes every
    world_size-th index from its rank on, so the shards are disjoint and cover all n samples;
    their sizes differ by at most one. There is deliberately no padding with repeated
    samples: uneven shards are a case the cluster must handle, not hide.
    """
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}, expected >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank}, expected 0 <= rank < world_size={world_size}")
    if n < 0 or epoch < 0 or seed < 0:
        raise ValueError(f"n, epoch, seed: got {n}, {epoch}, {seed}; expected each >= 0")
    # (seed, epoch) as a sequence, not seed + epoch: otherwise seed 1/epoch 0 repeats seed 0/epoch 1.
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[rank::world_size]


def batches(indices: np.ndarray, batch_size: int, *, drop_last: bool = False) -> Iterator[np.ndarray]:
    """Consecutive slices of `indices`; the last one may be short unless drop_last."""
    if batch_size < 1:
        raise ValueError(f"batch_size: got {batch_size}, expected >= 1")
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    for start in range(0, stop, batch_size):
        yield indices[start : start + batch_size]


def num_batches(n: int, batch_size: int, *, drop_last: bool = False) -> int:
    """How many batches `batches` yields for n indices (for progress bars and step budgets)."""
    return n // batch_size if drop_last else -(-n // batch_size)


def _find(root: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def _load_digits() -> Dataset:
    # Imported here: scikit-learn is slow to import and only this fallback needs it.
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    # A fixed permutation so every worker (and every run) agrees on which images are test images.
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(labels))
    n_test = round(len(labels) * _DIGITS_TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return _normalised("digits", images[train], labels[train], images[test], labels[test], num_classes=10,
                       pixel_max=16.0, class_names=tuple(str(d) for d in range(10)))


def _normalised(
    name: str,
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    pixel_max: float = 1.0,
    class_names: tuple[str, ...] = (),
) -> Dataset:
    if train_x.ndim == 3:  # (N, H, W) -> (N, 1, H, W): one channel
        train_x, test_x = train_x[:, None], test_x[:, None]
    # Statistics of the training split only, so the test set does not leak into preprocessing.
    mean, std = float(train_x.mean()), float(train_x.std()) or 1.0
    return Dataset(
        name=name,
        train_x=np.ascontiguousarray((train_x - mean) / std, dtype=np.float32),
        train_y=np.ascontiguousarray(train_y, dtype=np.int64),
        test_x=np.ascontiguousarray((test_x - mean) / std, dtype=np.float32),
        test_y=np.ascontiguousarray(test_y, dtype=np.int64),
        num_classes=num_classes,
        image_shape=(int(train_x.shape[1]), int(train_x.shape[2]), int(train_x.shape[3])),
        pixel_max=pixel_max,
        mean=mean,
        std=std,
        class_names=class_names,
    )
