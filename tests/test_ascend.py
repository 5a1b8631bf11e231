"""The ascend target: the static ONNX handed to ATC, the operator check, AIPP, the ATC commands and how
their results are read.

ATC cannot be installed here (CANN is not on PyPI), so its runs are played by a stand-in `atc` script on
PATH: it records the command line it was given and answers like ATC (a check_result.json, an E-code in
its log, a file named model.om). A stand-in is never a CANN toolkit, and the tests check that what it
writes is never reported as built.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from pruneflow.data import _preprocess
from pruneflow.errors import ExportError
from pruneflow.export.ascend import (
    AscendConfig,
    aipp_from_data,
    atc_commands,
    cann_version,
    first_errors,
    parse_check_result,
    precision_mode_for,
    write_bundle,
)
from pruneflow.export.ascend_onnx import prepare_onnx, to_opset
from pruneflow.export.ascend_ops import SUPPORTED_ONNX_OPS, unsupported_nodes
from pruneflow.recipe.models import DataSpec
from pruneflow.zoo.digits import digits_cnn
from pruneflow.zoo.resnet_cifar import resnet20, resnet56

from conftest import run_recipe_dict, tiny_recipe_dict

CIFAR_MEAN, CIFAR_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


# --- the ONNX for ATC ----------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [resnet20, resnet56])
def test_resnet_onnx_is_opset_11_static_and_on_the_operator_list(factory):
    torch.manual_seed(0)
    model = factory().eval()
    samples = torch.randn(8, 3, 32, 32)
    prepared = prepare_onnx(model, samples[:2], AscendConfig(), samples)
    proto = prepared.model
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [11]
    onnx.checker.check_model(proto, full_check=True)
    values = [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
    assert len(proto.graph.value_info) > 50  # shapes were inferred for the intermediate tensors too
    assert all(d.dim_value > 0 for v in values for d in v.type.tensor_type.shape.dim)
    assert prepared.input_shape == (1, 3, 32, 32)
    assert unsupported_nodes(proto) == [] and set(prepared.ops) <= SUPPORTED_ONNX_OPS
    # The shortcut's Pad amounts are folded into initializers: no shape arithmetic is left for ATC.
    assert not {"Identity", "Constant", "ConstantOfShape", "Shape", "Cast"} & set(prepared.ops)
    # The ONNX computes what torch computes, at the static batch.
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = np.concatenate([session.run(None, {"input": samples[i : i + 1].numpy()})[0] for i in range(8)])
    with torch.no_grad():
        ref = model(samples).numpy()  # untrained: logits up to ~1e4 here, so the difference is relative
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max() + 1e-5
    assert prepared.parity["parity_max_abs_diff_vs_export"] <= 1e-6 * np.abs(ref).max() + 1e-5


def test_static_batch_is_the_configured_one():
    prepared = prepare_onnx(digits_cnn().eval(), torch.randn(2, 1, 8, 8), AscendConfig(batch=4), torch.randn(10, 1, 8, 8))
    assert prepared.input_shape == (4, 1, 8, 8)
    assert [d.dim_value for d in prepared.model.graph.output[0].type.tensor_type.shape.dim] == [4, 10]


class _WithRnn(torch.nn.Module):
    """An image model with an RNN over its rows: ONNX `RNN`, which the CANN ONNX list lacks (LSTM and GRU are on it)."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.RNN(8, 4, batch_first=True)

    def forward(self, x):
        out, _ = self.rnn(x[:, 0])
        return out[:, -1]


def test_unsupported_operators_are_named_with_their_nodes_before_atc_is_called(tmp_path, monkeypatch):
    calls = _stand_in_atc(tmp_path, monkeypatch, "exit 0")
    with pytest.raises(ExportError) as err:
        prepare_onnx(_WithRnn().eval(), torch.randn(2, 1, 8, 8), AscendConfig(), torch.randn(4, 1, 8, 8))
    assert "RNN (" in err.value.message and "/rnn/RNN" in err.value.message  # op type and node name
    assert "extra_ops" in (err.value.hint or "")
    assert not calls.exists()  # ATC was never run
    # A newer CANN that supports it: accepted when listed, and the ONNX still runs like torch.
    prepared = prepare_onnx(_WithRnn().eval(), torch.randn(2, 1, 8, 8), AscendConfig(extra_ops=["RNN"]), torch.randn(4, 1, 8, 8))
    assert prepared.ops["RNN"] == 1


