"""Accuracy-aware quantization (issue 13, Deliver 7): per-layer sensitivity and max_drop fallback to float.

The model has a deliberately sensitive layer: `mid` reads an activation whose channel 0 is ~1000x the
others (a function-preserving rescale of a trained MLP: ReLU is positively homogeneous, so stem's row 0
times 1000 and mid's column 0 over 1000 compute the same function). Per-tensor int8 on mid's input then
gives channel 0 the whole grid and rounds the other channels to a few levels.
"""

from __future__ import annotations

import copy
import numpy as np
import onnx
import pytest
import torch
from torch import nn

from conftest import run_recipe_dict

OUTLIER = 1000.0


class OutlierNet(nn.Module):
    """digits (1x8x8) -> 10 classes through three Linear layers."""

    def __init__(self, width: int = 48):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.stem(x.flatten(1))))))


def build(width: int = 48) -> nn.Module:
    return OutlierNet(width)


def _digits():
    from pruneflow.data import load_data
    from pruneflow.recipe.models import DataSpec

    return load_data(DataSpec(format="digits", max_train_samples=600, max_eval_samples=300), seed=0)


@pytest.fixture(scope="module")
def outlier_model():
    """A trained OutlierNet with the outlier channel injected, and the digits data."""
    data = _digits()
    torch.manual_seed(0)
    model = OutlierNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert data.train is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny MLP: more threads only contend on a shared machine
    try:
        for _ in range(150):
            opt.zero_grad()
            nn.functional.cross_entropy(model(data.train.x), data.train.y).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    before = model(data.eval.x)
    with torch.no_grad():
        model.stem.weight[0] *= OUTLIER
        model.stem.bias[0] *= OUTLIER
        model.mid.weight[:, 0] /= OUTLIER
    assert torch.allclose(model(data.eval.x), before, atol=1e-3)  # the same function in float
    return model, data


def _quantize(model, data):
    from pruneflow.calibrate.build import build_calibration_set
    from pruneflow.qat.nncf_quant import quantize

    assert data.train is not None
    calib = build_calibration_set(data.train, size=256, strategy="random", seed=0)
    return quantize(copy.deepcopy(model), calib), calib


def test_groups_and_ranking_put_the_outlier_layer_first(outlier_model):
    from pruneflow.tasks import Classification
    from pruneflow.qat.sensitivity import agreement, outputs, quantizer_groups, remove_group, sensitivity

    model, data = outlier_model
    quantized, calib = _quantize(model, data)
    groups = quantizer_groups(quantized, calib.x[:1])
    # one group a Linear: its weight quantizer and the quantizer of the activation it reads
    assert sorted(g.name for g in groups) == ["head", "mid", "stem"]
    assert all(len(g.hooks) == 2 for g in groups)
    assert {g.name: g.weights for g in groups} == {"stem": 64 * 48, "mid": 48 * 48, "head": 48 * 10}

    ranked = sensitivity(quantized, model, calib, Classification(), groups, samples=256)
    rows = [row for row, _ in ranked]
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert rows[0]["layer"] == "mid"
    # keeping mid float restores most of the output; keeping any other layer float restores little
    assert rows[0]["snr_db_kept_float"] > rows[1]["snr_db_kept_float"] + 10
    assert rows[0]["agreement_kept_float"] > rows[1]["agreement_kept_float"]
    # and quantized alone, mid is the layer that hurts
    alone = {r["layer"]: r["snr_db_alone_int8"] for r in rows}
    assert alone["mid"] < min(alone["stem"], alone["head"]) - 10
    assert "accuracy_kept_float" in rows[0]  # the calibration set has labels

    # the quantizers were switched back on: the model is the INT8 model again
    reference = outputs(model, data.eval.x, Classification(), 64, "cpu")
    int8 = outputs(quantized, data.eval.x, Classification(), 64, "cpu")
    remove_group(quantized, ranked[0][1])
    fallen = outputs(quantized, data.eval.x, Classification(), 64, "cpu")
    assert agreement(reference, fallen, Classification()) > agreement(reference, int8, Classification())
    from nncf.torch.function_hook import get_hook_storage

    names = [n for n, _ in get_hook_storage(quantized).named_hooks()]
    assert not any("mid/" in n for n in names) and len(names) == 4


