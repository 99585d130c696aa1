"""Scheduled functions travel by name: "module:function", a module-level function both ends import.

Nothing executable crosses the network (docs/guide/coordinator.md). The coordinator names a function and
checks, before anything is sent, that importing the name gives back a callable; the worker resolves the
same name. A script run as `python script.py` is `__main__` on the coordinator: its functions are named
by the module path the script has under the current directory (`examples/coordinator_sum.py` ->
`examples.coordinator_sum`), which is how `pshard launch --coordinator` workers, started in the same
directory, import it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pshard.common.errors import InvalidArgumentError


def name_of(fn: Callable[..., Any] | str, what: str = "fn") -> str:
    """The wire name of `fn` (a function or a "module:function" string); InvalidArgumentError naming
    `what` and the function when the workers could not import it."""
    if isinstance(fn, str):
        resolve(fn, what)
        return fn
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not callable(fn) or not qualname or not module:
        raise InvalidArgumentError(f"{what}: got {type(fn).__name__} {fn!r}, expected a module-level "
                                   "function (or its 'module:function' name)")
    if "<" in qualname or "." in qualname:
        raise InvalidArgumentError(
            f"{what}: got {qualname!r} of module {module!r}, expected a module-level function: a lambda, "
            "a nested function or a method cannot be named on the workers (nothing is pickled); define "
            "it at the top of a module they import")
    if module == "__main__":
        # The script itself is not importable under its module name here (its own folder is on sys.path,
        # not the current directory): the function is checked in __main__, the workers import the name.
        return f"{_main_module_name()}:{qualname}"
    name = f"{module}:{qualname}"
    resolve(name, what)
    return name


def resolve(name: str, what: str = "fn") -> Callable[..., Any]:
    """The function `name` ("module:function") names; InvalidArgumentError naming it when it is not one."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr or "." in attr:
        raise InvalidArgumentError(f"{what}: got {name!r}, expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise InvalidArgumentError(f"{what}: {name!r}: cannot import module {module_name!r} ({err}); the "
                                   "function must live in a module the workers can import") from None
    found = getattr(module, attr, None)
    if not callable(found):
        got = "nothing" if found is None else type(found).__name__
        raise InvalidArgumentError(f"{what}: {name!r}: module {module_name!r} has {got} named {attr!r}, "
                                   "expected a function")
    return found  # type: ignore[no-any-return]


def _main_module_name() -> str:
    """The import name of the script running as __main__, from its path under the current directory."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return str(spec.name)  # `python -m package.module`
    path = getattr(main, "__file__", None)
    if not path:
        raise InvalidArgumentError("fn: defined in an interactive session (__main__ has no file), expected a "
                                   "function of a module the workers can import")
    rel = Path(os.path.abspath(path)).relative_to(Path.cwd()) if _under_cwd(path) else None
    if rel is None or not all(part.isidentifier() for part in rel.with_suffix("").parts):
        raise InvalidArgumentError(f"fn: defined in the script {path!r}, which is not importable from the "
                                   f"current directory {os.getcwd()!r}; run it from the directory its module "
                                   "path starts at, or move the function into a module")
    return ".".join(rel.with_suffix("").parts)


def _under_cwd(path: str) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(Path.cwd())