def test_unsupported_nodes_reads_subgraphs_and_foreign_domains():
    from onnx import helper

    inner = helper.make_graph([helper.make_node("Celu", ["x"], ["y"], name="ok"), helper.make_node("Mish", ["y"], ["z"], name="deep")],
                              "then", [], [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["out"], name="branch", then_branch=inner, else_branch=inner),
         helper.make_node("FusedConv", ["out"], ["o2"], name="contrib", domain="com.microsoft")],
        "g", [helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])], [])
    found = unsupported_nodes(helper.make_model(graph))
    assert ("Mish", "deep") in found and ("com.microsoft::FusedConv", "contrib") in found
    assert not any(op == "Celu" for op, _ in found)


def test_opset_conversion_upgrades_and_names_a_missing_down_adapter(tmp_path):
    model = digits_cnn().eval()
    x = torch.randn(1, 1, 8, 8)
    for opset in (11, 17):
        torch.onnx.export(model, (x,), str(tmp_path / f"m{opset}.onnx"), dynamo=False, opset_version=opset,
                          input_names=["input"], output_names=["logits"])
    up = to_opset(onnx.load(str(tmp_path / "m11.onnx")), 13)
    onnx.checker.check_model(up, full_check=True)
    run = lambda proto: ort.InferenceSession(proto.SerializeToString()).run(None, {"input": x.numpy()})[0]  # noqa: E731
    assert np.abs(run(up) - run(onnx.load(str(tmp_path / "m11.onnx")))).max() < 1e-6
    with pytest.raises(ExportError, match="from opset 17 to 11"):
        to_opset(onnx.load(str(tmp_path / "m17.onnx")), 11)


# --- config ----------------------------------------------------------------------------------------------


def test_soc_version_is_checked_against_the_documented_names():
    assert AscendConfig(soc_version="Ascend910B3").soc_version == "Ascend910B3"
    with pytest.raises(ValidationError, match="unknown Ascend SoC 'Ascend310P9' \\(did you mean 'Ascend310P3'\\?\\); known: Ascend310: "):
        AscendConfig(soc_version="Ascend310P9")


def test_precision_mode_follows_the_precision_and_refuses_a_contradiction():
    assert precision_mode_for(AscendConfig(), "fp32") == "must_keep_origin_dtype"
    assert precision_mode_for(AscendConfig(), "fp16") == "force_fp16"
    assert precision_mode_for(AscendConfig(precision_mode="allow_mix_precision"), "fp16") == "allow_mix_precision"
    with pytest.raises(ExportError, match="'force_fp16' does not write fp32"):
        precision_mode_for(AscendConfig(precision_mode="force_fp16"), "fp32")


# --- AIPP ------------------------------------------------------------------------------------------------


def _decode_aipp(text: str) -> dict:
    """aipp.cfg read back as ATC reads it: `key: value` pairs inside `aipp_op { }` (comments dropped)."""
    body = text[text.index("aipp_op {") + len("aipp_op {") : text.rindex("}")]
    pairs = [line.split("#")[0].split(":", 1) for line in body.splitlines() if ":" in line.split("#")[0]]
    return {k.strip(): v.strip() for k, v in pairs}


def _apply_aipp(cfg: dict, image: np.ndarray) -> np.ndarray:
    """AIPP's formula on a uint8 HWC (or HW) image: channel swap, then per channel
    (pixel - mean_chn - min_chn) * var_reci_chn; returns the float NCHW batch of one."""
    x = image.astype(np.float64)
    x = x[..., None] if x.ndim == 2 else x
    if cfg["rbuv_swap_switch"] == "true":
        x = x[..., ::-1]
    out = np.stack([(x[..., c] - float(cfg[f"mean_chn_{c}"]) - float(cfg[f"min_chn_{c}"])) * float(cfg[f"var_reci_chn_{c}"])
                    for c in range(x.shape[-1])])
    return out[None]


def _spec(**kw) -> DataSpec:
    return DataSpec(format="npz", path="images.npz", layout="nhwc", **kw)