def _recipe(tmp_path, model, **control) -> dict:
    checkpoint = tmp_path / "outlier.pt"
    torch.save(model.state_dict(), checkpoint)
    return {
        "name": "aaq", "seed": 0, "device": "cpu",
        "model": {"factory": f"{__file__}:build", "checkpoint": str(checkpoint)},
        "trust": {"code": [f"{__file__}:build"]},  # this file lies outside the recipe's folder (issue 41)
        "data": {"format": "digits", "max_train_samples": 600, "max_eval_samples": 300},
        "stages": [
            {"type": "ptq", "calibration_size": 256, "sensitivity": control},
            {"type": "export", "targets": ["onnx"], "precisions": ["fp32", "int8"], "latency": None},
        ],
    }


@pytest.mark.slow
def test_ptq_max_drop_falls_back_to_the_outlier_layer_and_exports_it_float(tmp_path, outlier_model):
    model, _ = outlier_model
    _, result = run_recipe_dict(_recipe(tmp_path, model, max_drop=0.02, max_fallback=3), tmp_path)
    stage = result.stages[0]
    m = stage.metrics
    assert m["accuracy_before_fallback"] < m["accuracy_fp32"] - 0.02  # the outlier breaks plain int8
    fallback = stage.tables["quantization fallback"]
    assert fallback[0]["layer"] == "mid" and fallback[0]["size_cost_bytes"] == 3 * 48 * 48
    assert len(fallback) == 1 and m["fallback_layers"] == 1
    assert m["accuracy_drop"] <= 0.02 and m["accuracy"] == fallback[0]["metric_after"]
    assert stage.tables["quantization sensitivity"][0]["layer"] == "mid"
    gate = next(g for g in result.gates if g.name == "ptq.sensitivity")
    assert gate.passed and "kept float: mid" in gate.message
    assert result.exit_code == 0

    # the INT8 ONNX: mid's Gemm/MatMul reads float input and float weight; the others stay int8
    path = next(a for a in result.artifacts if a.precision == "int8" and a.form == "cpu").path
    proto = onnx.load(str(result.run_dir / path))
    onnx.checker.check_model(proto, full_check=True)
    producer = {o: n for n in proto.graph.node for o in n.output}
    weighted = [n for n in proto.graph.node if n.op_type in ("Gemm", "MatMul")]
    assert len(weighted) == 3

    def dequantized(name: str) -> bool:
        src = producer.get(name)
        while src is not None and src.op_type in ("Flatten", "Reshape"):
            src = producer.get(src.input[0])
        return src is not None and src.op_type == "DequantizeLinear"

    dq = {n.name: [dequantized(i) for i in n.input[:2]] for n in weighted}
    assert dq == {"/stem/Gemm": [True, True], "/mid/Gemm": [False, False], "/head/Gemm": [True, True]}
    int8 = next(a for a in result.artifacts if a.precision == "int8" and a.form == "cpu")
    assert int8.metrics["top1_agreement"] >= 0.95  # parity with the quantized torch model, in onnxruntime
    report = (result.run_dir / "report.md").read_text()
    assert "quantization sensitivity" in report and "quantization fallback" in report


@pytest.mark.slow
def test_budget_spent_fails_the_gate(tmp_path, outlier_model):
    model, _ = outlier_model
    _, result = run_recipe_dict(_recipe(tmp_path, model, max_drop=0.0, max_fallback=0), tmp_path)
    gate = next(g for g in result.gates if g.name == "ptq.sensitivity")
    assert not gate.passed and "max_fallback 0 spent" in gate.message
    assert result.exit_code == 1
    assert result.stages[0].tables["quantization fallback"] == []


@pytest.mark.slow
def test_unknown_metric_is_a_config_error(tmp_path, outlier_model):
    from pruneflow.errors import RecipeError

    model, _ = outlier_model
    with pytest.raises(RecipeError) as info:
        run_recipe_dict(_recipe(tmp_path, model, max_drop=0.01, metric="f1"), tmp_path)
    text = str(info.value)
    assert "sensitivity.metric" in text and "'f1'" in text and "recipe.yaml:" in text
    assert "accuracy" in str(info.value.hint)


