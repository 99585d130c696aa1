"""worker.data: the IDX parser, the dataset loader and its fallback, and DistributedSampler-style shards."""

from __future__ import annotations

import gzip
import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pshard.common.errors import PSError
from pshard.worker import data
from pshard.worker.data import (
    DatasetError,
    batches,
    default_data_dir,
    load_dataset,
    num_batches,
    read_idx,
    shard,
)

FASHION_DIR = Path(data.DEFAULT_DATA_DIR)
needs_fashion = pytest.mark.skipif(
    not (FASHION_DIR / "t10k-labels-idx1-ubyte.gz").is_file(),
    reason=f"Fashion-MNIST not installed in {FASHION_DIR} (apt-get install dataset-fashion-mnist)",
)


def write_idx(path: Path, array: np.ndarray, code: int = 0x08) -> Path:
    """An IDX file as the format's spec describes it: 0x0000, dtype code, ndim, big-endian dims, data."""
    header = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def write_fashion_like(
    root: Path, n_train: int = 12, n_test: int = 5, gz: bool = True
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    root.mkdir(parents=True, exist_ok=True)
    for stem, array in arrays.items():
        write_idx(root / (stem + (".gz" if gz else "")), array)
    return arrays


# --- the IDX parser ---


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_synthetic_idx_round_trips(tmp_path: Path, suffix: str) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    parsed = read_idx(write_idx(tmp_path / f"x-idx3-ubyte{suffix}", array))
    assert parsed.dtype == np.uint8 and parsed.shape == (2, 3, 4)
    np.testing.assert_array_equal(parsed, array)


@pytest.mark.parametrize(("code", "dtype"), [(0x09, np.int8), (0x0B, np.int16), (0x0C, np.int32),
                                             (0x0D, np.float32), (0x0E, np.float64)])
def test_multibyte_idx_dtypes_are_big_endian_on_disk_and_native_in_memory(
    tmp_path: Path, code: int, dtype: type[np.number[Any]]
) -> None:
    array = np.array([[-3, 1], [2, 100]], dtype=dtype)
    parsed = read_idx(write_idx(tmp_path / "x.idx", array, code=code))
    assert parsed.dtype == np.dtype(dtype) and parsed.dtype.isnative
    np.testing.assert_array_equal(parsed, array)


def test_bad_magic_names_the_file_and_both_values(tmp_path: Path) -> None:
    path = tmp_path / "images-idx3-ubyte"
    path.write_bytes(b"\x12\x34\x08\x03" + b"\0" * 12)
    with pytest.raises(DatasetError) as err:
        read_idx(path)
    assert str(path) in str(err.value) and "0x12340803" in str(err.value) and "0x0000" in str(err.value)


def test_unknown_dtype_code_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "x.idx"
    path.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 0))
    with pytest.raises(DatasetError, match="dtype code"):
        read_idx(path)


