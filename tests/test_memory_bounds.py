"""Batch sizes against the memory this process may use, its container's limit included (issue 41, item 3).

A batch whose input alone cannot fit is refused where it is written, before anything runs: at `validate` where one
sample's shape is known without the data (a zoo model's, `model.input_shape`), else once the data is loaded, before
the run folder. The limit is that of the process's own control group (v1 or v2), read from a fake /proc and /sys.
"""

from __future__ import annotations

import numpy as np

from conftest import invoke, tiny_recipe_dict, write
from pruneflow.preflight import batch_memory_problems
from test_shared_machine import fake_cgroup

MiB = 2**20


def test_an_eval_batch_past_a_containers_limit_is_refused_at_validate(tmp_path, monkeypatch):
    fake_cgroup(monkeypatch, tmp_path, "0::/ci/job\n", "ci/job", limit=64 * MiB, used=0)
    data = {"format": "digits", "max_train_samples": 300, "max_eval_samples": 100, "eval_batch_size": 200_000}
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(data=data))
    result = invoke("validate", recipe)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{recipe}:" in text and "data.eval_batch_size" in text and "0.05 GB of input alone (256 bytes a sample)" in text
    assert "under this container's memory limit (cgroup)" in text
    advised = int(0.8 * 0.25 * 64 * MiB // 256)
    assert f"use eval_batch_size: {advised} or less" in text
    data["eval_batch_size"] = advised  # the advice holds
    assert invoke("validate", write(tmp_path / "ok.yaml", tiny_recipe_dict(data=data))).exit_code == 0


def test_a_batch_size_anywhere_in_the_recipe_is_checked_each_at_its_key():
    from pruneflow.recipe.models import recipe_model

    recipe = recipe_model().model_validate(tiny_recipe_dict(stages=[
        {"type": "train", "epochs": 1, "batch_size": 8192},
        {"type": "prune", "target": {"ratio": 0.5}, "importance_batch_size": 64, "latency": {"batch_sizes": [1, 8192]}}]))
    problems = batch_memory_problems(recipe, 1000, memory=(16 * MiB, "available on this machine"))
    assert [p.loc for p in problems] == [("stages", 0, "batch_size"), ("stages", 1, "latency", "batch_sizes", 1)]
    assert batch_memory_problems(recipe, 1000, memory=(None, "unknown")) == []


def test_a_batch_too_large_for_the_datas_samples_is_refused_before_the_run_folder(tmp_path, monkeypatch):
    """A model whose sample shape comes from the data (an mlp on 100 features) is checked once the data is loaded."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "rows.npz", x=rng.normal(size=(300, 100)).astype(np.float32), label=rng.integers(0, 3, 300))
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(
        model={"factory": "mlp", "kwargs": {"in_features": 100, "out_features": 3}},
        data={"format": "npz", "path": "rows.npz", "input_column": "x", "eval_batch_size": 10_000}))
    assert invoke("validate", recipe).exit_code == 0  # the shape is the data's: not known here
    fake_cgroup(monkeypatch, tmp_path, "4:memory:/job\n", "memory/job", limit=8 * MiB, used=0)
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "data.eval_batch_size" in text and "400 bytes a sample" in text, result.output
    assert not (tmp_path / "runs" / "tiny").exists()
