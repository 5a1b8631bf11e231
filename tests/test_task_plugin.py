"""Proof that a task is one file and a registration: a third-party regression task (tests/plugins/pf_regression.py,
registered through a ``pruneflow.tasks`` entry point, as an installed package would) runs train → prune → ptq →
export onnx/openvino with its gates, and its headline metric (MSE, lower is better) shows in report.md, --json and
bench."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import invoke

pytestmark = pytest.mark.slow  # end-to-end: a whole recipe runs

PLUGINS = Path(__file__).parent / "plugins"

MODEL = '''
from torch import nn


def build(features: int = 8, hidden: int = 64):
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
'''


def _reset_registries() -> None:
    from pruneflow import registry
    from pruneflow.recipe import models

    registry.tasks._entry_points = None
    registry.tasks.unregister("regression")
    models.task_union.cache_clear()
    models.recipe_model.cache_clear()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pf_regression installed as a distribution would be: the module on sys.path, its entry point in a dist-info."""
    site = tmp_path_factory.mktemp("site")
    shutil.copy(PLUGINS / "pf_regression.py", site / "pf_regression.py")
    info = site / "pf_regression-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pf-regression\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pruneflow.tasks]\nregression = pf_regression:Regression\n")
    sys.path.insert(0, str(site))
    _reset_registries()
    yield site
    sys.path.remove(str(site))
    sys.modules.pop("pf_regression", None)
    _reset_registries()


@pytest.fixture(scope="module")
def regression_run(installed, tmp_path_factory):
    folder = tmp_path_factory.mktemp("regression")
    gen = np.random.default_rng(0)
    x = gen.normal(size=(800, 8)).astype(np.float32)
    y = (np.tanh(x @ gen.normal(size=8)) + 0.5 * x[:, 0] + 0.05 * gen.normal(size=800)).astype(np.float32)
    np.savez(folder / "data.npz", x=x, y=y)
    (folder / "model.py").write_text(MODEL)
    recipe = {
        "name": "reg", "seed": 0, "device": "cpu", "task": "regression",
        "model": {"factory": f"{folder / 'model.py'}:build"},
        "data": {"format": "npz", "path": "data.npz", "eval_fraction": 0.25},
        "stages": [
            {"type": "train", "epochs": 30, "batch_size": 32, "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.0},
            {"type": "prune", "importance": "taylor", "target": {"macs": 0.6},
             "finetune": {"epochs": 2, "batch_size": 32, "optimizer": "adamw", "lr": 0.001, "weight_decay": 0.0},
             "distill": {"alpha": 0.5}},
            {"type": "ptq", "calibration_size": 200},
            {"type": "evaluate"},
            {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"],
             "latency": {"batch_sizes": [1], "runs": 5}},
        ],
        "gates": [
            {"metric": "prune.mse", "max": 0.05},
            {"metric": "onnx.fp32.mse", "baseline": "prune.mse", "max_drop": 1e-4},
            {"metric": "onnx.int8.mse", "baseline": "ptq.mse_fp32", "max_drop": 0.02},
        ],
    }
    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    result = invoke("optimize", path, "--out", folder / "runs", "--json")
    return folder, result


def test_the_entry_point_task_runs_the_whole_recipe_and_is_judged_in_its_own_metric(regression_run):
    folder, result = regression_run
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["task"] == {"type": "regression", "headline": "mse", "metrics": {"mse": "lower", "mae": "lower"},
                           "agreement": "relative_error", "agreement_label": "relative error"}
    stages = {s["name"]: s["metrics"] for s in out["stages"]}
    assert stages["train"]["mse"] < 0.05 and "train_mse" in stages["train"]  # the net learnt the function
    assert {"mse_before", "mse"} <= set(stages["prune"]) and stages["prune"]["macs_reduction"] > 1.5
    ptq = stages["ptq"]
    assert ptq["mse_drop"] == pytest.approx(ptq["mse"] - ptq["mse_fp32"])  # worse = higher, for a lower-is-better metric
    assert {"mse", "mae", "samples"} <= set(stages["evaluate"]) and "accuracy" not in stages["evaluate"]
    artifacts = {a["path"].rsplit("/", 1)[-1]: a for a in out["artifacts"]}
    for name in ("model.fp32.onnx", "model.int8.onnx", "model.fp32.xml", "model.int8.xml"):
        m = artifacts[name]["metrics"]
        assert {"mse", "mae", "relative_error", "cosine"} <= set(m) and "top1_agreement" not in m, name
    # parity is the task's: the FP32 ONNX reproduces torch, the INT8 one is within its relative-error limit
    assert artifacts["model.fp32.onnx"]["metrics"]["relative_error"] < 1e-4
    assert artifacts["model.int8.onnx"]["metrics"]["relative_error"] < 0.1
    gates = {g["name"]: g for g in out["gates"]}
    assert all(g["passed"] for g in gates.values()), gates
    assert "lower is better" in gates["onnx.int8.mse"]["message"]


def test_report_and_bench_show_the_headline_metric(regression_run, tmp_path):
    folder, result = regression_run
    run_dir = folder / "runs" / "reg"
    report = (run_dir / "report.md").read_text()
    assert "headline metric `mse` (lower is better)" in report
    assert "| mse |" in report and "relative error" in report and "accuracy" not in report
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["task"]["headline"] == "mse"
    bench = invoke("bench", run_dir, "--batch", "1", "--runs", "3", "--json", tmp_path / "bench.json",
                   "--openvino-precision", "f32")
    assert bench.exit_code == 0, bench.output
    variants = json.loads((tmp_path / "bench.json").read_text())["variants"]
    assert {v["metric"] for v in variants} == {"mse"} and all(v["metric_direction"] == "lower" for v in variants)
    assert all(v["metric_value"] is not None for v in variants)
    assert "mse" in bench.stdout and "Δ mse" in bench.stdout
