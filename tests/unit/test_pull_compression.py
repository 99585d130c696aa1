"""Compressed pulls (issue 19): the server's copy of each worker's copy, its residual, and the config.

The server sends a worker the packed change between a slice and that worker's copy; both add it to their
copy in float32, so the copies are equal bit for bit, and what was not sent stays in `value - copy` for
the next pull (error feedback on the server: nothing is dropped for good)."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.client.compressing import PullDecoder
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.compression import Compression, Compressor, PullPack
from pshard.common.errors import InvalidArgumentError, PayloadSizeError, PullBaseLostError
from pshard.common.wire import codec
from pshard.ps_server.core.pull_copies import PullCopies

from pshard.api.v1 import parameter_server_pb2 as pb

NUMEL = 20_000


def _slice():
    layout = plan_layout([ParamSpec("w", "float32", (NUMEL,))], ["s0"], 1 << 30)
    [s] = layout.slices
    return s


def _pull(copies: PullCopies, decoder: PullDecoder, s, value: np.ndarray, clock: int) -> np.ndarray:
    """One compressed pull of `s` end to end, as the transports run it: the worker's pack, the server's
    check and reply, the worker's landing of it."""
    pack = decoder.pack(s)
    copies.check("w0", [s.slice_key], [pack], [s.numel])
    wire = copies.serve("w0", s.slice_key, value, pack, clock)
    return decoder.apply(s, pack, wire.array.reshape(-1).view(np.uint8), clock)


@pytest.mark.parametrize("name", ["topk:0.01", "sign"])
def test_the_workers_copy_is_the_servers_copy_bit_for_bit_and_the_value_stays_exact(name: str) -> None:
    rng = np.random.default_rng(3)
    s, copies = _slice(), PullCopies()
    decoder = PullDecoder(Compressor.parse(name), ["w"], {"w": NUMEL})
    value = rng.standard_normal(NUMEL, dtype=np.float32)
    got = _pull(copies, decoder, s, value, 0)
    assert got.tobytes() == value.tobytes()  # the first pull comes whole
    for clock in range(1, 30):
        value = value - np.float32(0.01) * rng.standard_normal(NUMEL, dtype=np.float32)  # a step
        before = value.copy()
        got = _pull(copies, decoder, s, value, clock)
        held = copies.copy_of("w0", s.slice_key)
        assert held is not None and got.tobytes() == held.tobytes()  # the same additions, in the same order
        assert value.tobytes() == before.tobytes()  # the server's own state is never touched
        # The server's residual, what its next pull starts from, is exactly what the worker lacks.
        residual = copies.residual("w0", s.slice_key, value)
        assert residual is not None and residual.tobytes() == (value - got).tobytes()
    # 29 packed pulls and the first, whole: 32x and 50x fewer bytes for each packed one.
    assert decoder.bytes_before / decoder.bytes_after > (10 if name == "sign" else 15)


def test_topk_pulls_leave_nothing_behind_for_good() -> None:
    """The value stops changing: the copies reach it exactly (top-k sends the largest differences first)."""
    rng = np.random.default_rng(5)
    s, copies = _slice(), PullCopies()
    decoder = PullDecoder(Compressor.parse("topk:0.05"), ["w"], {"w": NUMEL})
    value = rng.standard_normal(NUMEL, dtype=np.float32)
    _pull(copies, decoder, s, value, 0)
    value = value + rng.standard_normal(NUMEL, dtype=np.float32)
    norms = []
    for clock in range(1, 60):
        got = _pull(copies, decoder, s, value, clock)
        norms.append(float(np.linalg.norm(value - got)))
    assert norms[0] > 10 and norms[-1] == 0.0, norms[::10]
    assert got.tobytes() == value.tobytes()


def test_sign_pulls_shrink_the_residual() -> None:
    rng = np.random.default_rng(6)
    s, copies = _slice(), PullCopies()
    decoder = PullDecoder(Compressor("sign"), ["w"], {"w": NUMEL})
    value = rng.standard_normal(NUMEL, dtype=np.float32)
    _pull(copies, decoder, s, value, 0)
    value = value + rng.standard_normal(NUMEL, dtype=np.float32)
    first = float(np.linalg.norm(value - _pull(copies, decoder, s, value, 1)))
    for clock in range(2, 40):
        got = _pull(copies, decoder, s, value, clock)
    assert float(np.linalg.norm(value - got)) < first / 4


