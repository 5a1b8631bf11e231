"""Export targets: ONNX FP32/FP16 and OpenVINO IR, each run in its own runtime against torch."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from pruneflow.pipeline import run_recipe
from pruneflow.recipe import load_recipe

from conftest import runs_a_recipe, tiny_recipe_dict


@pytest.fixture(scope="module")
@runs_a_recipe
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    recipe = tiny_recipe_dict(name="exports")
    recipe["stages"][2] = {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "fp16"],
                           "latency": {"batch_sizes": [1], "runs": 3}}
    path = tmp / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    return run_recipe(load_recipe(path), out=tmp / "runs")


def test_every_target_and_precision_is_built_and_measured(exported):
    r = exported
    assert r.exit_code == 0, [g for g in r.gates if not g.passed]
    for label in ("onnx.fp32", "onnx.fp16", "openvino.fp32", "openvino.fp16"):
        assert r.metrics[f"{label}.top1_agreement"] >= 0.98, label
        assert abs(r.metrics[f"{label}.accuracy"] - r.metrics["evaluate.accuracy"]) <= 0.02, label
        assert 0 < r.metrics[f"{label}.latency_b1_median_ms"] <= r.metrics[f"{label}.latency_b1_p90_ms"] <= r.metrics[f"{label}.latency_b1_p99_ms"]
        assert r.metrics[f"{label}.size_mb"] == pytest.approx(next(a.size_bytes for a in r.artifacts if a.label == label) / 1e6)
    assert r.metrics["onnx.fp32.max_abs_diff"] < 1e-4
    assert r.metrics["onnx.fp16.max_abs_diff"] > 10 * r.metrics["onnx.fp32.max_abs_diff"]  # fp16 really rounds
    assert not list(r.run_dir.rglob("*.tmp")) and not list((r.run_dir / "export").rglob("tmp*"))


def test_fp16_onnx_keeps_fp32_inputs_and_stores_fp16_weights(exported):
    model = onnx.load(str(exported.run_dir / "export/onnx/model.fp16.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    weights = [t for t in model.graph.initializer if len(t.dims) == 4]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    size32 = (exported.run_dir / "export/onnx/model.fp32.onnx").stat().st_size
    assert (exported.run_dir / "export/onnx/model.fp16.onnx").stat().st_size < 0.6 * size32


def test_openvino_ir_has_its_weights_and_a_dynamic_batch(exported):
    import openvino as ov

    from pruneflow.artifacts import Manifest, sha256_file

    xml = exported.run_dir / "export/openvino/model.fp32.xml"
    artifact = next(a for a in Manifest.read(exported.run_dir)["artifacts"] if a["path"] == "export/openvino/model.fp32.xml")
    assert artifact["files"]["export/openvino/model.fp32.bin"] == sha256_file(xml.with_suffix(".bin"))  # and the .xml's
    compiled = ov.Core().compile_model(str(xml), "CPU")
    for batch in (1, 5):
        out = compiled(np.zeros((batch, 1, 8, 8), dtype=np.float32))[compiled.output(0)]
        assert out.shape == (batch, 10)


@pytest.mark.slow
def test_a_static_batch_export_is_measured_one_sample_at_a_time(tmp_path, write_recipe):
    recipe = tiny_recipe_dict(name="static")
    recipe["stages"] = [{"type": "export", "targets": [{"type": "onnx", "dynamic_batch": False}],
                         "latency": {"batch_sizes": [1, 32], "runs": 2}}]
    r = run_recipe(load_recipe(write_recipe(recipe)), out=tmp_path / "runs")
    assert r.exit_code == 0 and r.metrics["onnx.fp32.top1_agreement"] == 1.0
    assert "onnx.fp32.latency_b1_median_ms" in r.metrics and "onnx.fp32.latency_b32_median_ms" not in r.metrics
    model = onnx.load(str(r.run_dir / "export/onnx/model.fp32.onnx"))
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1


def test_parity_limits_follow_the_precision_the_runtime_computed_in():
    from pruneflow.stages.export_config import ParitySpec
    from pruneflow.stages.measure import PARITY_DEFAULTS

    spec = ParitySpec()
    fp32 = spec.limits("fp32")  # classification's: PARITY_DEFAULTS' difference and cosine, its own top-1 agreement
    assert fp32 == spec.limits("fp32", "f32")
    assert (fp32.max_abs_diff, fp32.min_cosine, fp32.agreement, fp32.metric.name) == (1e-3, 0.9999, 0.99, "top1_agreement")
    assert fp32[:2] == PARITY_DEFAULTS["fp32"][:2]
    bf16 = spec.limits("fp32", "bf16")  # OpenVINO's CPU default on AVX-512 BF16/AMX: held to bf16's limits
    assert (bf16.max_abs_diff, bf16.min_cosine, bf16.agreement) == (None, 0.999, 0.98)
    # INT8 computed in bf16 (its float parts): both errors, so both budgets: 1 - (0.01 + 0.001), 1 - (0.05 + 0.02)
    assert tuple(spec.limits("int8", "bf16"))[:3] == (None, 0.989, 0.93)
    assert spec.limits("fp16", "f16")[:3] == (5e-2, 0.999, 0.98)
    assert ParitySpec(min_top1_agreement=0.5).limits("int8").agreement == 0.5  # classification's name for `agreement`
    assert ParitySpec(min_cosine=0.99999).limits("fp32", "bf16").min_cosine == 0.99999  # a recipe value wins everywhere


@pytest.mark.slow
def test_openvino_in_bf16_fails_a_strict_parity_limit_by_name_while_f32_passes(tmp_path, write_recipe):
    """The plugin's bf16 default is checked, never skipped: a limit only f32 can meet fails `parity`, named with
    the precision it ran in, and `parity_f32` shows the file itself is faithful."""
    import openvino as ov

    if ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string() != "bf16":
        pytest.skip("OpenVINO's CPU default is not bf16 on this CPU")
    recipe = tiny_recipe_dict(name="bf16")
    recipe["stages"][2] = {"type": "export", "targets": ["openvino"], "latency": None, "evaluate": False,
                           "parity": {"min_cosine": 0.99999999}}
    r = run_recipe(load_recipe(write_recipe(recipe)), out=tmp_path / "runs")
    gates = {g.name: g for g in r.gates}
    assert r.exit_code == 1
    assert not gates["openvino.fp32.parity"].passed and "(default: bf16)" in gates["openvino.fp32.parity"].message
    assert "cosine" in gates["openvino.fp32.parity"].message and "< min_cosine 0.99999999" in gates["openvino.fp32.parity"].message
    assert gates["openvino.fp32.parity_f32"].passed and "(f32)" in gates["openvino.fp32.parity_f32"].message


def test_a_target_may_write_only_some_of_the_stages_precisions(write_recipe):
    """Ascend writes no bf16: it gets its own list beside targets that do; a precision it cannot write, or
    one the stage does not export, is an error at its own key."""
    from pruneflow.errors import RecipeError

    recipe = tiny_recipe_dict(name="some")
    recipe["stages"] = [{"type": "ptq"}, {"type": "export", "precisions": ["fp32", "bf16"],
                                          "targets": ["openvino", {"type": "ascend", "precisions": ["fp32"]}]}]
    loaded = load_recipe(write_recipe(recipe))
    assert loaded.recipe.stages[1].targets[1].precisions == ["fp32"]
    recipe["stages"][1]["targets"][1] = "ascend"
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    (issue,) = err.value.issues
    assert issue.path == "stages.1.precisions.1" and "ascend" in issue.message and "precisions: [fp32]" in issue.hint
    recipe["stages"][1]["targets"][1] = {"type": "ascend", "precisions": ["fp16"]}
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    (issue,) = err.value.issues
    assert issue.path == "stages.1.targets.1.precisions.0" and "not among the stage's precisions" in issue.message


def test_cosine_of_binary_logits_is_taken_over_the_whole_array():
    """Two logits per sample: one near-tie flipped by rounding must not count as cosine -1 (top-1 counts it)."""
    from pruneflow.stages.measure import parity_metrics

    ref = np.array([[2.0, -2.0]] * 99 + [[0.01, -0.01]])
    got = ref.copy()
    got[-1] = [-0.01, 0.01]  # the near-tie, flipped
    parity = parity_metrics(ref, got)
    assert parity["top1_agreement"] == 0.99 and parity["cosine"] > 0.9999
    ten = np.tile(np.linspace(-1, 1, 10), (4, 1))  # ten classes: the mean per-sample cosine, as before
    flipped = ten.copy()
    flipped[0] *= -1
    assert parity_metrics(ten, flipped)["cosine"] == pytest.approx(0.5)


def test_an_ir_converted_from_a_stamped_onnx_holds_its_record_once(tmp_path):
    """OpenVINO's ONNX frontend copies metadata_props into rt_info["framework"]; the IR keeps only the stamp under
    ``pruneflow`` (a ranker's vocabularies twice made its .xml 430 KB larger)."""
    import onnx
    import openvino as ov
    import torch

    from pruneflow.formats.onnx import stamp_onnx
    from pruneflow.formats.openvino import read_ir, stamp_ir
    from pruneflow.export.openvino import _without_onnx_metadata

    path = tmp_path / "m.onnx"
    torch.onnx.export(torch.nn.Linear(4, 2).eval(), (torch.randn(1, 4),), str(path), input_names=["input"],
                      output_names=["logits"], opset_version=17, dynamo=False)
    record = {"format": "pruneflow-deployment/1", "preprocessing": {"vocabulary": [str(i) for i in range(5000)]}}
    proto = onnx.load(str(path))
    stamp_onnx(proto, record, "fp32")
    onnx.save(proto, str(path))
    model = _without_onnx_metadata(ov.convert_model(str(path)))
    stamp_ir(model, record, "fp32")
    ov.save_model(model, str(tmp_path / "m.xml"))
    text = (tmp_path / "m.xml").read_text()
    assert text.count('\\u0034999') + text.count("&quot;4999&quot;") == 1  # the vocabulary's last entry, once
    assert read_ir(tmp_path / "m.xml")["preprocessing"] == record["preprocessing"]
