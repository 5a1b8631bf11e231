"""The Python API (`pruneflow.optimize`, `validate`, `bench`): what the CLI does, as results and exceptions."""

from __future__ import annotations

import json

import pytest

import pruneflow
from pruneflow.errors import RecipeError

from conftest import tiny_recipe_dict, write


def test_validate_returns_notes_and_raises_a_located_recipe_error(tmp_path):
    good = write(tmp_path / "good.yaml", tiny_recipe_dict())
    assert pruneflow.validate(good) == []
    bad = write(tmp_path / "bad.yaml", tiny_recipe_dict(model={"factory": "missing.py:build"}))
    with pytest.raises(RecipeError) as caught:
        pruneflow.validate(bad)
    assert caught.value.exit_code == 2 and caught.value.issues[0].path == "model.factory"
    with pytest.raises(RecipeError):
        pruneflow.validate(good, overrides=["stages.0.epochs=zero"])


@pytest.mark.slow  # runs the tiny recipe, then times its artifact (~10 s)
def test_optimize_and_bench_return_what_the_cli_prints(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = pruneflow.optimize(recipe, out=tmp_path / "runs", overrides=["stages.0.epochs=2"])
    assert result.exit_code == 0 and (result.run_dir / "report.md").is_file()
    assert json.loads((result.run_dir / "manifest.json").read_text())["status"] == "complete"
    assert "epochs: 2" in (result.run_dir / "recipe.resolved.yaml").read_text()  # the override was applied
    built = [a for a in result.artifacts if a.target == "onnx" and a.status == "built"]
    evaluated = next(s.metrics["accuracy"] for s in result.stages if s.type == "evaluate")
    assert built and abs(built[0].metrics["accuracy"] - evaluated) < 0.02
    table = pruneflow.bench([result.run_dir], batches=[1], runs=3, warmup=1)
    assert table.rows and all(r.stats is not None for r in table.rows if r.error is None)
