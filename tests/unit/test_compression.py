"""Gradient compression (issue 19): each compressor against a numpy reference, error feedback's exact
bookkeeping, random-k's shared seed, the configuration's refusals, and a server's checks of a payload."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from pshard.client.compressing import PushEncoder
from pshard.common.cluster.layout import LayoutSlice
from pshard.common.compression import Compression, Compressor, payload_k
from pshard.common.errors import InvalidArgumentError, PayloadSizeError, ShapeMismatchError
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey
from pshard.common.wire import codec, compress
from pshard.common.wire.codec import WireArray

KEY = SliceKey("fc1.weight", 2)


def grads(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def roundtrip(name: str, values: np.ndarray, clock: int = 5) -> tuple[WireArray, np.ndarray]:
    wire = compress.encode(Compressor.parse(name), values, KEY, clock)
    return wire, compress.decode(wire, values.size, KEY, clock)


# ---- each compressor against numpy ----

def test_topk_sends_the_largest_magnitudes_as_indices_and_values() -> None:
    x = grads(1000)
    wire, got = roundtrip("topk:0.01", x)
    want = np.zeros_like(x)
    top = np.argsort(-np.abs(x), kind="stable")[:10]
    want[top] = x[top]
    assert (wire.dtype, wire.encoding, wire.array.nbytes) == ("uint8", "topk", 10 * 8)
    assert got.tobytes() == want.tobytes()


def test_topk_keeps_at_least_one_element_and_all_of_them_at_k_one() -> None:
    x = grads(7)
    assert np.count_nonzero(roundtrip("topk:0.001", x)[1]) == 1
    assert roundtrip("topk:1", x)[1].tobytes() == x.tobytes()


def test_randomk_sends_k_values_at_the_seeded_indices_only() -> None:
    x = grads(5000)
    wire, got = roundtrip("randomk:0.02", x, clock=9)
    chosen = np.sort(np.random.default_rng([compress.zlib.crc32(KEY.key.encode()), KEY.part, 9])
                     .choice(5000, size=100, replace=False))
    want = np.zeros_like(x)
    want[chosen] = x[chosen]
    assert wire.array.nbytes == 100 * 4  # values only: no index travels
    assert got.tobytes() == want.tobytes()


def test_randomk_draws_new_indices_each_clock_and_for_each_slice() -> None:
    a = compress.random_indices(KEY, 1, 10_000, 50)
    assert not np.array_equal(a, compress.random_indices(KEY, 2, 10_000, 50))
    assert not np.array_equal(a, compress.random_indices(KEY._replace(part=3), 1, 10_000, 50))
    assert np.array_equal(a, compress.random_indices(KEY, 1, 10_000, 50))
    assert len(set(a.tolist())) == 50


def test_randomk_indices_are_the_same_in_another_process() -> None:
    """Worker and server are different processes: the seed must not hang on Python's salted hash()."""
    code = ("from pshard.common.wire import compress; from pshard.common.types import SliceKey; "
            "print(compress.random_indices(SliceKey('fc1.weight', 2), 7, 100000, 20).tolist())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           timeout=60)
    assert other.stdout.strip() == str(compress.random_indices(KEY, 7, 100_000, 20).tolist())


def test_sign_sends_one_bit_per_element_and_the_mean_magnitude() -> None:
    x = grads(1001)
    x[3] = 0.0
    wire, got = roundtrip("sign", x)
    scale = np.float32(np.abs(x).mean(dtype=np.float64))
    assert wire.array.nbytes == 4 + 126
    assert got.tobytes() == np.where(x >= 0, scale, -scale).astype(np.float32).tobytes()


@pytest.mark.parametrize(("name", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_the_casts_are_the_wire_dtypes(name: str, dtype: str) -> None:
    x = grads(300)
    wire, got = roundtrip(name, x)
    assert (wire.dtype, wire.encoding) == (dtype, "")
    want = x.astype(np.float16).astype(np.float32) if name == "fp16" else \
        codec.bf16_to_f32(codec.f32_to_bf16(x))
    assert got.tobytes() == want.tobytes()


def test_packed_slices_cross_the_codec_with_their_encoding() -> None:
    wire = compress.encode(Compressor.parse("topk:0.1"), grads(100), KEY, 0)
    key, back = codec.slice_tensor_from_proto(codec.slice_tensor_to_proto(KEY, wire))
    got = (key, back.dtype, back.encoding, back.array.tobytes())
    assert got == (KEY, "uint8", "topk", wire.array.tobytes())


# ---- error feedback ----

CUTS = [LayoutSlice("w", 0, 0, 0, 600), LayoutSlice("w", 1, 1, 600, 400)]


def unpacked(packed: dict[SliceKey, WireArray], clock: int) -> np.ndarray:
    """What the server sees of `w`, unpacked as it unpacks it."""
    return np.concatenate([compress.decode(packed[s.slice_key], s.numel, s.slice_key, clock) for s in CUTS])


@pytest.mark.parametrize("name", ["topk:0.05", "randomk:0.05", "bf16", "fp16"])
def test_error_feedback_loses_nothing_bit_for_bit(name: str) -> None:
    """Each step, what was sent plus the new residual is the gradient plus the old residual, exactly:
    so what the server received plus what is held equals every gradient ever given."""
    encoder = PushEncoder({"w": Compressor.parse(name)}, {"w": 1000})
    residual = np.zeros(1000, np.float32)
    for clock in range(6):
        g = grads(1000, seed=clock)
        acc = residual + g
        packed = encoder.encode({"w": g}, CUTS, clock)
        sent = unpacked(packed, clock)
        residual = encoder.state()["w"]
        assert (sent + residual).tobytes() == acc.tobytes(), f"clock {clock}"
        assert np.any(residual != 0)


def test_error_feedback_with_sign_is_within_one_rounding() -> None:
    encoder = PushEncoder({"w": Compressor.parse("sign")}, {"w": 1000})
    residual = np.zeros(1000, np.float32)
    for clock in range(4):
        g = grads(1000, seed=clock)
        acc = residual + g
        packed = encoder.encode({"w": g}, CUTS, clock)
        sent = unpacked(packed, clock)
        residual = encoder.state()["w"]
        spacing = np.spacing(np.maximum(np.abs(acc), np.abs(sent)))
        assert np.all(np.abs(sent + residual - acc) <= spacing)


def test_without_error_feedback_nothing_is_kept() -> None:
    encoder = PushEncoder({"w": Compressor.parse("topk:0.01")}, {"w": 1000}, error_feedback=False)
    encoder.encode({"w": grads(1000)}, CUTS, 0)
    assert encoder.state() == {}


def test_the_encoder_counts_bytes_and_residual_norms() -> None:
    encoder = PushEncoder({"w": Compressor.parse("topk:0.01")}, {"w": 1000})
    encoder.encode({"w": grads(1000)}, CUTS, 0)
    stats = encoder.stats
    assert stats.slice_bytes == {SliceKey("w", 0): (2400, 6 * 8), SliceKey("w", 1): (1600, 4 * 8)}
    assert stats.ratio == 4000 / 80
    assert stats.residual_norms["w"] == pytest.approx(float(np.linalg.norm(encoder.state()["w"])))
    assert stats.steps == 1 and stats.compress_s > 0


def test_residuals_load_back_and_a_wrong_size_is_refused_whole() -> None:
    encoder = PushEncoder({"w": Compressor.parse("topk:0.01")}, {"w": 1000})
    encoder.encode({"w": grads(1000)}, CUTS, 0)
    saved = encoder.state()
    fresh = PushEncoder({"w": Compressor.parse("topk:0.01")}, {"w": 1000})
    fresh.load_state(saved)
    assert fresh.state()["w"].tobytes() == saved["w"].tobytes()
    with pytest.raises(ShapeMismatchError, match=r"residual 'w': got 999 elements, the parameter has 1000"):
        fresh.load_state({"w": np.zeros(999, np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"residual 'b': this job does not compress it"):
        fresh.load_state({"b": np.zeros(3, np.float32)})
    assert fresh.state()["w"].tobytes() == saved["w"].tobytes()


# ---- configuration ----

@pytest.mark.parametrize(("text", "message"), [
    ("gzip", r"compression: got 'gzip', expected one of none, topk:K"),
    ("topk:0", r"compression: got 'topk:0', k=0.0 is outside \(0, 1\]"),
    ("randomk:1.5", r"compression: got 'randomk:1.5', k=1.5 is outside \(0, 1\]"),
    ("topk", r"compression: got 'topk', expected topk:K"),
    ("topk:lots", r"compression: got 'topk:lots', k 'lots' is not a number"),
    ("sign:0.1", r"compression: got 'sign:0.1' with k=0.1, but sign takes no fraction"),
])
def test_a_bad_compressor_is_refused_naming_the_field_and_value(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        JobConfig(compression=Compression(text))


def test_rules_pick_per_parameter_first_match_wins_and_small_tensors_stay_whole() -> None:
    plan = Compression("topk:0.01", (("*.bias", "none"), ("fc*", "sign")), min_numel=64).plan(
        {"fc1.weight": 10_000, "fc1.bias": 100, "conv.weight": 5_000, "norm.weight": 32})
    assert {k: str(c) for k, c in plan.items()} == {
        "fc1.weight": "sign", "fc1.bias": "none", "conv.weight": "topk:0.01", "norm.weight": "none"}


def test_a_rule_that_matches_nothing_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match=r"compression.rules\[1\]: pattern '\*.bais' matches "
                                                   r"no parameter \(the model has 2: \['fc.weight', "):
        Compression("topk:0.01", (("fc.*", "sign"), ("*.bais", "none"))).plan({"fc.weight": 9, "fc.bias": 3})


def test_a_bad_rule_is_refused_naming_its_pattern() -> None:
    with pytest.raises(InvalidArgumentError, match=r"compression.rules\[0\] \('\*.bias'\): got 'topk:2'"):
        Compression("none", (("*.bias", "topk:2"),))
    with pytest.raises(InvalidArgumentError, match=r"--compression-rule\[0\]: got 'bias', expected PATTERN="):
        Compression.from_flags("sign", ["bias"])


def test_a_cast_is_the_wire_dtype_and_must_agree_with_it() -> None:
    assert JobConfig(compression=Compression("bf16")).wire_dtype == "bfloat16"
    with pytest.raises(InvalidArgumentError, match=r"compression: got 'fp16', but wire_dtype is 'bfloat16'"):
        JobConfig(wire_dtype="bfloat16", compression=Compression("fp16"))
    with pytest.raises(InvalidArgumentError, match=r"rules\[0\] \('emb\*'\): got 'bf16', which sends "
                                                   r"bfloat16, but the job's wire_dtype is ''"):
        JobConfig(compression=Compression("topk:0.01", (("emb*", "bf16"),)))


def test_compression_survives_a_checkpoints_json() -> None:
    from pshard.common.checkpoint_store import job_from_json, job_to_json
    job = JobConfig(compression=Compression("topk:0.01", (("*.bias", "none"),), 128, False))
    assert job_from_json(job_to_json(job)) == job


# ---- a server's checks of what arrives ----

@pytest.mark.parametrize(("encoding", "numel", "nbytes", "message"), [
    ("topk", 100, 12, r"got 12 bytes of topk, expected 8 bytes per sent element for 1 to 100"),
    ("topk", 10, 88, r"got 88 bytes of topk"),
    ("randomk", 10, 0, r"got 0 bytes of randomk"),
    ("sign", 100, 16, r"got 16 bytes of sign, 100 elements need 17"),
])
def test_a_payload_of_the_wrong_size_is_refused_before_any_data(encoding: str, numel: int, nbytes: int,
                                                                message: str) -> None:
    with pytest.raises(PayloadSizeError, match=message):
        payload_k(encoding, numel, nbytes, "slice 'w'")


def test_topk_indices_out_of_range_or_repeated_are_refused() -> None:
    for indices in ([3, 100], [5, 5]):
        raw = np.concatenate([np.array(indices, "<u4").view(np.uint8), np.ones(2, "<f4").view(np.uint8)])
        with pytest.raises(InvalidArgumentError, match=r"topk indices must be increasing and below 100"):
            compress.decode(WireArray(raw, "uint8", "topk"), 100, KEY, 0)


# ---- the worker's command line ----

TF_CONFIG = ('{"cluster": {"ps": ["127.0.0.1:7100"], "worker": ["127.0.0.1:7200"]}, '
             '"task": {"type": "worker", "index": 0}}')


def test_pshard_worker_takes_compression_flags(tmp_path) -> None:
    from pshard.worker.__main__ import config_from_args

    base, env = ["--data-dir", str(tmp_path), "--insecure"], {"TF_CONFIG": TF_CONFIG}
    cfg = config_from_args([*base, "--compression", "topk:0.01", "--compression-rule", "*.bias=none",
                            "--compression-min-numel", "256", "--no-error-feedback"], env)
    assert cfg.job.compression == Compression("topk:0.01", (("*.bias", "none"),), 256, False)
    assert config_from_args([*base, "--compression", "bf16"], env).job.wire_dtype == "bfloat16"


def test_pshard_worker_refuses_a_bad_compressor_naming_it(tmp_path) -> None:
    from pshard.common.errors import ClusterConfigError
    from pshard.worker.__main__ import config_from_args

    with pytest.raises(ClusterConfigError, match=r"compression: got 'topk:2', k=2.0 is outside \(0, 1\]"):
        config_from_args(["--data-dir", str(tmp_path), "--insecure", "--compression", "topk:2"],
                         {"TF_CONFIG": TF_CONFIG})
