"""Which compressor each parameter's gradients travel with: the job's setting, parsed once.

A compressor is named as on the command line: "none", "topk:0.01", "randomk:0.01", "sign", "bf16" or
"fp16". The job has a default and, optionally, rules by parameter name (fnmatch patterns, first match
wins) and a size floor below which a tensor goes uncompressed (biases, norms: a few hundred floats cost
more to index than to send). `Compression.plan` resolves it against the model's parameters, refusing a
rule whose pattern matches none of them (a typo would otherwise compress everything silently).

The setting is the workers': a server decodes whatever encoding each pushed slice says it has, so it
is not part of the JobConfig the servers compare (docs/guide/compression.md).

Pure: no numpy, no protobuf (the encoders are pshard.common.wire.compress).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pshard.common.errors import InvalidArgumentError, PayloadSizeError

# Names with a fraction ("topk:0.01"), names without, and the casts with the dtype they travel in.
SPARSIFIERS = ("topk", "randomk")
NAMES = ("none", "topk", "randomk", "sign", "bf16", "fp16")
CASTS = {"bf16": "bfloat16", "fp16": "float16"}
# What a pull may be compressed with: the change since the worker's last pull, as top-k or scaled sign.
PULL_NAMES = ("none", "topk", "sign")
# A tensor below this many elements is sent uncompressed unless the job says otherwise: top-k's
# index costs as much as its value, and a bias of 10 floats gains nothing from 1 % of it.
DEFAULT_MIN_NUMEL = 0


@dataclass(frozen=True)
class Compressor:
    """One compressor: its name and, for top-k and random-k, the fraction k of each slice sent."""

    name: str = "none"
    ratio: float = 1.0

    def __post_init__(self) -> None:
        _check(self.name, self.ratio, "compression")

    @classmethod
    def parse(cls, text: str, field: str = "compression") -> Compressor:
        """"topk:0.01" -> Compressor("topk", 0.01); InvalidArgumentError naming `field` and the text."""
        name, sep, ratio = text.strip().partition(":")
        if name in SPARSIFIERS and not sep:
            raise InvalidArgumentError(f"{field}: got {text!r}, expected {name}:K with K a fraction in "
                                       "(0, 1]")
        try:
            value = float(ratio) if sep else 1.0
        except ValueError:
            raise InvalidArgumentError(f"{field}: got {text!r}, k {ratio!r} is not a number") from None
        _check(name, value, field, text)
        return cls(name, value)

    def __str__(self) -> str:
        return f"{self.name}:{self.ratio:g}" if self.name in SPARSIFIERS else self.name

    @property
    def encoding(self) -> str:
        """The wire encoding of a slice sent with it ("" for none and the casts: they are dtypes)."""
        return "" if self.name == "none" or self.name in CASTS else self.name

    @property
    def wire_dtype(self) -> str:
        """The dtype a cast sends in ("" for the others)."""
        return CASTS.get(self.name, "")

    @property
    def lossy(self) -> bool:
        return self.name != "none"

    def k(self, numel: int) -> int:
        """How many of a slice's `numel` elements a sparsifier sends: at least one."""
        return max(1, min(numel, math.ceil(self.ratio * numel)))


# Bytes per element a sparsifier sends: top-k an index and a value, random-k a value (float32, uint32).
_SPARSE_BYTES = {"topk": 8, "randomk": 4}
_SCALE_BYTES = 4