def test_truncated_header_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x08\x03" + b"\x00\x00")  # three dims announced, half of one present
    with pytest.raises(DatasetError, match=r"expected 16 header bytes for 3 dims, found 6") as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_truncated_data_reports_declared_and_found_sizes(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "images-idx3-ubyte", np.zeros((4, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DatasetError) as err:
        read_idx(path)
    message = str(err.value)
    assert str(path) in message and "(4, 28, 28)" in message
    assert f"{16 + 4 * 28 * 28} bytes" in message and f"found {16 + 4 * 28 * 28 - 100} bytes" in message


def test_trailing_garbage_is_not_ignored(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x.idx", np.zeros(3, dtype=np.uint8))
    path.write_bytes(path.read_bytes() + b"\x01")
    with pytest.raises(DatasetError, match="found 12 bytes"):
        read_idx(path)


def test_cut_off_gzip_stream_names_the_file(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x-idx3-ubyte.gz", np.ones((50, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(DatasetError, match="cannot read") as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_dataset_error_is_a_ps_error() -> None:
    assert issubclass(DatasetError, PSError)


# --- loading ---


def test_default_data_dir_prefers_the_environment_value() -> None:
    assert default_data_dir({"PSHARD_DATA_DIR": "/data/fm"}) == "/data/fm"
    assert default_data_dir({"PSHARD_DATA_DIR": ""}) == data.DEFAULT_DATA_DIR
    assert default_data_dir({}) == "/usr/share/datasets/fashion-mnist"


@pytest.mark.parametrize("gz", [True, False])
def test_loads_idx_files_as_normalised_nchw(tmp_path: Path, gz: bool) -> None:
    arrays = write_fashion_like(tmp_path / "fm", gz=gz)
    ds = load_dataset(tmp_path / "fm")
    assert ds.name == "fashion-mnist" and ds.num_classes == 10 and ds.image_shape == (1, 28, 28)
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.test_x.shape == (5, 1, 28, 28)
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int64
    np.testing.assert_array_equal(ds.train_y, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.test_y, arrays["t10k-labels-idx1-ubyte"])
    # Normalised with the training split's statistics; the pixel order is kept.
    assert abs(float(ds.train_x.mean())) < 1e-5 and abs(float(ds.train_x.std()) - 1.0) < 1e-4
    raw = arrays["train-images-idx3-ubyte"].astype(np.float32) / 255.0
    np.testing.assert_allclose(ds.train_x[:, 0], (raw - raw.mean()) / raw.std(), rtol=1e-5, atol=1e-5)


def test_missing_directory_falls_back_to_digits_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "nowhere"
    with caplog.at_level(logging.WARNING, logger="worker.data"):
        ds = load_dataset(missing)
    assert [r.getMessage() for r in caplog.records] == [
        f"fashion-mnist not found in {missing}; "
        "falling back to scikit-learn's bundled digits (8x8, 1797 images)"
    ]
    assert ds.name == "digits" and ds.image_shape == (1, 8, 8) and ds.num_classes == 10
    assert len(ds.train_y) + len(ds.test_y) == 1797 and len(ds.test_y) == 359
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int64
    assert set(np.unique(ds.test_y)) == set(range(10))


def test_digits_split_is_the_same_on_every_call(tmp_path: Path) -> None:
    a, b = load_dataset(tmp_path / "a"), load_dataset(tmp_path / "b")
    np.testing.assert_array_equal(a.train_y, b.train_y)
    np.testing.assert_array_equal(a.test_x, b.test_x)


def test_an_empty_directory_falls_back_too(tmp_path: Path) -> None:
    assert load_dataset(tmp_path).name == "digits"


def test_a_partial_set_of_files_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    write_fashion_like(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match=r"missing.*t10k-labels-idx1-ubyte"):
        load_dataset(tmp_path)


def test_images_and_labels_of_different_lengths_are_rejected(tmp_path: Path) -> None:
    write_fashion_like(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(11, dtype=np.uint8))
    with pytest.raises(DatasetError, match=r"\(12, 28, 28\) and \(11,\)"):
        load_dataset(tmp_path)


def test_out_of_range_labels_are_rejected(tmp_path: Path) -> None:
    write_fashion_like(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([0, 1, 2, 3, 10], dtype=np.uint8))
    with pytest.raises(DatasetError, match=r"labels in \[0, 10\), found \[0, 10\]"):
        load_dataset(tmp_path)


@needs_fashion
def test_parses_the_real_fashion_mnist_files() -> None:
    labels = read_idx(FASHION_DIR / "t10k-labels-idx1-ubyte.gz")
    images = read_idx(FASHION_DIR / "t10k-images-idx3-ubyte.gz")
    assert labels.shape == (10_000,) and images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    # The test split is balanced: 1000 images of each of the 10 classes.
    assert np.bincount(labels).tolist() == [1000] * 10


@needs_fashion
def test_loads_the_real_fashion_mnist() -> None:
    ds = load_dataset(FASHION_DIR)
    assert ds.name == "fashion-mnist"
    assert ds.train_x.shape == (60_000, 1, 28, 28) and ds.test_x.shape == (10_000, 1, 28, 28)
    assert np.bincount(ds.train_y).tolist() == [6000] * 10


# --- shards ---


@pytest.mark.parametrize(("n", "world_size"), [(10, 3), (1797, 2), (7, 7), (3, 5), (0, 2), (60_000, 4)])
def test_shards_are_disjoint_cover_everything_and_differ_by_at_most_one(n: int, world_size: int) -> None:
    parts = [shard(n, rank, world_size, epoch=2, seed=11) for rank in range(world_size)]
    joined = np.concatenate(parts)
    assert len(joined) == n and len(np.unique(joined)) == n  # disjoint, no padding
    assert set(joined.tolist()) == set(range(n))  # covering
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_uneven_shards_are_not_padded() -> None:
    assert [len(shard(10, rank, 3, epoch=0, seed=0)) for rank in range(3)] == [4, 3, 3]


def test_every_worker_computes_the_same_permutation() -> None:
    # Each worker shards independently; only agreeing on the permutation makes the shards disjoint.
    np.testing.assert_array_equal(shard(100, 1, 4, epoch=5, seed=9), shard(100, 1, 4, epoch=5, seed=9))


def test_each_epoch_reshuffles() -> None:
    assert not np.array_equal(shard(1000, 0, 2, epoch=0, seed=1), shard(1000, 0, 2, epoch=1, seed=1))
    # Seed and epoch are not simply added: seed 1/epoch 0 is not seed 0/epoch 1.
    assert not np.array_equal(shard(1000, 0, 1, epoch=0, seed=1), shard(1000, 0, 1, epoch=1, seed=0))


def test_single_worker_gets_a_permutation_of_everything() -> None:
    assert sorted(shard(50, 0, 1, epoch=0, seed=0).tolist()) == list(range(50))


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_or_world_size_names_the_value(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"got -?\d"):
        shard(10, rank, world_size, epoch=0, seed=0)


def test_batches_keep_the_short_last_batch_unless_asked() -> None:
    idx = np.arange(10)
    assert [b.tolist() for b in batches(idx, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [len(b) for b in batches(idx, 4, drop_last=True)] == [4, 4]
    assert num_batches(10, 4) == 3 and num_batches(10, 4, drop_last=True) == 2 and num_batches(0, 4) == 0
    with pytest.raises(ValueError, match="batch_size"):
        next(batches(idx, 0))