@pytest.mark.parametrize(("fmt", "kw"), [
    ("RGB888_U8", {"mean": CIFAR_MEAN, "std": CIFAR_STD}),  # the ResNet recipes' normalisation
    ("RGB888_U8", {}),  # scale only
    ("RGB888_U8", {"scale": 1 / 127.5, "mean": [1.0, 1.0, 1.0], "std": [1.0, 1.0, 1.0]}),  # to [-1, 1]
    ("BGR888_U8", {"mean": CIFAR_MEAN, "std": CIFAR_STD}),
])
def test_aipp_reproduces_pruneflows_float_preprocessing_on_a_uint8_image(fmt, kw):
    spec = _spec(**kw)
    rgb = np.random.default_rng(0).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    expected = _preprocess(rgb[None], spec).numpy()  # what pruneflow feeds the model for this image
    aipp = aipp_from_data(spec, AscendConfig(aipp=True, input_format=fmt), (3, 32, 32))
    cfg = _decode_aipp(aipp.cfg())
    assert cfg["aipp_mode"] == "static" and cfg["input_format"] == "RGB888_U8"
    assert (cfg["src_image_size_w"], cfg["src_image_size_h"]) == ("32", "32")
    fed = rgb[..., ::-1] if fmt == "BGR888_U8" else rgb  # a BGR camera frame of the same scene
    got = _apply_aipp(cfg, fed)
    assert got.shape == expected.shape == (1, 3, 32, 32)
    assert np.abs(got - expected).max() < 1e-5
    if "mean" in kw and "scale" not in kw:  # the documented mapping: min = 255*mean, var_reci = 1/(255*std)
        assert np.allclose([float(cfg[f"min_chn_{c}"]) for c in range(3)], np.multiply(255, CIFAR_MEAN))
        assert np.allclose([float(cfg[f"var_reci_chn_{c}"]) for c in range(3)], 1 / (255 * np.asarray(CIFAR_STD)))


def test_aipp_grayscale_for_one_channel_models():
    spec = DataSpec(format="digits", mean=[0.3], std=[0.2])
    gray = np.random.default_rng(1).integers(0, 256, size=(8, 8), dtype=np.uint8)
    aipp = aipp_from_data(spec, AscendConfig(aipp=True, input_format="YUV400_U8"), (1, 8, 8))
    cfg = _decode_aipp(aipp.cfg())
    assert cfg["input_format"] == "YUV400_U8" and "mean_chn_1" not in cfg
    assert np.abs(_apply_aipp(cfg, gray) - _preprocess(gray[None], spec).numpy()).max() < 1e-5
    with pytest.raises(ExportError, match="gives 3 channel"):
        aipp_from_data(spec, AscendConfig(aipp=True), (1, 8, 8))


def test_aipp_yuv420sp_colour_conversion_matches_jpeg_ycbcr():
    """The CSC matrix written for YUV420SP_U8 turns YCbCr into the RGB PIL decodes (JPEG's conversion)."""
    from PIL import Image

    aipp = aipp_from_data(_spec(mean=CIFAR_MEAN, std=CIFAR_STD), AscendConfig(aipp=True, input_format="YUV420SP_U8"), (3, 32, 32))
    cfg = _decode_aipp(aipp.cfg())
    assert cfg["csc_switch"] == "true" and cfg["input_format"] == "YUV420SP_U8"
    matrix = np.array([[int(cfg[f"matrix_r{r}c{c}"]) for c in range(3)] for r in range(3)])
    bias = np.array([int(cfg[f"input_bias_{i}"]) for i in range(3)])
    ycbcr = np.random.default_rng(2).integers(16, 240, size=(16, 16, 3), dtype=np.uint8)
    ours = np.clip((ycbcr.astype(np.int64) - bias) @ matrix.T >> 8, 0, 255)
    pil = np.asarray(Image.fromarray(ycbcr, "YCbCr").convert("RGB")).astype(np.int64)
    assert np.abs(ours - pil).max() <= 2  # integer rounding of two fixed-point implementations


# --- ATC: commands, stand-in runs, parsing ----------------------------------------------------------------


def _stand_in_atc(tmp_path: Path, monkeypatch, behaviour: str, toolkit: bool = False) -> Path:
    """Put a stand-in `atc` first on PATH; it appends each command line to calls.txt, then runs `behaviour`
    (shell, in the bundle folder, with the arguments in "$@"). Returns the calls file.

    ``toolkit``: laid out like a CANN toolkit (compiler/bin/atc, compiler/version.info), for the paths that
    need an identified install; used only where the stand-in fails, so nothing it writes is taken as built."""
    bin_dir = tmp_path / ("ascend-toolkit/latest/compiler/bin" if toolkit else "standin-bin")
    bin_dir.mkdir(parents=True, exist_ok=True)
    if toolkit:
        (bin_dir.parent / "version.info").write_text("Version=8.0.0\n")
    calls = tmp_path / "calls.txt"
    script = bin_dir / "atc"
    script.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(calls))}\n{behaviour}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def _bundle(tmp_path: Path, cfg: AscendConfig, precision: str = "fp16") -> tuple[Path, dict]:
    prepared = prepare_onnx(resnet20().eval(), torch.randn(2, 3, 32, 32), cfg, torch.randn(4, 3, 32, 32))
    aipp = aipp_from_data(_spec(mean=CIFAR_MEAN, std=CIFAR_STD), cfg, (3, 32, 32)) if cfg.aipp else None
    folder = tmp_path / "bundle"
    folder.mkdir()
    return folder, write_bundle(folder, prepared, cfg, precision, precision_mode_for(cfg, precision), aipp, None)