def payload_k(encoding: str, numel: int, nbytes: int, what: str) -> int:
    """How many elements a packed payload of `nbytes` sends of a slice of `numel` (all of them for
    sign); PayloadSizeError naming the slice, the encoding and both sizes when no k gives that size.
    Arithmetic only, so a server's store checks a request's whole header before any gradient is read."""
    if encoding == "sign":
        want = _SCALE_BYTES + -(-numel // 8)
        if nbytes != want:
            raise PayloadSizeError(f"{what}: got {nbytes} bytes of sign, {numel} elements need {want}")
        return numel
    per = _SPARSE_BYTES.get(encoding)
    if per is None:
        raise InvalidArgumentError(f"{what}: got encoding {encoding!r}, expected one of "
                                   f"{(*_SPARSE_BYTES, 'sign')}")
    k, rest = divmod(nbytes, per)
    if rest or not 1 <= k <= numel:
        raise PayloadSizeError(f"{what}: got {nbytes} bytes of {encoding}, expected {per} bytes per sent "
                               f"element for 1 to {numel} elements")
    return k


def _usage() -> str:
    return "none, topk:K, randomk:K (K in (0, 1]), sign, bf16 or fp16"


def _check(name: str, ratio: float, field: str, text: str | None = None) -> None:
    shown = repr(text) if text is not None else repr(name)
    if name not in NAMES:
        raise InvalidArgumentError(f"{field}: got {shown}, expected one of {_usage()}")
    if name in SPARSIFIERS:
        if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
            raise InvalidArgumentError(f"{field}: got {shown}, k={ratio!r} is outside (0, 1]: "
                                       f"{name}:K sends the fraction K of each slice")
    elif ratio != 1.0:
        raise InvalidArgumentError(f"{field}: got {shown} with k={ratio!r}, but {name} takes no fraction")


NONE = Compressor()


@dataclass(frozen=True)
class PullPack:
    """How one slice is pulled (ExchangeHeader.pull_packing): `encoding` "" (whole, in the job's wire
    dtype), "topk" (`k` elements of the change) or "sign"; `base` the worker's count of the pulls of the
    slice it applied (0: it holds no copy, and the slice comes whole in float32)."""

    encoding: str = ""
    k: int = 0
    base: int = 0

    @property
    def packed(self) -> bool:
        return bool(self.encoding)


@dataclass(frozen=True)
class Compression:
    """The job's compression: a default, rules by parameter name, a size floor, and error feedback.

    `rules`: (pattern, compressor) pairs, e.g. ("*.bias", "none"); the first whose fnmatch pattern
    matches a parameter's name decides it. `min_numel`: tensors of fewer elements go uncompressed.
    `error_feedback`: each worker adds what it did not send of a slice to its next gradient (EF-SGD);
    off, what a lossy compressor drops is lost.
    `pull`: how the parameters whose pushes are compressed travel back ("none": whole; "topk:K" or
    "sign": as the compressed change since this worker's last pull, with the server keeping what it did
    not send, per worker and slice; docs/guide/compression.md, Compressed pulls).
    """

    default: str = "none"
    rules: tuple[tuple[str, str], ...] = ()
    min_numel: int = DEFAULT_MIN_NUMEL
    error_feedback: bool = True
    pull: str = "none"

    def __post_init__(self) -> None:
        # JSON and protobuf give lists; a frozen dataclass keeps tuples.
        object.__setattr__(self, "rules", tuple(tuple(r) for r in self.rules))
        Compressor.parse(self.default, "compression")
        for i, rule in enumerate(self.rules):
            if len(rule) != 2 or not rule[0]:
                raise InvalidArgumentError(f"compression.rules[{i}]: got {rule!r}, expected (pattern, "
                                           "compressor) with a non-empty pattern")
            Compressor.parse(rule[1], f"compression.rules[{i}] ({rule[0]!r})")
        if not (isinstance(self.min_numel, int) and self.min_numel >= 0):
            raise InvalidArgumentError(f"compression.min_numel: got {self.min_numel!r}, expected an integer "
                                       ">= 0")
        pull = Compressor.parse(self.pull, "compression.pull")
        if pull.name not in PULL_NAMES:
            raise InvalidArgumentError(f"compression.pull: got {self.pull!r}, expected none, topk:K or sign "
                                       "(a cast is the job's wire_dtype, which pulls take already)")
        if pull.lossy and not self.enabled:
            raise InvalidArgumentError(f"compression.pull: got {self.pull!r} with compression "
                                       f"{self.default!r} and no lossy rule: pulls are compressed for the "
                                       "parameters whose pushes are, so compress pushes too")

    @classmethod
    def from_flags(cls, default: str, rules: Sequence[str] = (), min_numel: int = DEFAULT_MIN_NUMEL,
                   error_feedback: bool = True, pull: str = "none") -> Compression:
        """From the command line: `rules` as "PATTERN=COMPRESSOR" ("*.bias=none")."""
        parsed = []
        for i, text in enumerate(rules):
            pattern, sep, name = text.rpartition("=")
            if not sep or not pattern:
                raise InvalidArgumentError(f"--compression-rule[{i}]: got {text!r}, expected "
                                           "PATTERN=COMPRESSOR, e.g. '*.bias=none'")
            parsed.append((pattern, name))
        return cls(default, tuple(parsed), min_numel, error_feedback, pull)

    @property
    def compressor(self) -> Compressor:
        return Compressor.parse(self.default)

    @property
    def pull_compressor(self) -> Compressor:
        return Compressor.parse(self.pull)

    @property
    def enabled(self) -> bool:
        return self.default != "none" or any(name != "none" for _, name in self.rules)

    def plan(self, params: Mapping[str, int]) -> dict[str, Compressor]:
        """Each parameter's compressor, from its name and element count. A rule whose pattern matches
        no parameter is refused, naming it and some of the names it could have matched."""
        rules = [(pattern, Compressor.parse(name)) for pattern, name in self.rules]
        used = [False] * len(rules)
        out = {}
        for key, numel in params.items():
            chosen = self.compressor
            for i, (pattern, compressor) in enumerate(rules):
                if fnmatch.fnmatchcase(key, pattern):
                    used[i], chosen = True, compressor
                    break
            out[key] = NONE if numel < self.min_numel else chosen
        for i, hit in enumerate(used):
            if not hit:
                names = list(params)[:6]
                raise InvalidArgumentError(f"compression.rules[{i}]: pattern {self.rules[i][0]!r} matches no "
                                           f"parameter (the model has {len(params)}: {names}"
                                           f"{', ...' if len(params) > 6 else ''})")
        return out
