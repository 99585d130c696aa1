"""What a scheduled call carries (pshard.coordinator.values, .functions): values through the one codec,
functions by name, and a clear error naming the argument or function for anything else."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pshard.common.errors import InvalidArgumentError
from pshard.coordinator import functions, values

from pshard.api.v1 import coordinator_pb2 as pb


class Handles:
    def variable(self, name: str) -> Any:
        return ("variable", name)

    def iterator(self, ref: values.IteratorRef) -> Any:
        return ("iterator", ref)


def round_trip(value: Any) -> Any:
    message = values.encode(value)
    return values.decode(pb.Value.FromString(message.SerializeToString()), Handles())


@pytest.mark.parametrize("value", [
    None, True, False, 0, -(2 ** 63), 2 ** 63 - 1, 1.5, float("inf"), "", "ü", (1, "a"), [1, [2.5, None]], (),
])
def test_python_values_travel_as_themselves(value: Any) -> None:
    assert round_trip(value) == value
    assert type(round_trip(value)) is type(value)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "int16", "int32", "int64",
                                   "uint8", "bool"])
def test_numpy_arrays_travel_with_dtype_and_shape(dtype: str) -> None:
    array = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    back = round_trip(array)
    assert back.dtype == array.dtype and back.shape == (2, 3)
    np.testing.assert_array_equal(back, array)
    back[0, 0] = 1  # a writable copy, not a view of the message


def test_a_zero_dimensional_array_keeps_its_shape() -> None:
    assert round_trip(np.array(3.5, np.float32)).shape == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_torch_tensors_come_back_as_torch_tensors(dtype: torch.dtype) -> None:
    tensor = torch.arange(4, dtype=dtype).reshape(2, 2)
    back = round_trip(tensor)
    assert isinstance(back, torch.Tensor) and back.dtype == dtype
    assert torch.equal(back, tensor)


def test_references_become_the_workers_own_objects_and_never_results() -> None:
    ref = values.IteratorRef(3, "m:data", (10,))
    assert round_trip(values.VariableRef("w")) == ("variable", "w")
    assert round_trip(ref) == ("iterator", ref)
    with pytest.raises(InvalidArgumentError, match="result: got a VariableRef, which only travels as an arg"):
        values.encode(values.VariableRef("w"), "result", handles=False)


@pytest.mark.parametrize(("bad", "named"), [
    (object(), "builtins.object"),
    ({"a": 1}, "builtins.dict"),
    (threading.Lock(), "lock"),
    (np.array([1 + 2j]), "dtype complex128"),
    (np.array(["a"], dtype=object), "dtype object"),
    (2 ** 64, "fits in 64 bits"),
])
def test_what_cannot_travel_is_refused_naming_the_argument_and_its_type(bad: Any, named: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        values.encode_call((1, [2, bad]), {}, "m:f")
    assert "schedule(m:f): args[1][1]" in str(raised.value)
    assert named in str(raised.value)


def test_a_bad_keyword_argument_is_named_by_its_keyword() -> None:
    with pytest.raises(InvalidArgumentError, match=r"schedule\(m:f\): kwargs\['lr'\]: got a builtins.set"):
        values.encode_call((), {"lr": {0.1}}, "m:f")


def module_level(x: int) -> int:
    return x


def test_a_module_level_function_is_named_module_colon_function() -> None:
    name = functions.name_of(module_level)
    assert name == f"{__name__}:module_level"
    assert functions.resolve(name) is module_level


def test_lambdas_nested_functions_and_methods_are_refused_before_anything_is_sent() -> None:
    def nested() -> None: ...

    for fn, shown in [(lambda: 0, "<lambda>"), (nested, "nested"), (Handles().variable, "Handles.variable")]:
        with pytest.raises(InvalidArgumentError, match="expected a module-level function") as raised:
            functions.name_of(fn, "schedule: fn")
        assert shown in str(raised.value)


@pytest.mark.parametrize(("name", "problem"), [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:missing", "has nothing named 'missing'"),
    (f"{__name__}:pytest", "has module named 'pytest', expected a function"),
    ("just_a_name", "expected 'module:function'"),
])
def test_an_unknown_function_name_is_refused_naming_it(name: str, problem: str) -> None:
    with pytest.raises(InvalidArgumentError, match="schedule: fn") as raised:
        functions.name_of(name, "schedule: fn")
    assert problem in str(raised.value)


def test_a_scripts_functions_are_named_by_its_path_under_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    (tmp_path / "jobs").mkdir()
    script = tmp_path / "jobs" / "train.py"
    script.write_text("def step():\n    return 1\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(script.read_text(), str(script), "exec"), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.chdir(tmp_path)

    assert functions.name_of(main.step) == "jobs.train:step"
    monkeypatch.chdir(tmp_path / "jobs")
    assert functions.name_of(main.step) == "train:step"
