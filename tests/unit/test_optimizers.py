"""The server's optimizers against torch.optim, fed the same gradients.

Tolerances. torch's vectorised CPU kernels fuse the multiply-add in `add(alpha=)`,
`addcmul` and `lerp` (one rounding); numpy rounds twice. So each such operation may
differ by an ulp, and after 50 steps values agree to rtol (~8 float32 ulps, a few
thousand float64 ulps). Elements that are a small difference of large terms (a weight
crossing zero, a momentum buffer whose gradients cancel) carry the absolute rounding
error of those terms, which is large relative to the element: they get an atol of
rtol times the array's largest magnitude. An atol of one ulp of that magnitude
(1e-7 * scale) is not enough: on 60k-element float32 slices, SGD+Nesterov+L2 drifts
by 4 ulps of the scale over 50 steps, and Adam's first step amplifies the L2
cancellation grad + wd * param ~ 1e-7 (comparable to eps) into ~150 ulps.
Any algorithmic slip (bias correction, dampening, decay order) is orders larger.
"""

from __future__ import annotations

import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias

import numpy as np
import pytest
from pshard.common.errors import DTypeMismatchError
from pshard.common.job import OPTIMIZERS, OptimizerConfig
from pshard.ps_server.core.optimizers import SliceState, make_optimizer

torch = pytest.importorskip("torch")  # only the parameter server's image goes without torch

STEPS = 50
SHAPES = [(), (0,), (7,), (33, 65)]  # 65 columns: a tail the SIMD kernels handle element by element
FloatType: TypeAlias = type[np.floating[Any]]  # the slice dtypes optimizers compute in
DTYPES: list[FloatType] = [np.float32, np.float64]
RTOL = {np.float32: 1e-6, np.float64: 1e-12}

CONFIGS = [
    OptimizerConfig(name="sgd", lr=0.1),
    OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, dampening=0.5),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.01),
    OptimizerConfig(name="adam", lr=1e-3),
    OptimizerConfig(name="adam", lr=1e-2, weight_decay=0.1),
    OptimizerConfig(name="adam", lr=1e-2, amsgrad=True),
    # beta1 = 0 takes lerp's other branch (weight >= 0.5).
    OptimizerConfig(name="adam", lr=1e-2, betas=(0.0, 0.99), eps=1e-6),
    OptimizerConfig(name="adam", lr=1e-2, betas=(0.8, 0.9), weight_decay=0.05, amsgrad=True),
    OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.01),
    OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, amsgrad=True),
    OptimizerConfig(name="adamw", lr=1e-2, betas=(0.5, 0.95), weight_decay=0.0),
    OptimizerConfig(name="adagrad", lr=0.01),
    OptimizerConfig(name="adagrad", lr=0.1, lr_decay=0.01),
    OptimizerConfig(name="adagrad", lr=0.1, initial_accumulator_value=0.1),
    OptimizerConfig(name="adagrad", lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.5),
    OptimizerConfig(name="adagrad", lr=0.1, eps=1e-3),
]

# One config per optimizer with every piece of state it can have.
RICHEST = {
    "sgd": OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adam": OptimizerConfig(name="adam", lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw": OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adagrad": OptimizerConfig(name="adagrad", lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
}

