"""Proof that a task is one file and a registration: a third-party quantile-regression task
(tests/plugins/pf_quantile.py, registered through a ``pruneflow.tasks`` entry point, as an installed package would,
with an option of its own, ``q``) runs train → prune → ptq → export onnx/openvino with its gates, and its headline
metric (the pinball loss, lower is better) shows in report.md, --json and bench."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import invoke, plugin_installed

pytestmark = pytest.mark.slow  # end-to-end: a whole recipe runs


MODEL = '''
from torch import nn


def build(features: int = 8, hidden: int = 64):
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
'''


def _clear_recipe_models() -> None:
    from pruneflow.recipe import models

    models.task_union.cache_clear()
    models.recipe_model.cache_clear()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pf_quantile installed as a distribution would be: the module on sys.path, its entry point in a dist-info."""
    from pruneflow import registry

    with plugin_installed(tmp_path_factory.mktemp("site"), "pf_quantile", registry.tasks, "quantile = pf_quantile:Quantile",
                          _clear_recipe_models) as site:
        yield site


@pytest.fixture(scope="module")
def quantile_run(installed, tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantile")
    gen = np.random.default_rng(0)
    x = gen.normal(size=(1200, 8)).astype(np.float32)
    # a target whose spread grows with |x0|: its 0.9-quantile is not its mean plus a constant
    y = (np.tanh(x @ gen.normal(size=8)) + 0.5 * x[:, 0] + (0.1 + 0.3 * np.abs(x[:, 0])) * gen.normal(size=1200)).astype(np.float32)
    np.savez(folder / "data.npz", x=x, y=y)
    (folder / "model.py").write_text(MODEL)
    recipe = {
        "name": "q90", "seed": 0, "device": "cpu", "task": {"type": "quantile", "q": 0.9},
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
            {"metric": "evaluate.coverage_error", "max": 0.06},
            {"metric": "onnx.fp32.pinball", "baseline": "prune.pinball", "max_drop": 1e-4},
            {"metric": "onnx.int8.pinball", "baseline": "ptq.pinball_fp32", "max_drop": 0.01},
        ],
    }
    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    result = invoke("optimize", path, "--out", folder / "runs", "--json")
    return folder, result


def test_the_entry_point_task_runs_the_whole_recipe_and_is_judged_in_its_own_metric(quantile_run):
    folder, result = quantile_run
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["task"] == {"type": "quantile", "headline": "pinball", "metrics": {"pinball": "lower", "coverage_error": "lower"},
                           "agreement": "relative_error", "agreement_label": "relative error"}
    stages = {s["name"]: s["metrics"] for s in out["stages"]}
    assert stages["train"]["pinball"] < 0.1 and "train_pinball" in stages["train"]
    # the INT8 model predicts the 0.9-quantile: about 90 % of the held-out targets lie at or below its prediction
    assert abs(stages["evaluate"]["coverage"] - 0.9) < 0.06
    assert {"pinball_before", "pinball"} <= set(stages["prune"]) and stages["prune"]["macs_reduction"] > 1.5
    ptq = stages["ptq"]
    assert ptq["pinball_drop"] == pytest.approx(ptq["pinball"] - ptq["pinball_fp32"])  # worse = higher: lower is better
    assert {"pinball", "coverage_error", "coverage", "samples"} <= set(stages["evaluate"])
    artifacts = {a["path"].rsplit("/", 1)[-1]: a for a in out["artifacts"]}
    for name in ("model.fp32.onnx", "model.int8.onnx", "model.fp32.xml", "model.int8.xml"):
        m = artifacts[name]["metrics"]
        assert {"pinball", "coverage_error", "relative_error", "cosine"} <= set(m) and "top1_agreement" not in m, name
    # parity is the task's: the FP32 ONNX reproduces torch, the INT8 one is within its relative-error limit
    assert artifacts["model.fp32.onnx"]["metrics"]["relative_error"] < 1e-4
    assert artifacts["model.int8.onnx"]["metrics"]["relative_error"] < 0.1
    gates = {g["name"]: g for g in out["gates"]}
    assert all(g["passed"] for g in gates.values()), gates
    assert "lower is better" in gates["onnx.int8.pinball"]["message"]


def test_report_and_bench_show_the_headline_metric(quantile_run, tmp_path):
    folder, result = quantile_run
    run_dir = folder / "runs" / "q90"
    report = (run_dir / "report.md").read_text()
    assert "headline metric `pinball` (lower is better)" in report
    assert "| pinball |" in report and "relative error" in report and "accuracy" not in report
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["task"]["headline"] == "pinball"
    bench = invoke("bench", run_dir, "--batch", "1", "--runs", "3", "--json", tmp_path / "bench.json",
                   "--openvino-precision", "f32")
    assert bench.exit_code == 0, bench.output
    variants = json.loads((tmp_path / "bench.json").read_text())["variants"]
    assert {v["metric"] for v in variants} == {"pinball"} and all(v["metric_direction"] == "lower" for v in variants)
    assert all(v["metric_value"] is not None for v in variants)
    assert "pinball" in bench.stdout and "Δ pinball" in bench.stdout