@pytest.mark.slow
def test_qat_fallback_survives_the_checkpoint(tmp_path, outlier_model):
    """The qat stage runs the same control after its int8 phase; the fallen-back layer stays float in the
    NNCF checkpoint (its quantizers are gone from NNCF's config, not merely switched off)."""
    from nncf.torch.function_hook import get_hook_storage

    from pruneflow.checkpoint import load_checkpoint
    from pruneflow.models import build_model
    from pruneflow.recipe import load_recipe

    model, data = outlier_model
    recipe = _recipe(tmp_path, model, max_drop=0.02, alone_int8=False)
    recipe["stages"] = [{"type": "qat", "calibration_size": 256, "schedule": [{"precision": "int8", "epochs": 0}],
                         "sensitivity": {"max_drop": 0.02, "alone_int8": False}}]
    _, result = run_recipe_dict(recipe, tmp_path)
    stage = result.stages[0]
    assert [r["layer"] for r in stage.tables["quantization fallback"]] == ["mid"]
    assert "snr_db_alone_int8" not in stage.tables["quantization sensitivity"][0]
    assert stage.metrics["accuracy_drop"] <= 0.02 and result.exit_code == 0
    loaded = load_recipe(result.run_dir / "recipe.resolved.yaml").recipe
    handle = load_checkpoint(result.run_dir / "stages" / "01-qat" / "model.pt", into=build_model(loaded.model))
    hooks = [n for n, _ in get_hook_storage(handle.module).named_hooks()]
    assert len(hooks) == 4 and not any("mid/" in n for n in hooks)
    out = handle.module(data.eval.x).argmax(-1)
    assert float((out == data.eval.y).float().mean()) == pytest.approx(stage.metrics["accuracy"])


def test_bert_groups_name_real_modules():
    """NNCF's op names leave out ModuleList indices; groups are named by the modules owning their weights."""
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.zoo.hf import bert_classifier
    from pruneflow.qat.nncf_quant import quantize
    from pruneflow.qat.sensitivity import quantizer_groups
    from pruneflow.qat.settings import NncfSettings

    model = bert_classifier(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, seed=0).eval()
    ids = torch.randint(1, 30522, (32, 16), generator=torch.Generator().manual_seed(0))
    # NNCF's default (cnn) type: one input quantizer shared by query, key and value (the transformer type,
    # what `auto` picks for BERT, gives each projection its own, so each is its own group there)
    quantized = quantize(copy.deepcopy(model), CalibrationSet(x=ids), NncfSettings(batch_size=16, model_type="cnn"))
    groups = quantizer_groups(quantized, ids[:1])
    modules = dict(model.named_modules())
    assert all(name in modules for g in groups for name in g.modules)
    qkv = [g for g in groups if any(name.endswith("attention.self.query") for name in g.modules)]
    # query, key and value read one input quantizer: they fall back together, one group a layer
    assert [[n.rsplit(".", 1)[1] for n in g.modules] for g in qkv] == [["query", "key", "value"]] * 2
    assert [g.name.split(" ")[0] for g in qkv] == [f"model.bert.encoder.layer.{i}.attention.self.query+key+value" for i in (0, 1)]
    assert {g.modules[0]: g.weights for g in groups if g.modules}["model.bert.encoder.layer.1.output.dense"] == 128 * 64
    hooks = [h for g in groups for h in g.hooks]
    assert len(hooks) == len(set(hooks))  # every quantizer in exactly one group


def test_a_multi_head_fallback_goes_on_until_every_head_holds(monkeypatch):
    """Two heads bounded together (a multi-task ranker's `click.auc` and `finish.auc`): the first fallback saves click
    and leaves finish 0.004 down, so a second layer falls back; each row records both heads and the worst drop."""
    import pruneflow.qat.sensitivity as sensitivity_module
    from pruneflow.tasks.base import Metric
    from pruneflow.qat.sensitivity import QuantGroup, fall_back

    removed: list[str] = []
    monkeypatch.setattr(sensitivity_module, "remove_group", lambda model, group: removed.append(group.name))
    ranked = [({"layer": name}, QuantGroup(ops=[name], modules=[name], weights=10)) for name in ("a", "b", "c")]
    after = iter([{"click.auc": 0.700, "finish.auc": 0.746}, {"click.auc": 0.700, "finish.auc": 0.749}])
    auc = Metric("auc", higher_is_better=True)
    rows, value = fall_back(None, ranked, lambda: next(after), baseline={"click.auc": 0.701, "finish.auc": 0.750},
                            start={"click.auc": 0.690, "finish.auc": 0.745}, max_drop=0.002, max_fallback=5,
                            metrics={"click.auc": auc, "finish.auc": auc})
    assert removed == ["a", "b"] and value == {"click.auc": 0.700, "finish.auc": 0.749}
    assert rows[0]["click.auc_after"] == 0.700 and rows[0]["finish.auc_after"] == 0.746
    assert rows[0]["drop_after"] == pytest.approx(0.004) and rows[1]["drop_after"] == pytest.approx(0.001)
    assert rows[1]["metric_after"] == 0.700  # the first metric named, as with one head