def test_a_base_the_server_does_not_hold_is_refused_and_changes_nothing() -> None:
    rng = np.random.default_rng(8)
    s, copies = _slice(), PullCopies()
    decoder = PullDecoder(Compressor.parse("topk:0.01"), ["w"], {"w": NUMEL})
    value = rng.standard_normal(NUMEL, dtype=np.float32)
    _pull(copies, decoder, s, value, 0)
    value = value + 1
    # A reply lost on the way: the server moved its copy on, the worker never saw it.
    lost = decoder.pack(s)
    copies.serve("w0", s.slice_key, value, lost, 1)
    held = copies.copy_of("w0", s.slice_key)
    with pytest.raises(PullBaseLostError, match=r"the worker applied 1 pulls of it, this server holds a copy "
                                                r"after 2 pulls; pull it whole"):
        copies.check("w0", [s.slice_key], [decoder.pack(s)], [s.numel])
    assert copies.copy_of("w0", s.slice_key).tobytes() == held.tobytes()
    with pytest.raises(PullBaseLostError, match="this server holds no copy"):  # a restarted server
        PullCopies().check("w0", [s.slice_key], [decoder.pack(s)], [s.numel])
    decoder.lost([s])  # the worker pulls it whole, and goes on from there
    assert _pull(copies, decoder, s, value, 2).tobytes() == value.tobytes()
    assert decoder.pack(s) == PullPack("topk", 200, 1)


@pytest.mark.parametrize(("pack", "message"), [
    (PullPack("topk", 0, 1),
     r"pull_packing of slice 'w': got k=0, the slice has 20000 elements \(expected 1 to 20000\)"),
    (PullPack("topk", NUMEL + 1, 1), r"got k=20001, the slice has 20000 elements"),
    (PullPack("randomk", 5, 1), r"got encoding 'randomk', expected topk or sign"),
    (PullPack("sign", 5, 1), r"got k=5 with encoding 'sign', which takes none"),
])
def test_a_bad_packing_is_refused_naming_the_slice_and_values(pack: PullPack, message: str) -> None:
    s = _slice()
    with pytest.raises(InvalidArgumentError, match=message):
        PullCopies().check("w0", [s.slice_key], [pack], [s.numel])
    with pytest.raises(InvalidArgumentError, match=r"pull_packing: got 2 entries for 1 pulled slices"):
        PullCopies().check("w0", [s.slice_key], [pack, pack], [s.numel])


def test_a_reply_of_the_wrong_size_is_refused_and_the_copy_is_unchanged() -> None:
    s = _slice()
    decoder = PullDecoder(Compressor.parse("topk:0.01"), ["w"], {"w": NUMEL})
    with pytest.raises(PayloadSizeError, match=r"got 12 bytes, topk with base 0 needs 80000"):
        decoder.apply(s, decoder.pack(s), np.zeros(12, np.uint8), 0)
    assert decoder.pack(s).base == 0 and not decoder.copy_of("w").any()


def test_pull_packing_crosses_the_codec() -> None:
    packs = [PullPack(), PullPack("topk", 7, 3), PullPack("sign", 0, 1)]
    header = pb.ExchangeHeader(pull_packing=codec.pull_packs_to_proto(packs))
    assert codec.pull_packs_from_proto(pb.ExchangeHeader.FromString(header.SerializeToString())) == packs
    assert codec.pull_packs_from_proto(pb.ExchangeHeader()) == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"default": "topk:0.01", "pull": "randomk:0.1"},
     r"compression.pull: got 'randomk:0.1', expected none, topk:K or sign"),
    ({"default": "topk:0.01", "pull": "bf16"},
     r"compression.pull: got 'bf16', expected none, topk:K or sign"),
    ({"default": "topk:0.01", "pull": "topk:2"},
     r"compression.pull: got 'topk:2', k=2.0 is outside \(0, 1\]"),
    ({"default": "topk:0.01", "pull": "lz4"}, r"compression.pull: got 'lz4', expected one of"),
    ({"pull": "sign"}, r"compression.pull: got 'sign' with compression 'none' and no lossy rule"),
])
def test_a_bad_pull_compressor_is_refused_naming_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Compression(**kwargs)