def test_stand_in_atc_gets_the_precheck_and_the_conversion_command_lines(tmp_path, monkeypatch):
    calls = _stand_in_atc(tmp_path, monkeypatch, 'case "$*" in *--output=model*) echo fake > model.om;; esac')
    folder, status = _bundle(tmp_path, AscendConfig(aipp=True, soc_version="Ascend310B1"))
    precheck, convert = calls.read_text().splitlines()
    assert precheck == "--mode=3 --framework=5 --model=model.onnx --soc_version=Ascend310B1"
    assert convert == ("--framework=5 --model=model.onnx --output=model --soc_version=Ascend310B1 "
                       "--input_shape=input:1,3,32,32 --input_format=NCHW --precision_mode=force_fp16 --insert_op_conf=aipp.cfg")
    # The stand-in "succeeded" and wrote model.om: it is no CANN toolkit, so nothing is built and its file is gone.
    assert status["status"] == "prepared" and status["atc"]["cann_version"] is None
    assert not (folder / "model.om").exists()
    assert any("not part of a CANN toolkit" in n for n in status["notes"])
    assert json.loads((folder / "status.json").read_text())["status"] == "prepared"
    # convert.sh holds the same two commands, for the machine that has CANN.
    script = (folder / "convert.sh").read_text()
    assert shlex.join(atc_commands(AscendConfig(aipp=True, soc_version="Ascend310B1"), "force_fp16", (1, 3, 32, 32), True)[1]) in script
    assert os.access(folder / "convert.sh", os.X_OK)


def test_a_precheck_that_reports_an_unsupported_operator_fails_with_its_name(tmp_path, monkeypatch):
    report = {"model_name": "model", "op": [
        {"name": "/conv1/Conv", "type": "Conv", "result": "success"},
        {"name": "/layer1/Pad", "type": "Pad", "result": "failed",
         "reason": {"code": "EZ3002", "message": "Optype [Pad] of Ops kernel [AIcoreEngine] is unsupported"}}]}
    calls = _stand_in_atc(tmp_path, monkeypatch, f"echo {shlex.quote(json.dumps(report))} > check_result.json")
    folder, status = _bundle(tmp_path, AscendConfig())
    assert status["status"] == "failed"
    assert status["errors"][0].startswith("ATC pre-check: Pad (/layer1/Pad): ") and "EZ3002" in status["errors"][0]
    assert len(calls.read_text().splitlines()) == 1  # no conversion after a failed pre-check
    assert "failed" in (folder / "README.md").read_text()


def test_a_failed_conversion_quotes_atcs_first_error_lines(tmp_path, monkeypatch):
    log = textwrap.dedent("""\
        ATC start working now, please wait for a moment.
        ATC run failed, Please check the detail log, Try 'atc --help' for more information
        E19999: Inner Error!
                Op[/fc/Gemm] infershape failed[FUNC:InferShapeAndType][FILE:infershape_pass.cc]
        EZ3002: Optype [Gemm] of Ops kernel [AIcoreEngine] is unsupported.
    """)
    _stand_in_atc(tmp_path, monkeypatch, f'case "$*" in *--output=model*) printf %s {shlex.quote(log)}; exit 1;; esac')
    folder, status = _bundle(tmp_path, AscendConfig())
    assert status["status"] == "failed"
    assert status["errors"] == ["E19999: Inner Error!", "EZ3002: Optype [Gemm] of Ops kernel [AIcoreEngine] is unsupported."]
    assert (folder / "atc.log").read_text() == log


def test_log_and_check_result_parsing_on_their_own(tmp_path):
    assert first_errors("ok\n[ERROR] GE(123): something\nE10001: Value [x] for parameter [--soc_version] is invalid.\n") == [
        "[ERROR] GE(123): something", "E10001: Value [x] for parameter [--soc_version] is invalid."]
    assert parse_check_result(tmp_path / "absent.json") == []
    (tmp_path / "ok.json").write_text(json.dumps({"op": [{"name": "a", "type": "Relu", "result": "success"}]}))
    assert parse_check_result(tmp_path / "ok.json") == []


