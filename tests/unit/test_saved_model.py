"""The saved model: one file with the weights and the description, loadable with weights_only=True,
rebuilt by `load_model` alone; the older two-file layout still loads; bad files are named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.job import JobConfig
from pshard.worker.config import TrainConfig
from pshard.worker.data import load_dataset
from pshard.worker.model import build_model
from pshard.worker.saved_model import FORMAT, SavedModelError, describe, load_model, load_saved, save_model

PLAIN = (dict, list, str, int, float, bool, type(None))


def plain_values(value: Any) -> bool:
    """Only JSON values all the way down (what the description may hold besides the tensors)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain_values(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain_values(v) for v in value)
    return isinstance(value, PLAIN)


@pytest.fixture(scope="module")
def description(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = load_dataset(tmp_path_factory.mktemp("empty"))  # no Fashion-MNIST files: the bundled digits
    spec = ClusterSpec.from_tf_config(json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                  "task": {"type": "worker", "index": 0}}))
    cfg = TrainConfig(spec=spec, job=JobConfig(mode="ssp", staleness=2), data_dir="", model="mlp", epochs=3)
    return describe(cfg, data, {"test_accuracy": 0.875, "test_loss": 0.4, "steps": 90, "train_loss": None})


def test_one_file_holds_weights_and_description_and_loads_with_weights_only(
        tmp_path: Path, description: dict[str, Any]) -> None:
    torch.manual_seed(1)
    model = build_model("mlp", (1, 8, 8), 10)
    path = save_model(model, tmp_path / "runs" / "model.pt", description)

    saved = torch.load(path, weights_only=True)
    assert saved["format"] == FORMAT and set(saved) == {*description, "state_dict"}
    assert saved["model"] == {"name": "mlp", "args": {"image_shape": [1, 8, 8], "num_classes": 10}}
    assert saved["classes"] == [str(d) for d in range(10)]
    assert saved["input"]["dataset"] == "digits" and saved["input"]["normalisation"]["std"] > 0
    assert saved["job"]["mode"] == "ssp" and saved["job"]["staleness"] == 2
    assert saved["job"]["optimizer"]["betas"] == list(JobConfig().optimizer.betas)  # a tuple, saved as a list
    assert saved["training"]["epochs"] == 3 and saved["training"]["workers"] == 2
    assert saved["metrics"]["test_accuracy"] == 0.875
    assert plain_values({k: v for k, v in saved.items() if k != "state_dict"})
    assert all(isinstance(v, torch.Tensor) for v in saved["state_dict"].values())
    assert list(tmp_path.joinpath("runs").iterdir()) == [Path(path)]  # no MODEL.json, no partial file

    rebuilt, loaded = load_model(path)
    assert loaded == {k: v for k, v in saved.items() if k != "state_dict"}
    x = torch.randn(4, 1, 8, 8)
    model.eval()
    torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)
    assert not rebuilt.training


def test_a_model_saved_as_a_bare_state_dict_with_its_json_beside_still_loads(
        tmp_path: Path, description: dict[str, Any]) -> None:
    model = build_model("mlp", (1, 8, 8), 10)
    path = tmp_path / "old.pt"
    torch.save(model.state_dict(), path)
    Path(f"{path}.json").write_text(json.dumps({**description, "format": "pshard.model/1"}))

    state, loaded = load_saved(path)
    assert loaded["model"]["name"] == "mlp" and loaded["format"] == "pshard.model/1"
    assert state.keys() == model.state_dict().keys()
    load_model(path)


def test_files_that_are_not_a_saved_model_are_refused_naming_the_file_and_why(
        tmp_path: Path, description: dict[str, Any]) -> None:
    model = build_model("mlp", (1, 8, 8), 10)
    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    with pytest.raises(SavedModelError, match=r"bare\.pt: a bare state_dict, and no bare\.pt\.json"):
        load_model(bare)
    with pytest.raises(SavedModelError, match=r"missing\.pt: no such file"):
        load_model(tmp_path / "missing.pt")
    text = tmp_path / "text.pt"
    text.write_text("not a model")
    with pytest.raises(SavedModelError, match=r"text\.pt: not a model pshard saved"):
        load_model(text)
    future = tmp_path / "future.pt"
    torch.save({**description, "format": "pshard.model/9", "state_dict": model.state_dict()}, future)
    with pytest.raises(SavedModelError, match=r"future\.pt: format: got 'pshard\.model/9'"):
        load_model(future)
    other = tmp_path / "other.pt"
    save_model(build_model("mlp", (1, 8, 8), 3), other, description)  # 3 classes, described as 10
    with pytest.raises(SavedModelError, match=r"other\.pt: the weights do not fit a 'mlp'"):
        load_model(other)
    with pytest.raises(SavedModelError, match="format"):
        save_model(model, tmp_path / "x.pt", {"model": description["model"]})
