"""The built-in `regression` task: squared error, R², parity in relative error, refused constant targets, and a
regressor through train → prune → ptq → export with its INT8 MSE against the FP32 model's."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import invoke
from pruneflow.errors import InputError
from pruneflow.tasks import MetricState, make_task


def test_regression_figures_are_mse_mae_and_r2_over_the_whole_split():
    task = make_task("regression")
    y = torch.tensor([1.0, 2.0, 3.0, 4.0])
    state = MetricState()
    task.update(state, torch.tensor([[1.5], [2.0]]), y[:2])  # in batches, [B, 1] outputs for [B] targets
    task.update(state, torch.tensor([[2.5], [4.0]]), y[2:])
    figures = task.compute(state)
    assert figures["mse"] == pytest.approx((0.25 + 0 + 0.25 + 0) / 4) and figures["mae"] == pytest.approx(0.25)
    assert figures["r2"] == pytest.approx(1 - 0.125 / float(y.var(unbiased=False)))
    assert task.headline.name == "mse" and not task.headline.higher_is_better and task.metric("evaluate.r2").higher_is_better


def test_regression_refuses_what_cannot_be_learnt_or_measured():
    task = make_task("regression")
    assert task.read_targets(np.array([1, 2, 3]), "price").dtype == np.float32
    with pytest.raises(InputError, match="NaN or infinite"):
        task.read_targets(np.array([1.0, np.nan]), "price")
    with pytest.raises(InputError, match="every target of the train split is 5"):
        task.check_targets({"train": torch.full((8,), 5.0), "eval": torch.tensor([1.0, 2.0])}, None, "price")
    with pytest.raises(InputError, match="one output per target"):
        task.check_output(torch.zeros(4, 3), torch.zeros(4), None, "regressor")


def test_regression_parity_is_relative_error():
    task = make_task("regression")
    ref = np.array([[2.0], [-2.0], [4.0]], dtype=np.float32)
    figures = task.agree(ref, ref * np.float32(1.01))
    assert figures["relative_error"] == pytest.approx(0.01, rel=1e-4)


def test_a_regressions_activation_ranges_reach_the_extremes_it_was_calibrated_on():
    """`ranges: auto` is minmax for regression (and a multi-task model with a value head), NNCF's mean of each batch's
    extremes otherwise; with minmax the input quantizer's range covers the one far sample of the calibration set, so
    the INT8 model's prediction for it stays close (with the mean of the batches' extremes it is clipped)."""
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.qat.nncf_quant import quantize, resolve_ranges
    from pruneflow.qat.settings import NncfSettings
    from pruneflow.zoo.mlp import mlp

    assert resolve_ranges("auto", make_task("regression")) == "minmax"
    assert resolve_ranges("auto", make_task("classification")) == "mean_minmax" and resolve_ranges("auto", None) == "mean_minmax"
    assert resolve_ranges("mean_minmax", make_task("regression")) == "mean_minmax"
    multi = make_task({"type": "multi", "heads": {"click": "binary", "dwell": "regression"}})
    assert resolve_ranges("auto", multi) == "minmax"
    assert resolve_ranges("auto", make_task({"type": "multi", "heads": {"click": "binary", "finish": "binary"}})) == "mean_minmax"

    torch.manual_seed(0)
    model = mlp(4, hidden=16, out_features=1).eval()
    x = torch.randn(256, 4)
    x[7] = 6.0  # one sample far out in every feature, in one of eight batches of 32
    with torch.no_grad():
        want = model(x[7:8])
    errors = {}
    for ranges in ("minmax", "mean_minmax"):
        quantized = quantize(copy.deepcopy(model), CalibrationSet(x=x.clone()), NncfSettings(ranges=ranges),
                             task=make_task("regression"))
        with torch.no_grad():
            errors[ranges] = float((quantized(x[7:8]) - want).abs())
    print(errors)  # pytest -s
    assert errors["minmax"] < 0.2 * errors["mean_minmax"], errors


@pytest.mark.slow
def test_a_regressor_prunes_quantizes_and_exports_with_int8_mse_close_to_fp32(tmp_path):
    """The issue's bar (24): INT8 MSE within 2 % of the FP32 model's, held by the recipe's gate and asserted here.

    On 2,000 eval rows of a well-fit MLP (FP32 MSE 0.0083, the noise floor 0.0025). With NNCF's default activation
    ranges (the mean over batches of each batch's extremes) INT8 added +22 % of MSE: the tails were clipped. A
    regression task calibrates with the extremes seen (`ranges: auto` -> minmax, tasks/regression.py), which hold
    the tails the calibration samples reach: measured on this model +1.0 % from the calibrate stage's 512 samples
    (ONNX and IR; -0.02 % and +0.04 % from 512 and 1,024 random ones), +2.02 % from 256 and +2.05 % from 300 (the ptq
    stage's own default without a calibrate stage), whose extremes fall short of the eval split's."""
    gen = np.random.default_rng(1)
    n = 8000  # 2,000 eval rows: the 2 % bar is not lost in the noise of a few hundred
    x = gen.normal(size=(n, 6)).astype(np.float32)
    y = (np.sin(x[:, 0]) + x[:, 1] * x[:, 2] * 0.5 + 0.3 * x[:, 3] + 0.05 * gen.normal(size=n)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    recipe = {
        "name": "reg", "seed": 0, "device": "cpu", "task": "regression",
        "model": {"factory": "mlp", "kwargs": {"in_features": 6, "hidden": 64, "out_features": 1}},
        "data": {"format": "npz", "path": "data.npz", "eval_fraction": 0.25},
        "stages": [
            {"type": "train", "epochs": 40, "batch_size": 32, "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.0},
            {"type": "prune", "importance": "taylor", "target": {"macs": 0.6},
             "finetune": {"epochs": 3, "batch_size": 32, "optimizer": "adamw", "lr": 0.001, "weight_decay": 0.0}},
            {"type": "calibrate"},
            {"type": "ptq"},
            {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None},
        ],
        "gates": [{"metric": "onnx.int8.mse", "baseline": "onnx.fp32.mse", "max_drop_relative": 0.02}],
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    result = invoke("optimize", tmp_path / "recipe.yaml", "--out", tmp_path / "runs", "--json")
    out = json.loads(result.stdout)
    failed = [g["name"] for g in out["gates"] if not g["passed"]]
    assert failed in ([], ["onnx.int8.mse"]) and result.exit_code == (1 if failed else 0), result.output[-2000:]
    stages = {s["name"]: s["metrics"] for s in out["stages"]}
    artifacts = {a["path"].rsplit("/", 1)[-1]: a["metrics"] for a in out["artifacts"] if a["target"]}
    assert stages["train"]["mse"] < 0.1 and stages["prune"]["macs_reduction"] > 1.4
    fp32 = artifacts["model.fp32.onnx"]
    assert fp32["relative_error"] < 1e-4 and fp32["r2"] > 0.8
    worse = {name: artifacts[name]["mse"] / fp32["mse"] - 1 for name in ("model.int8.onnx", "model.int8.xml")}
    print({n: round(m["mse"], 5) for n, m in artifacts.items()})  # pytest -s
    assert not failed and max(worse.values()) <= 0.02, worse