EXPECTED_KEYS = [
    (OptimizerConfig(name="sgd"), set()),
    (OptimizerConfig(name="sgd", momentum=0.9), {"step", "momentum_buffer"}),
    (OptimizerConfig(name="adam"), {"step", "exp_avg", "exp_avg_sq"}),
    (OptimizerConfig(name="adam", amsgrad=True), {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (OptimizerConfig(name="adamw"), {"step", "exp_avg", "exp_avg_sq"}),
    (OptimizerConfig(name="adamw", amsgrad=True), {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (OptimizerConfig(name="adagrad"), {"step", "sum"}),
    (OptimizerConfig(name="aggregate"), set()),
]


def config_id(config: OptimizerConfig) -> str:
    defaults = OptimizerConfig(name=config.name)
    changed = [f"{k}={v}" for k, v in vars(config).items() if k != "name" and v != getattr(defaults, k)]
    return "-".join([config.name, *changed])


class TorchTwin:
    """torch.optim's single-tensor implementation stepping a copy of the same slice."""

    def __init__(self, config: OptimizerConfig, initial: np.ndarray) -> None:
        self.param = torch.nn.Parameter(torch.from_numpy(initial.copy()))
        self.steps = 0
        # torch's SGD keeps no step count; ours does, to tell the first momentum step.
        self.counts_steps = config.name == "sgd" and config.momentum != 0
        c = config
        if c.name == "sgd":
            self.optim = torch.optim.SGD([self.param], lr=c.lr, momentum=c.momentum, dampening=c.dampening,
                                         weight_decay=c.weight_decay, nesterov=c.nesterov, foreach=False)
        elif c.name in ("adam", "adamw"):
            cls = torch.optim.Adam if c.name == "adam" else torch.optim.AdamW
            self.optim = cls([self.param], lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay,
                             amsgrad=c.amsgrad, foreach=False)
        elif c.name == "adagrad":
            self.optim = torch.optim.Adagrad([self.param], lr=c.lr, lr_decay=c.lr_decay,
                                             weight_decay=c.weight_decay, eps=c.eps, foreach=False,
                                             initial_accumulator_value=c.initial_accumulator_value)
        else:
            raise ValueError(c.name)

    def step(self, grad: np.ndarray) -> None:
        self.param.grad = torch.from_numpy(grad.copy())
        self.optim.step()
        self.steps += 1

    def state(self) -> dict[str, Any]:
        state = {k: (v.item() if k == "step" else v.numpy()) for k, v in self.optim.state[self.param].items()}
        if self.counts_steps:
            state["step"] = self.steps
        return state


def random_problem(shape: tuple[int, ...], dtype: FloatType,
                   seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    initial = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]
    return initial, grads


def assert_matches(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    dtype = ours.dtype.type
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, what
    scale = float(np.max(np.abs(theirs), initial=1.0))
    np.testing.assert_allclose(ours, theirs, rtol=RTOL[dtype], atol=RTOL[dtype] * scale,
                               err_msg=what)


def assert_state_matches(ours: SliceState, theirs: dict[str, Any]) -> None:
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        if isinstance(value, np.ndarray):
            assert_matches(value, theirs[key], f"state[{key!r}]")
        else:
            assert value == theirs[key], key


def save_and_load(state: SliceState) -> SliceState:
    """A checkpoint's way: arrays through np.savez, numbers through JSON, never pickle."""
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    numbers = json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)})
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    buffer.seek(0)
    with np.load(buffer, allow_pickle=False) as npz:
        restored: SliceState = {k: npz[k] for k in npz.files}
    restored.update(json.loads(numbers))
    return restored


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_fifty_steps_match_torch(config: OptimizerConfig, shape: tuple[int, ...], dtype: FloatType) -> None:
    initial, grads = random_problem(shape, dtype, seed=len(shape) + 7 * CONFIGS.index(config))
    optimizer, twin = make_optimizer(config), TorchTwin(config, initial)
    param = initial.copy()
    state = optimizer.init_state(param)

    for i, grad in enumerate(grads):
        optimizer.step(param, grad, state)
        twin.step(grad)
        assert_matches(param, twin.param.detach().numpy(), f"param after step {i + 1}")

    assert_state_matches(state, twin.state())


@pytest.mark.parametrize("name", sorted(RICHEST))
def test_state_survives_savez_round_trip_and_keeps_matching_torch(name: str) -> None:
    config = RICHEST[name]
    initial, grads = random_problem((5, 9), np.float32, seed=3)
    twin = TorchTwin(config, initial)
    param = initial.copy()
    optimizer = make_optimizer(config)
    state = optimizer.init_state(param)
    for grad in grads[:20]:
        optimizer.step(param, grad, state)
        twin.step(grad)

    state = save_and_load(state)
    restarted = make_optimizer(config)  # as on a restarted server
    for grad in grads[20:]:
        restarted.step(param, grad, state)
        twin.step(grad)

    assert_matches(param, twin.param.detach().numpy(), "param")
    assert_state_matches(state, twin.state())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize(("config", "keys"), EXPECTED_KEYS, ids=[config_id(c) for c, _ in EXPECTED_KEYS])
def test_init_state_has_torch_keys_with_slice_shape_and_dtype(
    config: OptimizerConfig, keys: set[str], dtype: FloatType
) -> None:
    param = np.ones((3, 4), dtype=dtype)

    state = make_optimizer(config).init_state(param)

    assert set(state) == keys
    for key, value in state.items():
        if key == "step":
            assert value == 0
        else:
            assert isinstance(value, np.ndarray)
            assert (value.shape, value.dtype) == (param.shape, param.dtype), key
            assert not np.shares_memory(value, param), key


def test_adagrad_accumulator_starts_at_initial_value() -> None:
    state = make_optimizer(OptimizerConfig(name="adagrad", initial_accumulator_value=0.25)).init_state(
        np.zeros(4, dtype=np.float32)
    )

    np.testing.assert_array_equal(state["sum"], np.full(4, 0.25, dtype=np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_aggregate_makes_the_slice_hold_the_gradient(dtype: FloatType) -> None:
    optimizer = make_optimizer(OptimizerConfig(name="aggregate", lr=0.5, weight_decay=0.1))
    param = np.full((2, 3), 7.0, dtype=dtype)
    grad = np.arange(6, dtype=dtype).reshape(2, 3)
    state = optimizer.init_state(param)

    optimizer.step(param, grad, state)
    grad += 100  # the slice must hold a copy, not the caller's buffer

    np.testing.assert_array_equal(param, np.arange(6, dtype=dtype).reshape(2, 3))
    assert state == {}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_make_optimizer_builds_each_named_optimizer(name: str) -> None:
    config = OptimizerConfig(name=name, momentum=0.9, weight_decay=0.1)
    param = np.ones(4, dtype=np.float32)

    optimizer = make_optimizer(config)
    state = optimizer.init_state(param)
    optimizer.step(param, np.full(4, 0.5, dtype=np.float32), state)

    assert optimizer.config is config
    assert not np.array_equal(param, np.ones(4, dtype=np.float32))


@pytest.mark.parametrize("config", list(RICHEST.values()), ids=config_id)
def test_step_updates_a_view_in_place_and_leaves_the_gradient_alone(config: OptimizerConfig) -> None:
    store = np.ones(10, dtype=np.float32)
    param = store[2:8]  # slices live as views of the store's arrays
    grad = np.linspace(-1, 1, 6, dtype=np.float32)
    grad_before = grad.copy()
    optimizer = make_optimizer(config)
    state = optimizer.init_state(param)

    optimizer.step(param, grad, state)

    assert not np.array_equal(store[2:8], np.ones(6, dtype=np.float32))
    np.testing.assert_array_equal(store[[0, 1, 8, 9]], np.ones(4, dtype=np.float32))
    np.testing.assert_array_equal(grad, grad_before)


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_init_state_refuses_slices_that_are_not_float32_or_float64(name: str, dtype: type) -> None:
    with pytest.raises(DTypeMismatchError, match=np.dtype(dtype).name):
        make_optimizer(OptimizerConfig(name=name)).init_state(np.zeros(3, dtype=dtype))


def test_adam_with_beta1_zero_keeps_the_last_gradient_exactly_as_first_moment() -> None:
    # torch's lerp switches formula at weight 0.5 so that weight 1 returns `end` exactly.
    optimizer = make_optimizer(OptimizerConfig(name="adam", betas=(0.0, 0.99)))
    initial, grads = random_problem((1000,), np.float32, seed=5)
    param = initial.copy()
    state = optimizer.init_state(param)

    for grad in grads[:3]:
        optimizer.step(param, grad, state)

    np.testing.assert_array_equal(state["exp_avg"], grads[2])


def test_concurrent_steps_on_different_slices_equal_sequential_steps() -> None:
    # The optimizer's scratch buffers are shared between threads; none may see another's.
    # Slices of ~1 MiB so that numpy releases the GIL and the threads really overlap.
    config = RICHEST["adam"]
    problems = [random_problem((256 + i, 1024), np.float32, seed=i)[0] for i in range(8)]
    grad = np.linspace(-1.0, 1.0, 1024, dtype=np.float32)

    def train(optimizer: Any, initial: np.ndarray, start: threading.Barrier | None = None) -> np.ndarray:
        param = initial.copy()
        state = optimizer.init_state(param)
        if start is not None:
            start.wait(timeout=30)
        for _ in range(10):
            optimizer.step(param, np.broadcast_to(grad, param.shape), state)
        return param

    sequential = [train(make_optimizer(config), initial) for initial in problems]
    shared, start = make_optimizer(config), threading.Barrier(len(problems))
    with ThreadPoolExecutor(max_workers=len(problems)) as pool:
        concurrent = list(pool.map(lambda initial: train(shared, initial, start), problems))

    for got, want in zip(concurrent, sequential, strict=True):
        np.testing.assert_array_equal(got, want)
