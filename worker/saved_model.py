"""A saved model that describes itself, in one file.

``MODEL`` (the chief's ``--output``) holds the weights and everything needed to rebuild and feed
them, so that `load_model` needs nothing else to know::

    {"format": "pshard.model/2",
     "state_dict": {name: tensor, ...},              # model.load_state_dict(saved["state_dict"])
     "model": {"name": "cnn", "args": {"image_shape": [1, 28, 28], "num_classes": 10}},
     "input": {"dataset", "layout", "normalisation": {"pixel_max", "mean", "std"}, "formula"},
     "classes": [...], "job": {...}, "training": {...}, "metrics": {"test_accuracy", ...}}

Only tensors and plain JSON values (dicts, lists, strings, numbers, booleans, None), so the file
loads with ``torch.load(MODEL, weights_only=True)``: no pickled code runs on the way in.
`load_saved` returns the weights and the description without building the model.

A model saved by pshard before this format (a bare state_dict, with its description in
``MODEL.json`` beside it) still loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pshard.common.errors import PSError
from pshard.worker.config import TrainConfig
from pshard.worker.data import Dataset
from pshard.worker.model import build_model
from torch import nn

FORMAT = "pshard.model/2"
# pshard.model/1: a bare state_dict in MODEL, the description in MODEL.json (read, never written).
OLD_FORMAT = "pshard.model/1"
STATE_KEY = "state_dict"


class SavedModelError(PSError):
    """A saved model is missing or not what pshard writes; the message names the file and why."""

    status = "FAILED_PRECONDITION"


def describe(cfg: TrainConfig, data: Dataset, metrics: dict[str, Any]) -> dict[str, Any]:
    """What a saved model says about itself (everything but the weights), as plain JSON values."""
    description = {
        "format": FORMAT,
        "model": {"name": cfg.model, "args": {"image_shape": list(data.image_shape),
                                              "num_classes": data.num_classes}},
        "input": {"dataset": data.name, "layout": "NCHW float32",
                  "normalisation": {"pixel_max": data.pixel_max, "mean": data.mean, "std": data.std},
                  "formula": "x = (pixels / pixel_max - mean) / std"},
        "classes": list(data.class_names),
        "job": dataclasses.asdict(cfg.job),
        "training": {"epochs": cfg.epochs, "batch_size": cfg.batch_size, "max_steps": cfg.max_steps,
                     "seed": cfg.seed, "workers": cfg.spec.world_size, "data_dir": cfg.data_dir},
        "metrics": metrics,
    }
    # Through JSON: tuples become lists, numpy scalars fail here rather than in torch.load's allow-list,
    # and a NaN (not JSON) is refused by name.
    try:
        plain: dict[str, Any] = json.loads(json.dumps(description, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise SavedModelError(f"model description: not plain JSON: {err}") from None
    return plain


def save_model(model: nn.Module, path: str | Path, description: Mapping[str, Any]) -> str:
    """Write the weights (on CPU) and `description` to `path`, aside then renamed, so nobody reads
    half a file; returns the absolute path."""
    if STATE_KEY in description or description.get("format") != FORMAT:
        raise SavedModelError(f"model description: expected format {FORMAT!r} and no {STATE_KEY!r} key")
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({**description, STATE_KEY: state}, partial)
    partial.replace(target)
    return str(target)


def load_saved(model_path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, description) of a saved model, without building it."""
    try:
        saved = torch.load(model_path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SavedModelError(f"{model_path}: no such file") from None
    except Exception as err:  # torch raises anything from OSError to UnpicklingError for a bad file
        why = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        raise SavedModelError(f"{model_path}: not a model pshard saved ({why})") from None
    if not isinstance(saved, dict):
        raise SavedModelError(f"{model_path}: holds a {type(saved).__name__}, not a saved model")
    if saved.get("format") == FORMAT and isinstance(saved.get(STATE_KEY), dict):
        description = {k: v for k, v in saved.items() if k != STATE_KEY}
        return saved[STATE_KEY], description
    if "format" not in saved and all(isinstance(v, torch.Tensor) for v in saved.values()):
        return saved, _old_description(model_path)
    raise SavedModelError(f"{model_path}: format: got {saved.get('format')!r}, expected {FORMAT!r}")


def _old_description(model_path: str | Path) -> dict[str, Any]:
    """The MODEL.json beside a bare state_dict (pshard.model/1)."""
    path = Path(f"{model_path}.json")
    try:
        description = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SavedModelError(f"{model_path}: a bare state_dict, and no {path.name} beside it to say what "
                              "model it is") from None
    except (OSError, ValueError) as err:
        raise SavedModelError(f"{path}: cannot read: {err}") from None
    if not isinstance(description, dict) or description.get("format") != OLD_FORMAT:
        got = description.get("format") if isinstance(description, dict) else type(description).__name__
        raise SavedModelError(f"{path}: format: got {got!r}, expected {OLD_FORMAT!r}")
    return description


def load_model(model_path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The model, rebuilt from its description and loaded with its weights, in eval mode."""
    state, description = load_saved(model_path)
    try:
        arch = description["model"]
        model = build_model(arch["name"], arch["args"]["image_shape"], arch["args"]["num_classes"])
    except (KeyError, TypeError) as err:
        raise SavedModelError(f"{model_path}: model: missing {err}") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise SavedModelError(f"{model_path}: the weights do not fit a {arch['name']!r}: {err}") from None
    model.eval()
    return model, description
