"""Fixes from checking the artifacts with third-party tools (issue 12, deliverable 6): the fp32/fp16 artifacts
are the model that entered quantization, one set of input/output names, OpenVINO hashes over xml and bin,
one precision vocabulary for checkpoints too, deployment metadata in every file, constant folding."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from pruneflow.artifacts import PRECISIONS, Artifact, Manifest, combined_sha256, sha256_file
from pruneflow.checkpoint import load_checkpoint
from pruneflow.deployment import int8_cpu_runtime, openvino_int8_default_runtime, openvino_int8_runtime, resolved_scale
from pruneflow.formats.onnx import read_onnx
from pruneflow.formats.openvino import read_ir
from pruneflow.export.forms import needs_vnni
from pruneflow.export.onnx import export_onnx
from pruneflow.runtime import open_artifact
from pruneflow.models import build_model
from pruneflow.recipe import load_recipe

from conftest import run_recipe_dict, runs_a_recipe, tiny_recipe_dict


@pytest.fixture(scope="module")
@runs_a_recipe
def ptq_run(tmp_path_factory):
    """train → ptq → export onnx + openvino at fp32, fp16 and int8 (about 20 s on two cores)."""
    recipe = tiny_recipe_dict(name="deploy")
    recipe["stages"] = [
        {"type": "train", "epochs": 2, "batch_size": 32, "lr": 0.05},
        {"type": "ptq", "calibration_size": 64},
        {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "fp16", "int8"], "latency": None},
    ]
    _, result = run_recipe_dict(recipe, tmp_path_factory.mktemp("deploy"))
    assert result.exit_code == 0, [g for g in result.gates if not g.passed]
    return result


def _by_label(run) -> dict[str, Artifact]:
    return {a.label: a for a in run.artifacts if a.target}


def _handle(run, checkpoint: str):
    recipe = load_recipe(run.run_dir / "recipe.resolved.yaml").recipe
    return load_checkpoint(run.run_dir / checkpoint, into=build_model(recipe.model))


def _eval_x(run) -> np.ndarray:
    from pruneflow.data import load_data

    recipe = load_recipe(run.run_dir / "recipe.resolved.yaml").recipe
    return load_data(recipe.data, recipe.seed).eval.x.numpy()


# 1. fp32/fp16 artifacts hold the model that entered quantization ---------------------------------------


def test_the_fp32_artifacts_are_the_model_that_entered_ptq_not_the_bias_corrected_one(ptq_run):
    run = ptq_run
    entering = _handle(run, "stages/01-train/model.pt").module.eval()
    quantized = _handle(run, "stages/02-ptq/model.pt")
    # PTQ's bias correction really changed a float weight here, so the old float view would differ.
    base, corrected = quantized.float_base.state_dict(), quantized.module.state_dict()
    changed = [k for k in base if k in corrected and not torch.equal(base[k], corrected[k])]
    assert changed, "NNCF changed no float weight: this test would not tell the two models apart"
    old_view = copy.deepcopy(quantized.float_base)
    old_view.load_state_dict({k: v for k, v in corrected.items() if k in base})

    x = _eval_x(run)
    with torch.no_grad():
        ref = entering(torch.from_numpy(x)).numpy()
        old = old_view.eval()(torch.from_numpy(x)).numpy()
    by = _by_label(run)
    got_onnx = open_artifact(run.run_dir / by["onnx.fp32"].path)(x)
    assert np.abs(got_onnx - ref).max() < 1e-5
    assert np.abs(got_onnx - old).max() > 1e-4  # what the fp32 artifact held before the fix
    import openvino as ov

    compiled = ov.Core().compile_model(str(run.run_dir / by["openvino.fp32"].path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert np.abs(compiled(x)[compiled.output(0)] - ref).max() < 1e-4
    # The handle's float view is that same model (parity is checked against it), and the checkpoint keeps it.
    assert all(torch.equal(v, entering.state_dict()[k]) for k, v in quantized.float_module().state_dict().items())


def test_gate_metrics_are_the_whole_eval_splits_and_the_fp32_artifact_matches_the_entering_accuracy(ptq_run):
    m = ptq_run.metrics
    assert m["ptq.eval_samples"] == len(_eval_x(ptq_run)) == 100  # tiny recipe: max_eval_samples 100
    # The same model on the same (whole) split, in torch and in both runtimes.
    assert m["onnx.fp32.accuracy"] == m["ptq.accuracy_fp32"] == m["train.accuracy"]
    assert m["openvino.fp32.accuracy"] == m["ptq.accuracy_fp32"]
    assert m["onnx.fp32.max_abs_diff"] < 1e-5 and m["onnx.fp32.top1_agreement"] == 1.0


# 2. one set of names ----------------------------------------------------------------------------------


def test_every_artifact_of_a_run_has_the_same_input_and_output_names(ptq_run):
    import openvino as ov

    names = {}
    for artifact in ptq_run.artifacts:
        path = ptq_run.run_dir / artifact.path
        if artifact.kind == "onnx":
            graph = onnx.load(str(path)).graph
            names[artifact.label] = ([i.name for i in graph.input], [o.name for o in graph.output])
        elif artifact.kind == "openvino":
            model = ov.Core().read_model(str(path))
            names[artifact.label] = ([sorted(i.get_names()) for i in model.inputs], [sorted(o.get_names()) for o in model.outputs])
    assert {k: v for k, v in names.items() if k.startswith("onnx")} == {
        label: (["input"], ["logits"]) for label in ("onnx.fp32", "onnx.fp16", "onnx.int8", "onnx.int8_tensorrt")}
    assert {k: v for k, v in names.items() if k.startswith("openvino")} == {
        label: ([["input"]], [["logits"]]) for label in ("openvino.fp32", "openvino.fp16", "openvino.int8")}


def test_every_ir_is_converted_from_the_onnx_targets_file_of_its_precision(ptq_run):
    by = _by_label(ptq_run)
    assert by["openvino.fp32"].parent == by["openvino.fp16"].parent == by["onnx.fp32"].path
    # the INT8 IR: from the onnx target's file of the form it was converted from (`form: auto` chose it here),
    # or, for a form the onnx target did not write, from one written for it out of the quantized model
    ir_form = by["openvino.int8"].metrics["int8_form"]
    source = {by["onnx.int8"].metrics["int8_form"]: by["onnx.int8"].path, "tensorrt": by["onnx.int8_tensorrt"].path}
    if ir_form in source:
        assert by["openvino.int8"].parent == source[ir_form]
    else:
        assert by["openvino.int8"].parent == by["onnx.int8"].parent
        assert f"converted from the {ir_form} INT8 ONNX, written for it from the quantized model" in by["openvino.int8"].notes
    assert f"converted from {by['onnx.fp32'].path}" in by["openvino.fp16"].notes


@pytest.fixture(scope="module")
@runs_a_recipe
def ir_only(tmp_path_factory):
    """train → evaluate → export openvino fp32 alone, static batch (so no ONNX from the onnx target to convert)."""
    recipe = tiny_recipe_dict(name="ir-only")
    recipe["stages"][2] = {"type": "export", "targets": [{"type": "openvino", "dynamic_batch": False}],
                           "precisions": ["fp32"], "latency": None}
    path, run = run_recipe_dict(recipe, tmp_path_factory.mktemp("ir-only"))
    assert run.exit_code == 0
    return path, run


def test_without_the_onnx_target_the_ir_still_reads_input_and_logits(ir_only):
    import openvino as ov

    _, run = ir_only
    ir = _by_label(run)["openvino.fp32"]
    model = ov.Core().read_model(str(run.run_dir / ir.path))
    assert model.inputs[0].get_names() == {"input"} and model.outputs[0].get_names() == {"logits"}
    assert model.inputs[0].get_partial_shape().to_shape() == [1, 1, 8, 8]  # static batch as asked
    assert ir.parent.startswith("stages/") and read_ir(run.run_dir / ir.path)["input"]["shape"] == [1, 1, 8, 8]


# 3. OpenVINO sha256 covers xml and bin ------------------------------------------------------------------


def test_an_ir_artifacts_sha256_covers_xml_and_bin_and_a_flipped_bin_byte_is_found(ptq_run):
    ir = _by_label(ptq_run)["openvino.fp32"]
    run_dir = ptq_run.run_dir
    xml, binary = ir.path, ir.path.removesuffix(".xml") + ".bin"
    assert ir.files == {xml: sha256_file(run_dir / xml), binary: sha256_file(run_dir / binary)}
    assert ir.sha256 == combined_sha256(xml, ir.files) != ir.files[xml]
    assert ir.size_bytes == (run_dir / xml).stat().st_size + (run_dir / binary).stat().st_size
    # The documented recipe: `sha256sum model.fp32.xml model.fp32.bin | sha256sum` in the artifact's folder.
    import hashlib

    listing = "".join(f"{sha256_file(run_dir / p)}  {Path(p).name}\n" for p in (xml, binary))
    assert hashlib.sha256(listing.encode()).hexdigest() == ir.sha256
    record = next(a for a in Manifest.read(run_dir)["artifacts"] if a["path"] == xml)
    assert Artifact.from_record(record).verify(run_dir)

    data = bytearray((run_dir / binary).read_bytes())
    data[len(data) // 2] ^= 0x01
    original = (run_dir / binary).read_bytes()
    (run_dir / binary).write_bytes(bytes(data))
    try:
        assert not Artifact.from_record(record).verify(run_dir)
    finally:
        (run_dir / binary).write_bytes(original)
    assert Artifact.from_record(record).verify(run_dir)


def test_resume_rebuilds_an_export_whose_bin_changed(ir_only):
    from pruneflow.pipeline import run_recipe

    path, first = ir_only
    binary = next(first.run_dir.rglob("model.fp32.bin"))
    data = bytearray(binary.read_bytes())
    data[-1] ^= 0xFF
    binary.write_bytes(bytes(data))
    again = run_recipe(load_recipe(path), out=first.run_dir.parent, resume=True)
    assert {s.id: s.resumed for s in again.stages} == {"train": True, "evaluate": True, "export": False}
    ir = _by_label(again)["openvino.fp32"]
    assert ir.verify(again.run_dir) and binary.read_bytes() != bytes(data)


def test_a_record_whose_files_leave_out_the_main_file_does_not_verify(tmp_path):
    """Only the layout ``add_file`` writes is trusted (files: every file, the main one included; sha256: their
    combined digest); anything else makes --resume run the stage again."""
    (tmp_path / "m.xml").write_text("<net/>")
    (tmp_path / "m.bin").write_bytes(b"\x00\x01")
    other = {"path": "m.xml", "kind": "openvino", "producer": "export", "sha256": sha256_file(tmp_path / "m.xml"),
             "files": {"m.bin": sha256_file(tmp_path / "m.bin")}, "precision": "fp32"}
    assert not Artifact.from_record(other).verify(tmp_path)
    artifact = Artifact.from_file(tmp_path, tmp_path / "m.xml", kind="openvino", producer="export", precision="fp32")
    artifact.add_file(tmp_path, tmp_path / "m.bin")
    assert Artifact.from_record(artifact.as_dict()).verify(tmp_path)


# 4. one precision vocabulary ----------------------------------------------------------------------------


def test_a_quantized_checkpoint_is_labelled_int8_fakequant(ptq_run):
    checkpoints = {a.producer: a for a in ptq_run.artifacts if a.kind == "checkpoint"}
    assert (checkpoints["train"].precision, checkpoints["train"].form) == ("fp32", None)
    assert (checkpoints["ptq"].precision, checkpoints["ptq"].form) == ("int8", "fakequant")
    manifest = Manifest.read(ptq_run.run_dir)
    assert {a["precision"] for a in manifest["artifacts"]} <= set(PRECISIONS)
    assert {(a["precision"], a["form"]) for a in manifest["artifacts"] if a["precision"] == "int8"} == {
        ("int8", "fakequant"), ("int8", "cpu"), ("int8", "tensorrt"), ("int8", None)}


def test_precision_values_outside_the_vocabulary_are_refused_and_a_record_reads_back_as_written():
    with pytest.raises(ValueError, match="int8_tensorrt.*form"):
        Artifact(path="m.onnx", kind="onnx", producer="export", precision="int8_tensorrt")
    with pytest.raises(ValueError, match="int8_tensorrt.*form"):
        Artifact.from_record({"path": "m.onnx", "kind": "onnx", "producer": "export", "precision": "int8_tensorrt"})
    with pytest.raises(TypeError, match="no_longer_a_field"):
        Artifact.from_record({"path": "m.onnx", "kind": "onnx", "producer": "export", "no_longer_a_field": 1})
    written = Artifact(path="m.onnx", kind="onnx", producer="export", precision="int8", form="tensorrt", target="onnx")
    assert Artifact.from_record(written.as_dict()) == written and written.label == "onnx.int8_tensorrt"


# 5. deployment metadata ---------------------------------------------------------------------------------


def test_every_file_carries_its_deployment_record_and_the_manifest_the_runs(ptq_run):
    run_dir = ptq_run.run_dir
    manifest = Manifest.read(run_dir)
    expected = {
        "format": "pruneflow-deployment/1",
        "input": {"name": "input", "shape": ["batch", 1, 8, 8], "dtype": "float32", "layout": "NCHW"},
        "output": {"name": "logits", "shape": ["batch", 10], "dtype": "float32"},
        "preprocessing": {"scale": 1.0, "mean": None, "std": None, "steps": "x * scale"},
        "labels": [str(i) for i in range(10)],
    }
    assert manifest["deployment"] == expected
    exported = [a for a in ptq_run.artifacts if a.target]
    assert len(exported) == 7
    for artifact in exported:
        # an OpenVINO INT8 IR also says how to compile it: f32, the precision its float parts were trained in; an
        # INT8 file in a form `form: auto` chose that needs VNNI says so
        form = artifact.metrics.get("int8_form")
        runtime = int8_cpu_runtime(form) if artifact.label == "onnx.int8" else None
        if artifact.label == "openvino.int8":  # f32, or OpenVINO's default where measured faster (int8_hint: auto)
            runtime = openvino_int8_runtime() if artifact.metrics["int8_hint"] == "f32" else openvino_int8_default_runtime()
            if needs_vnni(form):
                runtime["cpu"] = int8_cpu_runtime(form)["cpu"]
        assert artifact.deployment == ({**expected, "runtime": runtime} if runtime else expected), artifact.label
        read = read_onnx if artifact.kind == "onnx" else read_ir
        assert read(run_dir / artifact.path) == {**expected, "precision": artifact.precision, "runtime": runtime}, artifact.label
    ir = next(a for a in exported if a.label == "openvino.int8")
    pinned = ir.metrics["int8_hint"] == "f32"
    assert ir.deployment["runtime"]["openvino"] == ({"INFERENCE_PRECISION_HINT": "f32"} if pinned else {})
    if "top1_agreement_f32" in ir.metrics and pinned:  # a host whose OpenVINO defaults to bf16: measured both ways, the note says so
        assert any(n.startswith("deploy with INFERENCE_PRECISION_HINT=f32") and "top-1 agreement" in n for n in ir.notes), ir.notes
    props = {p.key: p.value for p in onnx.load(str(run_dir / "export/onnx/model.int8.tensorrt.onnx")).metadata_props}
    assert json.loads(props["pruneflow.input"])["layout"] == "NCHW" and json.loads(props["pruneflow.precision"]) == "int8"
    assert all(a.deployment is None for a in ptq_run.artifacts if a.kind == "checkpoint")


def test_pruneflow_inspect_shows_an_onnx_files_deployment_record(ptq_run):
    from typer.testing import CliRunner

    from pruneflow.cli import app

    result = CliRunner().invoke(app, ["inspect", str(ptq_run.run_dir / "export/onnx/model.fp16.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["deployment"]["precision"] == "fp16" and info["deployment"]["input"]["name"] == "input"
    assert info["totals"]["outputs"] == "logits" and info["totals"]["layout"] == "NCHW"


def test_the_preprocessing_scale_is_resolved_from_the_recipe_or_the_sources_dtype(tmp_path):
    from pruneflow.recipe.models import DataSpec

    for dtype, scale in (("uint8", 1 / 255), ("float32", 1.0)):
        np.savez(tmp_path / f"{dtype}.npz", images=np.zeros((2, 4, 4, 3), dtype=dtype), labels=np.zeros(2, dtype=np.int64))
        spec = DataSpec(format="npz", eval=str(tmp_path / f"{dtype}.npz"), input_column="images", label_column="labels")
        assert resolved_scale(spec) == scale
    assert resolved_scale(DataSpec(format="npz", eval=str(tmp_path / "uint8.npz"), scale=0.5)) == 0.5
    assert resolved_scale(DataSpec(format="csv", eval=str(tmp_path / "x.csv"))) is None  # only the whole file could tell


def test_the_cifar_recipes_preprocessing_is_recorded_as_the_data_section_says(shared_data):
    from pruneflow.deployment import preprocessing

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "resnet20-cifar10.yaml").recipe
    assert preprocessing(recipe.data) == {"scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                                          "steps": "x * scale, then (x - mean[c]) / std[c] per channel"}


# 6. constant folding --------------------------------------------------------------------------------------


COMPUTED = {"Shape", "Gather", "ConstantOfShape", "Concat", "Cast", "Reshape", "Transpose", "Identity", "Constant"}


def _producers(graph) -> dict[str, str]:
    return {out: node.op_type for node in graph.node for out in node.output}


def test_resnet20s_shortcut_pad_amounts_are_folded_and_outputs_identical(tmp_path):
    from pruneflow.zoo.resnet_cifar import resnet20

    torch.manual_seed(0)
    model = resnet20().eval()
    example = torch.randn(1, 3, 32, 32)
    export_onnx(model, example, tmp_path / "raw.onnx", fold=False)
    export_onnx(model, example, tmp_path / "folded.onnx")
    raw, folded = onnx.load(str(tmp_path / "raw.onnx")).graph, onnx.load(str(tmp_path / "folded.onnx")).graph
    raw_pads = [n for n in raw.node if n.op_type == "Pad"]
    assert len(raw_pads) == 2 and all(_producers(raw).get(n.input[1]) == "Cast" for n in raw_pads)  # what it was
    initializers = {t.name for t in folded.initializer}
    pads = [n for n in folded.node if n.op_type == "Pad"]
    assert len(pads) == 2 and all(n.input[1] in initializers for n in pads)
    assert not {n.op_type for n in folded.node} & COMPUTED
    assert len(folded.node) < len(raw.node) - 16
    assert [d.dim_param for d in folded.input[0].type.tensor_type.shape.dim[:1]] == ["batch"]
    assert {o.domain for o in onnx.load(str(tmp_path / "folded.onnx")).opset_import} == {""}  # standard ONNX ops only
    x = np.random.default_rng(0).standard_normal((5, 3, 32, 32)).astype(np.float32)
    got, ref = open_artifact(tmp_path / "folded.onnx")(x), open_artifact(tmp_path / "raw.onnx")(x)
    assert np.array_equal(got, ref)
    with torch.no_grad():
        assert np.abs(got - model(torch.from_numpy(x)).numpy()).max() < 1e-4


def test_resnet20s_int8_forms_are_folded_keep_their_qdq_and_pass_their_conventions(tmp_path):
    from pruneflow.calibrate.build import build_calibration_set
    from pruneflow.data import Split
    from pruneflow.export.onnx import export_int8_onnx, fold_constants
    from pruneflow.export.qdq import check_convention, convert
    from pruneflow.zoo.resnet_cifar import resnet20
    from pruneflow.qat.nncf_quant import quantize, strip_quantizers

    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32)
    calib = build_calibration_set(Split(x, torch.zeros(64, dtype=torch.long)), size=32, strategy="random", seed=0)
    stripped = strip_quantizers(quantize(resnet20().eval(), calib).eval(), x)
    export_onnx(stripped, x[:2], tmp_path / "raw.onnx", fold=False)
    batch = x[:8].numpy()
    for form in ("tensorrt", "cpu"):
        path = tmp_path / f"{form}.onnx"
        export_int8_onnx(stripped, x[:2], path, form=form)  # raises if the convention check fails
        graph = onnx.load(str(path)).graph
        assert check_convention(onnx.load(str(path)), form) == []
        initializers = {t.name for t in graph.initializer}
        assert all(n.input[1] in initializers for n in graph.node if n.op_type == "Pad")
        assert not {n.op_type for n in graph.node} & COMPUTED
        unfolded = onnx.load(str(tmp_path / "raw.onnx"))
        convert(unfolded, form)
        ops = [n.op_type for n in unfolded.graph.node]
        assert sorted(op for op in ops if "Quantize" in op) == sorted(n.op_type for n in graph.node if "Quantize" in n.op_type)
        onnx.save(unfolded, str(tmp_path / f"{form}.unfolded.onnx"))
        assert np.array_equal(open_artifact(path)(batch), open_artifact(tmp_path / f"{form}.unfolded.onnx")(batch))
        assert fold_constants(onnx.load(str(path))).graph.node[0].op_type == graph.node[0].op_type  # folding again: a no-op
