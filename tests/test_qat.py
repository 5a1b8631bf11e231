"""QAT and PTQ: the fp16 phase really rounds, the staged schedule runs, quantized checkpoints reload."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pruneflow.errors import InputError, RecipeError
from pruneflow.recipe import load_recipe
from pruneflow.qat.precision import fp16_rounding, round_half

from conftest import runs_a_recipe, tiny_recipe_dict


def test_the_fp16_phase_rounds_weights_and_inputs_with_straight_through_gradients():
    torch.manual_seed(0)
    layer = nn.Linear(16, 4)
    model = nn.Sequential(layer)
    x = torch.randn(8, 16) * 3
    master = layer.weight.detach().clone()
    exact = layer(x)
    with fp16_rounding(model) as count:
        assert count == 1
        out = model(x)
        expected = F.linear(x.half().float(), master.half().float(), layer.bias)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert not torch.equal(out, exact)  # rounding changed something
        out.sum().backward()
    # straight-through: the gradient is the one at the rounded point, applied to the FP32 master weight
    torch.testing.assert_close(layer.weight.grad, torch.ones(4, 1) * x.half().float().sum(0, keepdim=True))
    assert torch.equal(layer.weight.detach(), master) and type(layer) is nn.Linear  # parametrization removed
    assert round_half(torch.tensor([1.0001])).item() == torch.tensor([1.0001]).half().float().item()


@pytest.fixture(scope="module")
@runs_a_recipe
def qat_run(tmp_path_factory):
    from pruneflow.pipeline import run_recipe

    tmp = tmp_path_factory.mktemp("qat")
    recipe = tiny_recipe_dict(name="qat")
    recipe["data"]["max_train_samples"] = 400
    recipe["stages"] = [
        {"type": "train", "epochs": 3, "batch_size": 32, "lr": 0.05},
        {"type": "calibrate", "size": 64},
        {"type": "ptq"},
        {"type": "evaluate"},
        {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None},
    ]
    ptq_path = tmp / "ptq.yaml"
    ptq_path.write_text(json.dumps(recipe))
    recipe = dict(recipe, name="qat2")
    recipe["stages"] = recipe["stages"][:2] + [
        {"type": "qat", "schedule": [{"precision": "fp16", "epochs": 1}, {"precision": "int8", "epochs": 1}],
         "finetune": {"lr": 0.001, "batch_size": 32}, "freeze_bn_after": 0},
        {"type": "export", "targets": ["onnx"], "precisions": ["fp32", "int8"], "latency": None},
    ]
    qat_path = tmp / "qat.yaml"
    qat_path.write_text(json.dumps(recipe))
    return run_recipe(load_recipe(ptq_path), out=tmp / "runs"), run_recipe(load_recipe(qat_path), out=tmp / "runs")


def test_ptq_reports_int8_accuracy_beside_fp32(qat_run):
    ptq, _ = qat_run
    m = ptq.metrics
    assert ptq.exit_code == 0
    assert m["ptq.accuracy_fp32"] == m["train.accuracy"]
    assert abs(m["ptq.accuracy_drop"]) <= 0.1 and m["evaluate.accuracy"] == m["ptq.accuracy"]


def test_qat_runs_its_schedule_and_exports_the_float_weights(qat_run):
    _, qat = qat_run
    m = qat.metrics
    assert qat.exit_code == 0, [g for g in qat.gates if not g.passed]
    stage = next(s for s in qat.stages if s.type == "qat")
    assert [r["precision"] for r in stage.tables["phases"]] == ["fp32", "fp16", "int8"]
    assert {"qat.accuracy_fp16", "qat.accuracy_int8", "qat.accuracy_fp32"} <= set(m)
    assert m["onnx.fp32.top1_agreement"] >= 0.99
    # The fp32 artifact is the float model that entered the int8 phase (after the fp16 phase trained it).
    assert m["onnx.fp32.accuracy"] == m["qat.accuracy_fp16"]


def test_int8_artifacts_are_written_in_both_forms_and_measured_in_their_runtimes(qat_run):
    from pruneflow.artifacts import sha256_file

    for run in qat_run:
        assert run.exit_code == 0, [g for g in run.gates if not g.passed]
        m = run.metrics
        int8 = {a.label: a for a in run.artifacts if a.precision == "int8" and a.target}
        expected = {"onnx.int8", "onnx.int8_tensorrt"} | ({"openvino.int8"} if "openvino.fp32.accuracy" in m else set())
        assert set(int8) == expected
        assert int8["onnx.int8_tensorrt"].form == "tensorrt"
        quantized_accuracy = m["ptq.accuracy"] if "ptq.accuracy" in m else m["qat.accuracy"]
        for label, artifact in int8.items():
            assert artifact.verify(run.run_dir)
            if not artifact.files:  # one file: its own hash (an IR's covers its .xml and .bin together)
                assert sha256_file(run.run_dir / artifact.path) == artifact.sha256
            # Parity is against the quantized torch model, and its gate passed (exit code 0).
            assert m[f"{label}.top1_agreement"] >= 0.95
            assert abs(m[f"{label}.accuracy"] - quantized_accuracy) <= 0.03
        fp32 = next(a for a in run.artifacts if a.target == "onnx" and a.precision == "fp32")
        assert int8["onnx.int8"].size_bytes < fp32.size_bytes / 2  # a tiny model: scales and names weigh more


def test_the_openvino_int8_ir_is_converted_from_the_onnx_targets_int8_file(qat_run):
    """OpenVINO depends on the onnx target: its INT8 IR comes from that very file (lineage in the manifest)."""
    run = qat_run[0]
    by_key = {a.label: a for a in run.artifacts if a.target}
    onnx_int8, ir = by_key["onnx.int8"], by_key["openvino.int8"]
    if ir.metrics.get("int8_form") != onnx_int8.metrics.get("int8_form"):  # `form: auto` chose another form for the IR
        assert ir.parent == onnx_int8.parent and any("written for it from the quantized model" in n for n in ir.notes)
        return
    assert ir.parent == onnx_int8.path == "export/onnx/model.int8.onnx"
    assert f"converted from {onnx_int8.path}" in ir.notes
    manifest = json.loads((run.run_dir / "manifest.json").read_text())
    assert {a["path"]: a["parent"] for a in manifest["artifacts"]}[ir.path] == onnx_int8.path
    assert by_key["openvino.fp32"].parent == by_key["onnx.fp32"].path  # fp32 IR: from the fp32 ONNX


def test_int8_export_without_a_quantizing_stage_is_refused_before_running(tmp_path, write_recipe):
    from typer.testing import CliRunner

    from pruneflow.cli import app

    recipe = tiny_recipe_dict()
    recipe["stages"][2]["precisions"] = ["fp32", "int8"]
    result = CliRunner().invoke(app, ["optimize", str(write_recipe(recipe)), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2
    assert "stages.2.precisions.1  'int8'  int8 needs a quantized model" in result.output and "ptq" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_quantized_checkpoint_reloads_with_its_quantizers(qat_run):
    from pruneflow.checkpoint import _weights_only_load, load_checkpoint
    from pruneflow.data import load_data
    from pruneflow.evaluate import evaluate_model
    from pruneflow.tasks import Classification

    from pruneflow.models import build_model

    _, qat = qat_run
    path = qat.run_dir / "stages" / "03-qat" / "model.pt"
    payload = _weights_only_load(path)  # no pickled module: weights, structure, NNCF config (its enums allowed by name)
    assert payload["kind"] == "nncf" and "module" not in payload and "nncf_config" in payload["kind_payload"]
    recipe = load_recipe(qat.run_dir / "recipe.resolved.yaml").recipe
    handle = load_checkpoint(path, into=build_model(recipe.model))
    assert handle.kind == "nncf" and handle.quantized and handle.float_base is not None
    assert any("__nncf_hooks" in n for n, _ in handle.module.named_parameters())
    assert not any("__nncf_hooks" in n for n, _ in handle.float_module().named_parameters())
    data = load_data(recipe.data, recipe.seed, with_train=False)
    accuracy = evaluate_model(handle.module, data.eval, Classification())["accuracy"]
    assert accuracy == pytest.approx(qat.metrics["qat.accuracy"], abs=1e-9)


def test_int8_must_be_the_last_phase(write_recipe):
    recipe = tiny_recipe_dict()
    recipe["stages"] = [{"type": "qat", "schedule": [{"precision": "int8"}, {"precision": "fp16"}]}]
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    assert any("int8 must be the last phase" in i.message for i in err.value.issues)


@pytest.mark.slow
def test_qat_without_training_data_is_a_clear_error(tmp_path, write_recipe):
    import numpy as np

    from pruneflow.pipeline import run_recipe

    np.savez(tmp_path / "eval.npz", x=np.random.rand(40, 1, 8, 8).astype(np.float32), label=np.arange(40) % 10)
    recipe = tiny_recipe_dict(data={"format": "npz", "eval": "eval.npz"})
    recipe["stages"] = [{"type": "qat", "schedule": [{"precision": "int8", "epochs": 1}]}]
    with pytest.raises(InputError, match="train split"):
        run_recipe(load_recipe(write_recipe(recipe)), out=tmp_path / "runs")


SCRIPTED_MODEL = '''
import torch
from torch import nn


def build(num_classes=10):
    return nn.Sequential(nn.Flatten(), torch.jit.script(nn.Linear(64, 32)), nn.ReLU(), nn.Linear(32, num_classes))
'''


def test_a_model_nncf_cannot_trace_is_a_clear_error_naming_the_layer(tmp_path, write_recipe):
    from typer.testing import CliRunner

    from pruneflow.cli import app

    (tmp_path / "scripted.py").write_text(SCRIPTED_MODEL)
    recipe = tiny_recipe_dict(model={"factory": "scripted.py:build"})
    recipe["stages"] = [{"type": "ptq", "calibration_size": 32}]
    result = CliRunner().invoke(app, ["optimize", str(write_recipe(recipe)), "--out", str(tmp_path / "runs")])
    # refused by the ptq stage's preflight on the model (qat/nncf_preflight.py), before any stage runs: exit 2
    assert result.exit_code == 2, result.output
    assert "NNCF cannot quantize TorchScript modules" in result.output and "'1'" in result.output  # the scripted layer
    assert not (tmp_path / "runs" / recipe["name"]).exists()
    assert "Fix:" in result.output


def test_failing_module_names_the_innermost_layer_that_raised():
    from pruneflow.qat.nncf_quant import failing_module

    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("unsupported op")

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Broken()))
    with pytest.raises(RuntimeError) as err:
        model(torch.zeros(1, 4))
    assert failing_module(model, err.value) == "1.1"


@pytest.mark.slow
def test_a_pruned_and_quantized_resnet_checkpoint_reloads_without_unpickling(tmp_path):
    """The float base of an NNCF model is saved as weights + structure (here with the rewritten option-A
    shortcuts of a pruned ResNet); the file reads with weights_only=True, NNCF's config enums allowed by name."""
    import copy

    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.checkpoint import _weights_only_load, describe_structure, load_checkpoint, save_checkpoint
    from pruneflow.handle import ModelHandle
    from pruneflow.prune.engine import PruneOptions, prune_step, resolve_ignored
    from pruneflow.prune.importance import magnitude_saliency
    from pruneflow.prune.surgery import make_prunable
    from pruneflow.zoo import resnet20
    from pruneflow.qat.nncf_quant import quantize

    torch.manual_seed(0)
    model, x = resnet20(), torch.randn(16, 3, 32, 32)
    make_prunable(model, x[:1])
    prune_step(model, x[:1], magnitude_saliency(model), 0.3, PruneOptions(ignored=resolve_ignored(model, None), round_to=4))
    base = copy.deepcopy(model).eval()
    quantized = quantize(model, CalibrationSet(x=x))
    save_checkpoint(ModelHandle(quantized, kind="nncf", float_base=base), tmp_path / "model.pt")  # as the qat/ptq stages do
    payload = _weights_only_load(tmp_path / "model.pt")
    assert "module" not in payload and "nncf_config" in payload["kind_payload"]
    assert payload["structure"] == describe_structure(base)  # the float base's structure, whatever reshaped it
    loaded = load_checkpoint(tmp_path / "model.pt", into=resnet20())
    assert loaded.kind == "nncf" and any("__nncf_hooks" in n for n, _ in loaded.module.named_parameters())
    with torch.no_grad():
        assert torch.allclose(loaded.module.eval()(x), quantized.eval()(x), atol=1e-5)
        assert torch.equal(loaded.float_base.eval()(x), base(x))


def test_a_quantized_run_resumes_from_its_checkpoints(qat_run):
    """--resume reloads the ptq stage's nncf checkpoint as a handle; exports and metrics need nothing else.
    (Last in the file: it rewrites the shared run's manifest.)"""
    from pruneflow.pipeline import run_recipe

    ptq, _ = qat_run
    again = run_recipe(load_recipe(ptq.run_dir.parent.parent / "ptq.yaml"), out=ptq.run_dir.parent, resume=True)
    assert all(s.resumed for s in again.stages), [(s.id, s.resumed) for s in again.stages]
    assert again.exit_code == ptq.exit_code and again.metrics == ptq.metrics