def test_cann_version_comes_from_the_toolkit_beside_atc(tmp_path):
    """How a real install is told from a stand-in: CANN puts version.info beside compiler/bin/atc."""
    atc = tmp_path / "ascend-toolkit" / "latest" / "compiler" / "bin" / "atc"
    atc.parent.mkdir(parents=True)
    atc.write_text("#!/bin/sh\n")
    assert cann_version(atc) is None
    (atc.parents[1] / "version.info").write_text("Version=8.0.0\nversion_dir=8.0.0\n")
    assert cann_version(atc) == "8.0.0"


# --- through the pipeline and the CLI ---------------------------------------------------------------------


def _ascend_recipe(target: dict, precisions=("fp32", "fp16"), **data) -> dict:
    return tiny_recipe_dict(
        data={"format": "digits", "max_train_samples": 300, "max_eval_samples": 100, **data},
        stages=[{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
                {"type": "calibrate", "size": 16, "amct": True},
                {"type": "export", "targets": ["onnx", target], "precisions": list(precisions), "latency": None}])


@pytest.mark.slow
def test_pipeline_prepares_one_bundle_per_precision_without_atc(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.defpath)
    assert shutil.which("atc") is None
    recipe = _ascend_recipe({"type": "ascend", "aipp": True, "input_format": "YUV400_U8"}, mean=[0.3], std=[0.2])
    _, result = run_recipe_dict(recipe, tmp_path)
    run_dir = result.run_dir
    arts = {a["path"]: a for a in json.loads((run_dir / "manifest.json").read_text())["artifacts"] if a["target"] == "ascend"}
    assert set(arts) == {"export/ascend/fp32/model.onnx", "export/ascend/fp16/model.onnx"}
    for precision, mode in (("fp32", "must_keep_origin_dtype"), ("fp16", "force_fp16")):
        art = arts[f"export/ascend/{precision}/model.onnx"]
        bundle = run_dir / "export" / "ascend" / precision
        assert art["status"] == "prepared" and "prepared, not built: CANN atc not on PATH" in art["notes"]
        assert art["parent"] == "export/onnx/model.fp32.onnx" and art["metrics"]["onnx_parity_max_abs_diff_vs_onnx_fp32"] < 1e-4
        assert {Path(p).name for p in art["files"]} == {"model.onnx", "aipp.cfg", "convert.sh", "README.md", "status.json"}
        status = json.loads((bundle / "status.json").read_text())
        assert status["precision_mode"] == mode and f"--precision_mode={mode}" in (bundle / "convert.sh").read_text()
        assert status["onnx"]["opset"] == 11 and status["onnx"]["input_shape"] == [1, 1, 8, 8]
        readme = (bundle / "README.md").read_text()
        assert "prepared, not built" in readme and "uint8 grayscale image (8x8 bytes)" in readme
        assert status["amct_calibration"] == "calibration/amct/calibration_list.txt" and status["amct_calibration"] in readme
        assert (run_dir / status["amct_calibration"]).is_file()
    assert not list((run_dir / "export" / "ascend").glob(".*"))  # no temporary folder left behind


def test_required_without_atc_exits_3_before_training(tmp_path, monkeypatch):
    from pruneflow.cli import app

    monkeypatch.setenv("PATH", os.defpath)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_ascend_recipe({"type": "ascend", "required": True})))
    result = CliRunner().invoke(app, ["optimize", str(recipe), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 3, result.output
    assert "atc is not on PATH" in result.output and "set_env.sh" in result.output
    assert not list((tmp_path / "runs").glob("*/stages/*"))  # nothing trained


def test_required_does_not_take_an_atc_outside_a_cann_toolkit(tmp_path, monkeypatch):
    from pruneflow.errors import TargetUnavailableError

    _stand_in_atc(tmp_path, monkeypatch, "exit 0")
    with pytest.raises(TargetUnavailableError, match="not part of a CANN toolkit"):
        run_recipe_dict(_ascend_recipe({"type": "ascend", "required": True}), tmp_path)
    assert not list((tmp_path / "runs").glob("*/stages/*"))


@pytest.mark.slow
def test_required_with_a_failing_atc_stops_the_export(tmp_path, monkeypatch):
    _stand_in_atc(tmp_path, monkeypatch, 'case "$*" in *--output=model*) echo "E19999: Inner Error!"; exit 1;; esac', toolkit=True)
    recipe = _ascend_recipe({"type": "ascend", "required": True}, precisions=("fp16",))
    with pytest.raises(ExportError, match="E19999: Inner Error!"):
        run_recipe_dict(recipe, tmp_path)
    status = json.loads((tmp_path / "runs" / "tiny" / "export" / "ascend" / "fp16" / "status.json").read_text())
    assert status["status"] == "failed" and status["atc"]["cann_version"] == "8.0.0"


@pytest.mark.slow
def test_a_failing_atc_on_a_target_not_required_fails_a_build_gate_and_keeps_the_bundle(tmp_path, monkeypatch):
    """The vendor tool ran and refused: status failed, ATC's own message in a failed `ascend.fp16.build` gate
    (exit 1, as any gate), the bundle kept for whoever debugs it; the other artifacts are measured as usual."""
    _stand_in_atc(tmp_path, monkeypatch, 'case "$*" in *--output=model*) echo "E19999: Inner Error!"; exit 1;; esac', toolkit=True)
    _, result = run_recipe_dict(_ascend_recipe({"type": "ascend"}, precisions=("fp16",)), tmp_path)
    assert result.exit_code == 1
    (gate,) = [g for g in result.gates if not g.passed]
    assert gate.name == "ascend.fp16.build" and "E19999: Inner Error!" in gate.message
    (artifact,) = [a for a in result.artifacts if a.target == "ascend"]
    assert artifact.status == "failed" and artifact.verify(result.run_dir)
    assert all(g.passed for g in result.gates if g.name != gate.name)


# --- several inputs: a tiny BERT --------------------------------------------------------------------


def _bert_recipe(tmp_path: Path, target: dict) -> dict:
    from test_tensorrt import BERT, text_data

    pytest.importorskip("transformers")
    return {"name": "ascend_bert", "seed": 0, "device": "cpu", "model": BERT, "data": text_data(tmp_path / "data"),
            "stages": [{"type": "evaluate"},
                       {"type": "export", "targets": ["onnx", target], "precisions": ["fp32"], "latency": None}]}


TEXT_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


@pytest.mark.slow
def test_a_tiny_bert_gets_a_static_opset_11_onnx_on_the_cann_list_and_one_atc_shape_per_input(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.defpath)
    _, result = run_recipe_dict(_bert_recipe(tmp_path, {"type": "ascend", "batch": 2}), tmp_path)
    assert result.exit_code == 0
    bundle = result.run_dir / "export" / "ascend" / "fp32"
    art = next(a for a in json.loads((result.run_dir / "manifest.json").read_text())["artifacts"] if a["target"] == "ascend")
    assert art["status"] == "prepared" and "prepared, not built: CANN atc not on PATH" in art["notes"]
    # the same model as the onnx target's dynamic fp32 ONNX, fed dev rows padded to data.max_length (32)
    assert art["metrics"]["onnx_parity_max_abs_diff_vs_onnx_fp32"] < 1e-4
    model = onnx.load(str(bundle / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 11
    assert [(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim], i.type.tensor_type.elem_type)
            for i in model.graph.input] == [(n, [2, 32], onnx.TensorProto.INT64) for n in TEXT_INPUTS]
    assert unsupported_nodes(model) == []  # LayerNorm decomposed (ReduceMean, Pow, Sqrt), GELU as Erf, Softmax: all listed
    ops = {n.op_type for n in model.graph.node}
    assert {"Gather", "MatMul", "Softmax", "Erf", "ReduceMean"} <= ops
    status = json.loads((bundle / "status.json").read_text())
    assert status["onnx"]["inputs"] == {n: {"shape": [2, 32], "dtype": "int64"} for n in TEXT_INPUTS}
    convert = status["commands"]["convert"]
    assert "'--input_shape=input_ids:2,32;attention_mask:2,32;token_type_ids:2,32'" in convert
    assert "--input_format=ND" in convert and "insert_op_conf" not in convert and status["aipp"] is None
    assert convert in (bundle / "convert.sh").read_text() and not (bundle / "aipp.cfg").exists()
    readme = (bundle / "README.md").read_text()
    assert "- `attention_mask`: int64 [2, 32]" in readme and "static length 32 (`data.max_length`)" in readme
    # the ONNX handed to ATC runs in onnxruntime on a real, padded batch
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.zeros((2, 32), dtype=np.int64)
    ids[:, :5] = [[2, 7, 9, 12, 3], [2, 20, 8, 3, 0]]
    out = session.run(None, {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)})[0]
    assert out.shape == (2, 2) and np.isfinite(out).all()


def test_a_stand_in_atc_gets_every_inputs_shape_on_its_command_line(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from pruneflow.zoo.hf import bert_classifier

    calls = _stand_in_atc(tmp_path, monkeypatch, "")
    model = bert_classifier(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=32, max_positions=32, seed=0)
    example = {"input_ids": torch.randint(1, 32, (3, 10)), "attention_mask": torch.ones(3, 10, dtype=torch.long)}
    cfg = AscendConfig()
    prepared = prepare_onnx(model.eval(), example, cfg, example, sequence=16)
    assert prepared.input_shapes == {"input_ids": (1, 16), "attention_mask": (1, 16)}  # no token_type_ids in the example
    folder = tmp_path / "bundle"
    folder.mkdir()
    write_bundle(folder, prepared, cfg, "fp16", "force_fp16", None, None)
    assert calls.read_text().splitlines()[1] == ("--framework=5 --model=model.onnx --output=model --soc_version=Ascend310P3 "
                                                 "--input_shape=input_ids:1,16;attention_mask:1,16 --input_format=ND "
                                                 "--precision_mode=force_fp16")


@pytest.mark.slow
def test_aipp_on_a_text_model_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.defpath)
    _, result = run_recipe_dict(_bert_recipe(tmp_path, {"type": "ascend", "aipp": True}), tmp_path)
    art = next(a for a in json.loads((result.run_dir / "manifest.json").read_text())["artifacts"] if a["target"] == "ascend")
    assert art["status"] == "failed"
    text = json.dumps(art)
    assert "`aipp: true` is for image models" in text and "input_ids" in text and "aipp: false" in text


# --- INT8: AMCT, then ATC ---------------------------------------------------------------------------------


def _amct_set(tmp_path: Path, count: int) -> tuple[Path, np.ndarray]:
    """The calibrate stage's AMCT files (``write_amct``) for ``count`` CIFAR-shaped samples."""
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.calibrate.consumers import write_amct

    x = torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return write_amct(CalibrationSet(x), tmp_path / "amct"), x.numpy()


def _int8_bundle(tmp_path: Path, cfg: AscendConfig, count: int = 10) -> tuple[Path, dict, np.ndarray]:
    listing, x = _amct_set(tmp_path, count)
    prepared = prepare_onnx(resnet20().eval(), torch.randn(2, 3, 32, 32), cfg, torch.randn(4, 3, 32, 32))
    folder = tmp_path / "bundle"
    folder.mkdir()
    status = write_bundle(folder, prepared, cfg, "int8", precision_mode_for(cfg, "int8"), None,
                          "calibration/amct/calibration_list.txt", amct_list=listing)
    return folder, status, x


def test_the_int8_bundle_holds_the_calibration_set_in_batches_of_the_om_and_amcts_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.defpath)
    folder, status, x = _int8_bundle(tmp_path, AscendConfig(batch=4), count=10)
    quant = status["amct"]
    assert status["status"] == "prepared" and "prepared, not built: Ascend AMCT (amct_onnx) not on PATH" in status["notes"]
    assert quant["batches"] == 2 and quant["batch"] == 4 and quant["samples"] == 8  # 10 samples: two whole batches
    files = sorted((folder / "calibration" / "input").iterdir())
    assert [f.name for f in files] == ["00000.bin", "00001.bin"]
    for i, f in enumerate(files):  # raw little-endian float32, the set's samples in order
        np.testing.assert_array_equal(np.fromfile(f, dtype="<f4").reshape(4, 3, 32, 32), x[4 * i : 4 * i + 4])
    assert quant["argv"] == ["amct_onnx", "calibration", "--model=model.onnx", "--save_path=quant/model",
                             "--input_shape=input:4,3,32,32", "--data_dir=calibration/input/", "--data_types=float32",
                             "--batch_num=2"]
    assert "read back and run through model.onnx in onnxruntime" in quant["checked"]
    script = (folder / "convert.sh").read_text().splitlines()
    amct_at = next(i for i, line in enumerate(script) if line.startswith("amct_onnx"))
    atc_at = [i for i, line in enumerate(script) if line.startswith("atc ")]
    assert amct_at < atc_at[0] and all("--model=quant/model_deploy_model.onnx" in script[i] for i in atc_at)
    assert status["precision_mode"] == "force_fp16"
    readme = (folder / "README.md").read_text()
    assert "## INT8 (AMCT, then ATC)" in readme and "2 batches of 4" in readme


def test_stand_in_amct_and_atc_run_in_order_on_the_files_the_bundle_wrote(tmp_path, monkeypatch):
    """A stand-in amct_onnx that does what AMCT's CLI does with its files (reads each batch of the declared shape
    and dtype from --data_dir, --batch_num of them, writes SAVE_PATH_deploy_model.onnx), then the stand-in atc."""
    calls = _stand_in_atc(tmp_path, monkeypatch, 'case "$*" in *--output=model*) echo fake > model.om;; esac')
    amct = calls.parent / "standin-bin" / "amct_onnx"
    amct.write_text(textwrap.dedent(f"""\
        #!{shutil.which("python3") or "/usr/bin/python3"}
        import os, sys
        args = dict(a[2:].split("=", 1) for a in sys.argv[2:])
        shape = [int(v) for v in args["input_shape"].split(":")[1].split(",")]
        files = sorted(os.listdir(args["data_dir"]))[: int(args["batch_num"])]
        assert len(files) == int(args["batch_num"]), files
        size = 4 * shape[0] * shape[1] * shape[2] * shape[3]
        assert all(os.path.getsize(os.path.join(args["data_dir"], f)) == size for f in files)
        os.makedirs(os.path.dirname(args["save_path"]), exist_ok=True)
        open(args["save_path"] + "_deploy_model.onnx", "wb").write(open(args["model"], "rb").read())
        open({str(calls)!r}, "a").write("amct " + " ".join(sys.argv[1:]) + "\\n")
    """))
    amct.chmod(amct.stat().st_mode | stat.S_IEXEC)
    folder, status, _ = _int8_bundle(tmp_path, AscendConfig(batch=2), count=6)
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("amct calibration --model=model.onnx") and "--batch_num=3" in lines[0]
    assert lines[1].startswith("--mode=3") and "--model=quant/model_deploy_model.onnx" in lines[2]
    assert (folder / "quant" / "model_deploy_model.onnx").is_file() and (folder / "amct.log").is_file()
    # a stand-in atc is no CANN toolkit: prepared, never built
    assert status["status"] == "prepared" and not (folder / "model.om").exists()


def test_a_failing_amct_fails_the_bundle_with_its_errors_and_runs_no_atc(tmp_path, monkeypatch):
    calls = _stand_in_atc(tmp_path, monkeypatch, "")
    amct = calls.parent / "standin-bin" / "amct_onnx"
    amct.write_text('#!/bin/sh\necho "[ERROR] AMCT(12345): quantize failed: unsupported layer"\nexit 1\n')
    amct.chmod(amct.stat().st_mode | stat.S_IEXEC)
    folder, status, _ = _int8_bundle(tmp_path, AscendConfig(), count=3)
    assert status["status"] == "failed" and "unsupported layer" in status["errors"][0]
    assert not calls.exists()  # ATC never ran


def test_too_few_calibration_samples_for_one_batch_is_an_export_error(tmp_path):
    with pytest.raises(ExportError, match="fewer than the OM's static batch 8"):
        _int8_bundle(tmp_path, AscendConfig(batch=8), count=5)


def test_ascend_int8_needs_amct_files_and_no_quantizing_stage(write_recipe):
    from pruneflow.errors import RecipeError
    from pruneflow.recipe import load_recipe

    recipe = _ascend_recipe("ascend", precisions=("fp32", "int8"))
    recipe["stages"][2]["targets"] = ["ascend"]  # only the self-quantizing target writes int8: no ptq stage needed
    assert load_recipe(write_recipe(recipe)).recipe.stages[2].precisions == ["fp32", "int8"]
    recipe["stages"][1]["amct"] = False
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    (issue,) = err.value.issues
    assert issue.path == "stages.2.targets.0.type" and "amct: true" in issue.hint
    recipe["stages"][1]["amct"] = True
    recipe["stages"][2]["targets"] = ["onnx", "ascend"]  # onnx's int8 comes from the quantized model: it needs ptq
    with pytest.raises(RecipeError, match="int8 needs a quantized model"):
        load_recipe(write_recipe(recipe))


@pytest.mark.slow
def test_pipeline_prepares_an_int8_bundle_from_the_runs_calibration_set(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.defpath)
    recipe = _ascend_recipe("ascend", precisions=("fp32", "int8"))
    recipe["stages"][2]["targets"] = ["ascend"]
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0
    art = next(a for a in json.loads((result.run_dir / "manifest.json").read_text())["artifacts"]
               if a.get("target") == "ascend" and a["precision"] == "int8")
    assert art["status"] == "prepared" and "prepared, not built: Ascend AMCT (amct_onnx) not on PATH" in art["notes"]
    status = json.loads((result.run_dir / "export" / "ascend" / "int8" / "status.json").read_text())
    assert status["amct"]["samples"] == 16 and status["amct"]["batches"] == 16  # the 16 calibration samples, batch 1
    assert any(p.endswith("calibration/input/00015.bin") for p in art["files"])