def test_pull_compression_is_per_parameter_as_pushes_are() -> None:
    """Pulls are compressed for the parameters whose pushes are: a rule or the size floor exempts both."""
    decoder = PullDecoder(Compressor.parse("topk:0.01"), ["w"], {"w": NUMEL, "b": 10})
    assert decoder.pulls("w") and not decoder.pulls("b")
    assert Compression("topk:0.01", pull="sign").pull_compressor == Compressor("sign")
    assert Compression.from_flags("sign", pull="topk:0.5").pull == "topk:0.5"


def test_pshard_worker_takes_pull_compression(tmp_path) -> None:
    from pshard.common.errors import ClusterConfigError
    from pshard.worker.__main__ import config_from_args

    base, env = ["--data-dir", str(tmp_path), "--insecure", "--compression", "topk:0.01"], {
        "TF_CONFIG": '{"cluster": {"ps": ["127.0.0.1:7100"], "worker": ["127.0.0.1:7200"]}, '
                     '"task": {"type": "worker", "index": 0}}'}
    assert config_from_args([*base, "--pull-compression", "sign"], env).job.compression.pull == "sign"
    with pytest.raises(ClusterConfigError, match=r"compression.pull: got 'fp16'"):
        config_from_args([*base, "--pull-compression", "fp16"], env)


def test_copies_go_with_their_worker_or_slice_and_their_memory_is_counted() -> None:
    s, copies = _slice(), PullCopies()
    value = np.ones(NUMEL, np.float32)
    for worker in ("w0", "w1"):
        copies.serve(worker, s.slice_key, value, PullPack("sign", 0, 0), 0)
    assert copies.nbytes == 2 * 4 * NUMEL and copies.workers == {"w0", "w1"}  # a float32 copy per worker
    copies.forget(workers=set())
    assert copies.workers == {"w0", "w1"}
    copies.forget(workers=["w1"])
    assert copies.workers == {"w0"}
    copies.forget(keys=[s.slice_key])
    assert copies.nbytes == 0


def test_workers_with_the_same_history_share_one_copy_and_one_packing() -> None:
    """Sync mode: both workers pull every version, so the server packs each change once and keeps one copy;
    a worker that pulls whole at another version gets its own, and the shared one is copied, not changed."""
    rng = np.random.default_rng(9)
    s, copies = _slice(), PullCopies()
    decoders = {w: PullDecoder(Compressor.parse("topk:0.01"), ["w"], {"w": NUMEL}) for w in ("w0", "w1")}
    value = rng.standard_normal(NUMEL, dtype=np.float32)

    def pull(worker: str, version: int) -> np.ndarray:
        decoder = decoders[worker]
        pack = decoder.pack(s)
        copies.check(worker, [s.slice_key], [pack], [s.numel])
        wire = copies.serve(worker, s.slice_key, value, pack, version, version)
        return decoder.apply(s, pack, wire.array.reshape(-1).view(np.uint8), version)

    for version in range(6):
        got = {w: pull(w, version).copy() for w in ("w0", "w1")}
        assert got["w0"].tobytes() == got["w1"].tobytes() == copies.copy_of("w1", s.slice_key).tobytes()
        assert copies.nbytes <= 2 * 4 * NUMEL  # the copy, and at most the step before it for a lagging one
        value = value - np.float32(0.01) * rng.standard_normal(NUMEL, dtype=np.float32)
    assert copies.nbytes == 4 * NUMEL
    decoders["w1"].lost([s])  # w1 diverges: whole at version 6, then on its own
    pull("w0", 6)
    pull("w1", 6)
    value = value + 1
    for w in ("w0", "w1"):
        pulled = pull(w, 7)
        assert pulled.tobytes() == copies.copy_of(w, s.slice_key).tobytes()
    assert copies.copy_of("w0", s.slice_key).tobytes() != copies.copy_of("w1", s.slice_key).tobytes()
    assert copies.nbytes == 2 * 4 * NUMEL


def test_sign_copies_agree_bit_for_bit_on_zeros_and_negative_zeros() -> None:
    """The server adds sign's values from the change itself, the worker from the bits: the same floats."""
    s, copies = _slice(), PullCopies()
    decoder = PullDecoder(Compressor("sign"), ["w"], {"w": NUMEL})
    value = np.zeros(NUMEL, np.float32)
    value[::3] = -0.0
    _pull(copies, decoder, s, value, 0)
    value = value.copy()
    value[1::7] = np.float32(2.5)
    value[2::11] = np.float32(-1e-30)
    for clock in range(1, 4):
        got = _pull(copies, decoder, s, value, clock)
        assert got.tobytes() == copies.copy_of("w0", s.slice_key).tobytes()
