"""A saved model that describes itself: ``MODEL`` (a plain torch state_dict, loadable with
``torch.load(MODEL, weights_only=True)``) and ``MODEL.json`` beside it, which says how to rebuild
and feed it: architecture and its arguments, the input normalisation, the class names, the job's
settings and the final metrics. `load_model` needs nothing else to know.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from pshard.common.errors import PSError
from pshard.worker.config import TrainConfig
from pshard.worker.data import Dataset
from pshard.worker.model import build_model
from torch import nn

FORMAT = "pshard.model/1"


class SavedModelError(PSError):
    """A saved model or its description is missing or not what pshard writes; the message names it."""

    status = "FAILED_PRECONDITION"


def description_path(model_path: str | Path) -> Path:
    return Path(f"{model_path}.json")


def describe(cfg: TrainConfig, data: Dataset, metrics: dict[str, Any]) -> dict[str, Any]:
    return {
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


def write_description(model_path: str | Path, description: dict[str, Any]) -> Path:
    """MODEL.json, written aside and renamed like the model itself."""
    target = description_path(Path(model_path).resolve())
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(description, indent=2, sort_keys=True, allow_nan=False) + "\n",
                       encoding="utf-8")
    partial.replace(target)
    return target


def load_description(model_path: str | Path) -> dict[str, Any]:
    path = description_path(model_path)
    try:
        description = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SavedModelError(f"{path}: missing; pshard writes it beside the model it saves "
                              "(a model saved by an older pshard has none)") from None
    except (OSError, ValueError) as err:
        raise SavedModelError(f"{path}: cannot read: {err}") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        got = description.get("format") if isinstance(description, dict) else type(description).__name__
        raise SavedModelError(f"{path}: format: got {got!r}, expected {FORMAT!r}")
    return description


def load_model(model_path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The model, rebuilt from its description and loaded with its weights, in eval mode."""
    description = load_description(model_path)
    try:
        arch = description["model"]
        model = build_model(arch["name"], arch["args"]["image_shape"], arch["args"]["num_classes"])
    except (KeyError, TypeError) as err:
        raise SavedModelError(f"{description_path(model_path)}: model: missing {err}") from None
    try:
        state = torch.load(model_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except (OSError, RuntimeError) as err:
        raise SavedModelError(f"{model_path}: cannot load the weights: {err}") from None
    model.eval()
    return model, description
