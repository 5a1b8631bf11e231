"""The `binary` task: a click model's metrics (AUC, log loss, calibration, mean pCTR), its label checks, its
parity, and a ranker-shaped model through train → ptq → export in onnxruntime and OpenVINO."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import optimize_json
from pruneflow.errors import InputError
from pruneflow.tasks import MetricState, make_task
from pruneflow.tasks.binary import auc, calibration_error


def test_auc_is_the_rank_statistic_with_ties_counted_half():
    y = np.array([0, 0, 1, 1], dtype=float)
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), y) == pytest.approx(0.75)
    assert auc(np.array([0.5, 0.5, 0.5, 0.5]), y) == pytest.approx(0.5)
    assert auc(np.array([1.0, 2.0, 3.0, 4.0]), y) == 1.0
    gen = np.random.default_rng(0)
    scores, labels = gen.normal(size=500), (gen.random(500) < 0.3).astype(float)
    pairs = [(s1 > s0) + 0.5 * (s1 == s0) for s1 in scores[labels == 1] for s0 in scores[labels == 0]]
    assert auc(scores, labels) == pytest.approx(float(np.mean(pairs)))


def test_binary_reads_one_logit_or_two_and_reports_the_owners_figures():
    task = make_task("binary")
    z = torch.tensor([2.0, -1.0, 0.5, -3.0])
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    one, two = MetricState(), MetricState()
    task.update(one, z[:, None], y)
    task.update(two, torch.stack([torch.zeros(4), z], 1), y)  # class scores: logit = score1 - score0
    a, b = task.compute(one), task.compute(two)
    assert a == pytest.approx(b)
    p = torch.sigmoid(z)
    assert a["auc"] == 1.0 and a["accuracy"] == 0.75 and a["samples"] == 4
    assert a["log_loss"] == pytest.approx(float(torch.nn.functional.binary_cross_entropy(p, y)))
    assert a["mean_pctr"] == pytest.approx(float(p.mean())) and a["positive_rate"] == 0.25
    assert a["pctr_error"] == pytest.approx(abs(float(p.mean()) - 0.25))
    assert a["calibration_error"] == pytest.approx(calibration_error(p.numpy(), y.numpy(), 10))
    assert task.headline.name == "auc" and not task.metric("onnx.int8.log_loss").higher_is_better


def test_binary_labels_are_zero_or_one_and_never_constant():
    task = make_task("binary")
    assert task.read_targets(np.array([0, 1, 1]), "clicked").dtype == np.float32
    with pytest.raises(InputError, match="0/1 labels"):
        task.read_targets(np.array([0, 1, 2]), "clicked")
    with pytest.raises(InputError, match="every label of the train split is 0"):
        task.check_targets({"train": torch.zeros(10), "eval": torch.tensor([0.0, 1.0])}, None, "clicked")
    with pytest.raises(InputError, match=r"shape \(4, 3\)"):
        task.check_output(torch.zeros(4, 3), torch.zeros(4), None, "ranker")


def test_binary_parity_is_the_probability_difference_and_distillation_vanishes_at_the_teacher():
    task = make_task("binary")
    ref = np.array([[0.0], [2.0], [-2.0]], dtype=np.float32)
    figures = task.agree(ref, ref + np.float32(0.1))
    p, q = 1 / (1 + np.exp(-ref[:, 0])), 1 / (1 + np.exp(-(ref[:, 0] + 0.1)))
    assert figures["probability_diff"] == pytest.approx(float(np.abs(p - q).mean()), rel=1e-5)
    t = torch.tensor([[1.5], [-0.5]])
    assert float(task.distill_loss(t, t, 2.0)) == pytest.approx(0.0, abs=1e-7)
    assert float(task.distill_loss(t + 1.0, t, 2.0)) > 0


RANKER = '''
import torch
from torch import nn


class Ranker(nn.Module):
    """Ids of two categorical fields through embedding tables, plus dense features; one click logit, as a dict."""

    def __init__(self, users: int = 50, items: int = 40, dim: int = 8, dense: int = 4):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + dense, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids, dense):
        x = torch.cat([self.user(ids[:, 0]), self.item(ids[:, 1]), dense], 1)
        return {"click_logit": self.mlp(x), "hidden": x}


def build():
    return Ranker()
'''


@pytest.mark.slow
def test_a_dict_returning_ranker_trains_quantizes_and_exports_judged_by_auc_and_pctr(tmp_path):
    gen = np.random.default_rng(0)
    n = 20_000  # 5,000 eval rows: enough for a bar of 0.002 AUC to mean something
    ids = np.stack([gen.integers(0, 50, n), gen.integers(0, 40, n)], 1).astype(np.int64)
    dense = gen.normal(size=(n, 4)).astype(np.float32)
    user_bias, item_bias = gen.normal(size=50), gen.normal(size=40)  # a planted rule: AUC means something
    p = 1 / (1 + np.exp(-(1.5 * user_bias[ids[:, 0]] + 1.5 * item_bias[ids[:, 1]] + dense[:, 0] - 1.0)))
    clicked = (gen.random(n) < p).astype(np.int64)
    np.savez(tmp_path / "clicks.npz", ids=ids, dense=dense, clicked=clicked)
    (tmp_path / "ranker.py").write_text(RANKER)
    recipe = {
        "name": "ranker", "seed": 0, "device": "cpu",
        "task": {"type": "binary", "output": "click_logit"},
        "model": {"factory": f"{tmp_path / 'ranker.py'}:build"},
        "data": {"format": "npz", "path": "clicks.npz", "label_column": "clicked", "eval_fraction": 0.25,
                 "input_column": {"ids": "ids", "dense": "dense"}},
        "stages": [
            {"type": "train", "epochs": 8, "batch_size": 64, "optimizer": "adamw", "lr": 0.005, "weight_decay": 0.01},
            {"type": "ptq", "calibration_size": 256},
            {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None},
        ],
        "gates": [
            {"metric": "train.auc", "min": 0.75},
            {"metric": "onnx.int8.auc", "baseline": "onnx.fp32.auc", "max_drop": 0.002},  # issue 24's bars
            {"metric": "onnx.int8.log_loss", "baseline": "onnx.fp32.log_loss", "max_drop_relative": 0.01},
        ],
    }
    out, stages, artifacts = optimize_json(recipe, tmp_path)
    assert out["task"]["headline"] == "auc" and out["task"]["agreement"] == "probability_diff"
    train = stages["train"]
    assert train["auc"] > 0.75
    fp32 = artifacts["model.fp32.onnx"]
    assert fp32["auc"] == pytest.approx(train["auc"], abs=1e-6) and fp32["probability_diff"] < 1e-5
    for name in ("model.int8.onnx", "model.int8.xml"):
        m = artifacts[name]
        assert abs(m["auc"] - fp32["auc"]) <= 0.002 and abs(m["mean_pctr"] - fp32["mean_pctr"]) <= 0.005, (name, m)
        assert m["log_loss"] <= fp32["log_loss"] * 1.01, (name, m["log_loss"], fp32["log_loss"])
        assert m["probability_diff"] < 0.01 and m["probability_diff_fp32"] < 0.01, (name, m)  # vs quantized and float torch
    assert all(g["passed"] for g in out["gates"]), out["gates"]
    assert "probability_diff_fp32" not in fp32  # a float artifact's reference is the float model already
    shown = ("auc", "log_loss", "pctr_error", "probability_diff", "probability_diff_fp32")
    print({name: {k: round(artifacts[name].get(k, float("nan")), 4) for k in shown} for name in artifacts if name.endswith((".onnx", ".xml"))})  # pytest -s
