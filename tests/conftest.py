"""Shared fixtures: the real data beside the checkout, and a small recipe writer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


# Module-scoped end-to-end runs (tens of seconds each on 2 cores): every test that reads one is marked
# `slow`, so `make test-fast` (pytest -m "not slow") skips them; `make test` (CI) runs everything.
SLOW_FIXTURES = {"quickstart", "qat_run", "depth_run"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data beside the checkout (present locally and in CI); skip where it is absent."""
    if not (SHARED_DATA / "cifar10").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def write(path: Path, content: dict | str) -> Path:
    """Write a recipe (a dict, dumped as YAML) or any text to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def invoke(*args: object):
    """Run the CLI in-process (plain output, 200 columns); an exception other than the exit itself fails
    the test with its traceback."""
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner(env={"FORCE_COLOR": None, "COLUMNS": "200"}).invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def tiny_train_recipe(**overrides) -> dict:
    """``tiny_recipe_dict`` without its export: train 1 epoch, evaluate (the fault catalogues' run)."""
    stages = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05}, {"type": "evaluate"}]
    return tiny_recipe_dict(**{"stages": stages, **overrides})


def tiny_recipe_dict(**overrides) -> dict:
    """A recipe that runs in a few seconds: digits_cnn, 1 epoch on 300 digits, no latency timing."""
    recipe = {
        "name": "tiny",
        "seed": 0,
        "device": "cpu",
        "model": {"factory": "digits_cnn", "kwargs": {"width": 8}},
        "data": {"format": "digits", "max_train_samples": 300, "max_eval_samples": 100},
        "stages": [
            {"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
            {"type": "evaluate"},
            {"type": "export", "targets": ["onnx"], "latency": None},
        ],
    }
    recipe.update(overrides)
    return recipe


def run_recipe_dict(recipe: dict, folder: Path):
    """Write ``recipe`` to FOLDER/recipe.yaml and run it into FOLDER/runs; returns (path, RunResult)."""
    import json

    from pruneflow.pipeline import run_recipe
    from pruneflow.recipe import load_recipe

    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    return path, run_recipe(load_recipe(path), out=folder / "runs")


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(data_or_text, name="recipe.yaml") -> Path in tmp_path."""

    def write(content, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
        return path

    return write


class EvalOnly:
    """The loop's tuner when `finetune` is null: the accuracy on a fixed batch, no training."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    @torch.no_grad()
    def after_round(self, model, index, rounds, on_step_end=None) -> float:
        model.eval()
        return float((model(self.x).argmax(-1) == self.y).float().mean())
