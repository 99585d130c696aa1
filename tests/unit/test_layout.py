"""The layout planner: deterministic, covers every element once, bounded slices, spread and balanced bytes."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pshard.common.cluster.layout import DEFAULT_SLICE_BYTES, ITEMSIZE, Layout, ParamSpec, plan_layout
from pshard.common.errors import EmptyRequestError, InvalidArgumentError, LayoutConflictError

SERVERS = [f"ps-{i}:7100" for i in range(8)]


@st.composite
def param_sets(draw: st.DrawFn) -> list[ParamSpec]:
    keys = draw(st.lists(st.text("abcdefw.0123", min_size=1, max_size=6), max_size=10, unique=True))
    shapes = st.lists(st.integers(0, 40), max_size=3).map(tuple)
    return [ParamSpec(k, draw(st.sampled_from(sorted(ITEMSIZE))), draw(shapes)) for k in keys]


layouts_in = st.tuples(param_sets(), st.integers(1, 5), st.integers(64, 2048))


def slice_nbytes(layout: Layout, key: str, numel: int) -> int:
    return numel * ITEMSIZE[layout.param(key).dtype]


# ---- determinism ----

@settings(max_examples=100, deadline=None)
@given(layouts_in, st.randoms(use_true_random=False))
def test_layout_depends_only_on_the_set_of_params(case: tuple, rnd: random.Random) -> None:
    params, n_servers, slice_bytes = case
    shuffled = list(params)
    rnd.shuffle(shuffled)

    first = plan_layout(params, SERVERS[:n_servers], slice_bytes)

    assert plan_layout(params, SERVERS[:n_servers], slice_bytes) == first
    assert plan_layout(shuffled, SERVERS[:n_servers], slice_bytes) == first


# ---- coverage and slice bound ----

@settings(max_examples=150, deadline=None)
@given(layouts_in)
def test_slices_of_each_key_tile_its_elements_contiguously(case: tuple) -> None:
    params, n_servers, slice_bytes = case

    layout = plan_layout(params, SERVERS[:n_servers], slice_bytes)

    assert {s.key for s in layout.slices} == {p.key for p in params}
    for p in params:
        slices = layout.slices_of(p.key)
        assert [s.part for s in slices] == list(range(len(slices)))
        assert [s.offset for s in slices] == [0, *(s.offset + s.numel for s in slices[:-1])]
        assert sum(s.numel for s in slices) == p.numel
        assert all(0 <= s.server < n_servers for s in slices)


@settings(max_examples=150, deadline=None)
@given(layouts_in)
def test_no_slice_exceeds_slice_bytes(case: tuple) -> None:
    params, n_servers, slice_bytes = case

    layout = plan_layout(params, SERVERS[:n_servers], slice_bytes)

    for s in layout.slices:
        assert slice_nbytes(layout, s.key, s.numel) <= slice_bytes or s.numel == 1


def test_small_tensors_are_placed_whole() -> None:
    layout = plan_layout([ParamSpec("w", "float32", (16,)), ParamSpec("b", "float32", (4,))], SERVERS[:3], 64)

    assert [(s.key, s.part, s.offset, s.numel) for s in layout.slices] == [("b", 0, 0, 4), ("w", 0, 0, 16)]


def test_empty_and_0d_params_get_one_slice_each() -> None:
    params = [ParamSpec("empty", "float32", (0, 7)), ParamSpec("scalar", "int64", ())]

    layout = plan_layout(params, SERVERS[:2])

    assert [(s.key, s.part, s.offset, s.numel) for s in layout.slices_of("empty")] == [("empty", 0, 0, 0)]
    assert [(s.key, s.part, s.offset, s.numel) for s in layout.slices_of("scalar")] == [("scalar", 0, 0, 1)]
    assert sum(layout.bytes_per_server()) == 8


# ---- spreading and balance ----

@settings(max_examples=150, deadline=None)
@given(layouts_in)
def test_a_tensor_bigger_than_a_slice_is_spread_over_all_servers(case: tuple) -> None:
    params, n_servers, slice_bytes = case

    layout = plan_layout(params, SERVERS[:n_servers], slice_bytes)

    for p in params:
        if p.nbytes > slice_bytes:
            servers = {s.server for s in layout.slices_of(p.key)}
            assert len(servers) == min(n_servers, p.numel), p


def test_a_layer_just_over_the_slice_bound_reaches_every_server() -> None:
    # 5 MiB over 3 servers: two 2.5 MiB halves would leave a server without a piece of it.
    big = ParamSpec("fc1.weight", "float32", (1280, 1024))

    layout = plan_layout([big, ParamSpec("fc1.bias", "float32", (1024,))], SERVERS[:3])

    assert {s.server for s in layout.slices_of("fc1.weight")} == {0, 1, 2}


def test_split_tensor_is_spread_even_when_a_whole_tensor_fills_one_server_first() -> None:
    # Largest-first alone puts "a" on server 0 and then both halves of "b" on the emptier server 1.
    params = [ParamSpec("a", "uint8", (1000,)), ParamSpec("b", "uint8", (1250,))]

    layout = plan_layout(params, SERVERS[:2], slice_bytes=1000)

    assert {s.server for s in layout.slices_of("b")} == {0, 1}


@settings(max_examples=150, deadline=None)
@given(layouts_in)
def test_server_loads_differ_by_at_most_about_one_slice(case: tuple) -> None:
    params, n_servers, slice_bytes = case

    loads = plan_layout(params, SERVERS[:n_servers], slice_bytes).bytes_per_server()

    # Equal parts of one tensor may differ by one element, hence the slack of 8 bytes per param.
    assert max(loads) - min(loads) <= slice_bytes + 8 * len(params)


def benchmark_model() -> list[ParamSpec]:
    """25M float32 parameters in 16 tensors: one of 8M, a few of 2M, the rest small."""
    params = [ParamSpec("embed.weight", "float32", (8000, 1000))]
    params += [ParamSpec(f"block{i}.weight", "float32", (2000, 1000)) for i in range(8)]
    params += [ParamSpec(f"norm{i}.weight", "float32", (160, 1000)) for i in range(6)]
    params.append(ParamSpec("head.bias", "float32", (40_000,)))
    return params


@pytest.mark.parametrize("n_servers", [2, 3])
def test_benchmark_model_is_balanced_across_servers(n_servers: int) -> None:
    params = benchmark_model()
    assert len(params) == 16 and sum(p.numel for p in params) == 25_000_000

    layout = plan_layout(params, SERVERS[:n_servers])

    loads = layout.bytes_per_server()
    assert sum(loads) == 100_000_000
    assert max(loads) - min(loads) <= DEFAULT_SLICE_BYTES
    assert max(loads) / min(loads) < 1.02
    for key in ["embed.weight", "block0.weight"]:
        assert {s.server for s in layout.slices_of(key)} == set(range(n_servers))


# ---- errors ----

def test_no_servers_is_an_empty_request() -> None:
    with pytest.raises(EmptyRequestError, match="servers"):
        plan_layout([ParamSpec("w", "float32", (4,))], [])


def test_duplicate_keys_are_invalid_and_named() -> None:
    params = [ParamSpec("w", "float32", (4,)), ParamSpec("w", "float16", (4,))]

    with pytest.raises(InvalidArgumentError, match="'w' appears twice"):
        plan_layout(params, SERVERS[:2])


def test_tiny_slice_bound_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="slice_bytes: got 63"):
        plan_layout([ParamSpec("w", "float32", (4,))], SERVERS[:1], slice_bytes=63)


@pytest.mark.parametrize(("key", "dtype", "shape", "match"), [
    ("", "float32", (1,), "param key"),
    ("w", "complex64", (1,), "'w' dtype: got 'complex64'"),
    ("w", "float32", (2, -1), r"'w' shape: got \(2, -1\)"),
])
def test_bad_param_spec_is_invalid(key: str, dtype: str, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ParamSpec(key, dtype, shape)


def test_unknown_key_is_a_layout_conflict() -> None:
    layout = plan_layout([ParamSpec("w", "float32", (4,))], SERVERS[:1])

    with pytest.raises(LayoutConflictError, match="'v'"):
        layout.param("v")


# ---- same_params ----

BASE = [ParamSpec("fc.w", "float32", (10, 4)), ParamSpec("fc.b", "float32", (4,))]


def test_same_params_ignores_order_servers_and_slice_bound() -> None:
    a = plan_layout(BASE, SERVERS[:1])
    b = plan_layout(list(reversed(BASE)), SERVERS[:3], slice_bytes=64)

    assert a.same_params(b) is None


@pytest.mark.parametrize(("other", "match"), [
    ([ParamSpec("fc.w", "float32", (10, 5)), BASE[1]], r"'fc.w'.*\(10, 4\).*\(10, 5\)"),
    ([ParamSpec("fc.w", "float16", (10, 4)), BASE[1]], r"'fc.w'.*float32.*float16"),
    ([BASE[0]], r"'fc.b'.*proposal has nothing"),
    ([*BASE, ParamSpec("extra", "int8", (1,))], r"'extra': stored layout has nothing"),
], ids=["shape", "dtype", "missing", "extra"])
def test_same_params_names_the_first_difference(other: list[ParamSpec], match: str) -> None:
    stored = plan_layout(BASE, SERVERS[:2])

    problem = stored.same_params(plan_layout(other, SERVERS[:2]))

    assert problem is not None
    assert re.search(match, problem), problem


def test_default_slice_bound_is_a_few_mib() -> None:
    assert 2**20 <= DEFAULT_SLICE_BYTES <= 8 * 2**20
