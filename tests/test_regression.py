"""The built-in `regression` task: squared error, R², parity in relative error, refused constant targets, and a
regressor through train → prune → ptq → export with its INT8 MSE against the FP32 model's."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import optimize_json
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


@pytest.mark.slow
def test_a_regressor_prunes_quantizes_and_exports_with_int8_mse_close_to_fp32(tmp_path):
    gen = np.random.default_rng(1)
    x = gen.normal(size=(1000, 6)).astype(np.float32)
    y = (np.sin(x[:, 0]) + x[:, 1] * x[:, 2] * 0.5 + 0.3 * x[:, 3] + 0.05 * gen.normal(size=1000)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    recipe = {
        "name": "reg", "seed": 0, "device": "cpu", "task": "regression",
        "model": {"factory": "mlp", "kwargs": {"in_features": 6, "hidden": 64, "out_features": 1}},
        "data": {"format": "npz", "path": "data.npz", "eval_fraction": 0.25},
        "stages": [
            {"type": "train", "epochs": 40, "batch_size": 32, "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.0},
            {"type": "prune", "importance": "taylor", "target": {"macs": 0.6},
             "finetune": {"epochs": 3, "batch_size": 32, "optimizer": "adamw", "lr": 0.001, "weight_decay": 0.0}},
            {"type": "ptq", "calibration_size": 256},
            {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None},
        ],
        "gates": [{"metric": "onnx.int8.mse", "baseline": "onnx.fp32.mse", "max_drop": 0.01}],
    }
    out, stages, artifacts = optimize_json(recipe, tmp_path)
    assert stages["train"]["mse"] < 0.1 and stages["prune"]["macs_reduction"] > 1.4
    fp32 = artifacts["model.fp32.onnx"]
    assert fp32["relative_error"] < 1e-4 and fp32["r2"] > 0.8
    for name in ("model.int8.onnx", "model.int8.xml"):
        # the bar: INT8 MSE within a few per cent of the FP32 model's
        assert artifacts[name]["mse"] <= fp32["mse"] * 1.05, (name, artifacts[name]["mse"], fp32["mse"])
    print({n: round(m["mse"], 5) for n, m in artifacts.items()})  # pytest -s
