"""INT8 ONNX in the TensorRT and CPU forms: graph conventions, exact rewrites, runs in onnxruntime and OpenVINO."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from calibrate.build import build_calibration_set
from pruneflow.data import Split
from pruneflow.export.onnx import onnxruntime_runner
from pruneflow.export.qdq import check_convention, export_int8_onnx
from qat.nncf_quant import quantize, strip_quantizers


class Net(nn.Module):
    """Conv-BN-ReLU, a residual add, pooling and a linear head: the patterns the passes rewrite."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # BatchNorm that does something, including negative scales (the sign-flip case)
        for bn in (model.bn1, model.bn2):
            bn.weight.copy_(torch.randn(16))
            bn.bias.copy_(torch.randn(16) * 0.1)
            bn.running_mean.copy_(torch.randn(16) * 0.1)
            bn.running_var.copy_(torch.rand(16) + 0.5)
    model.eval()
    x = torch.randn(256, 3, 8, 8)
    calib = build_calibration_set(Split(x, torch.zeros(256, dtype=torch.long)), size=128, strategy="random", seed=0)
    q = quantize(copy.deepcopy(model), calib).eval()  # NNCF hooks the module it is given
    out = tmp_path_factory.mktemp("qdq")
    paths = {}
    for form in ("tensorrt", "cpu"):
        paths[form] = out / f"{form}.onnx"
        export_int8_onnx(strip_quantizers(q, x), x[:2], paths[form], form=form)
    with torch.no_grad():
        ref = q(x).numpy()
    return q, x, ref, paths, model


def _consts(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_tensorrt_form_follows_the_explicit_quantization_convention(quantized):
    _, _, _, paths, _ = quantized
    model = onnx.load(str(paths["tensorrt"]))
    consts = _consts(model)
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops  # folded into the int8 conv weights
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq
    for n in qdq:
        zp = consts[n.input[2]]
        assert zp.dtype == np.int8 and not zp.any(), n.name  # symmetric int8 everywhere
        if n.input[0] in consts:  # a weight: int8 values, per output channel (axis 0)
            assert consts[n.input[0]].dtype == np.int8
            assert np.abs(consts[n.input[0]]).max() <= 127
            axis = next(a.i for a in n.attribute if a.name == "axis")
            assert axis == 0 and consts[n.input[1]].shape == (consts[n.input[0]].shape[0],)
        else:
            assert consts[n.input[1]].size == 1  # activations per tensor
    producers = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.op_type in ("Conv", "Gemm"):
            assert producers[n.input[1]].op_type == "DequantizeLinear"
            src = producers[n.input[0]]
            while src.op_type in ("Flatten", "GlobalAveragePool"):
                src = producers[src.input[0]]
            assert src.op_type == "DequantizeLinear"
    assert not any(t.dtype == np.float32 and t.ndim == 4 for t in consts.values())  # no float conv weights left
    assert check_convention(model, "tensorrt") == []


def test_cpu_form_writes_the_same_grid_with_uint8_activations(quantized):
    _, _, _, paths, _ = quantized
    model = onnx.load(str(paths["cpu"]))
    consts = _consts(model)
    activation_zps = [consts[n.input[2]] for n in model.graph.node
                      if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[0] not in consts]
    assert activation_zps and all(z.dtype == np.uint8 and (z == 128).all() for z in activation_zps)
    ops = [n.op_type for n in model.graph.node]
    assert "Relu" not in ops and "Clip" in ops  # ReLU runs on the quantized tensor (see relu_in_integer_domain)
    assert check_convention(model, "cpu") == []


def test_both_forms_compute_what_the_quantized_torch_model_computes(quantized):
    _, x, ref, paths, model = quantized
    outs = {form: onnxruntime_runner(path)(x.numpy()) for form, path in paths.items()}
    with torch.no_grad():
        fp32 = model(x).numpy()
    scale = np.abs(ref).max()
    for out in outs.values():
        # The runtimes round at other points than torch's fake quantization; the results stay much closer
        # to the quantized model than the float model is.
        assert np.abs(out - ref).max() < 0.1 * scale
        assert np.abs(out - ref).mean() < 0.5 * np.abs(fp32 - ref).mean() + 1e-3 * scale
        assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.95
    # The same grid in two encodings: int8 (zero point 0) and uint8 (zero point 128).
    assert np.abs(outs["cpu"] - outs["tensorrt"]).max() < 0.05 * scale


def test_batchnorm_folding_through_the_weight_quantizer_is_exact(quantized):
    from pruneflow.export.qdq import PassReport, _Graph, fold_batchnorm, fold_weight_quantizers

    q, x, _, paths, _ = quantized
    from pruneflow.export.onnx import export_onnx

    raw = paths["cpu"].parent / "raw.onnx"
    export_onnx(strip_quantizers(q, x), x[:2], raw)
    before = onnx.load(str(raw))
    after = onnx.load(str(raw))
    graph, report = _Graph(after), PassReport()
    fold_weight_quantizers(graph, report)
    fold_batchnorm(graph, report)
    assert report.batchnorms_folded == 2 and not any(n.op_type == "BatchNormalization" for n in after.graph.node)
    folded = paths["cpu"].parent / "folded.onnx"
    onnx.save(after, str(folded))
    from onnxruntime import GraphOptimizationLevel

    a = _plain_runner(raw, GraphOptimizationLevel)(x.numpy())
    b = _plain_runner(folded, GraphOptimizationLevel)(x.numpy())
    # Only float rounding differs (a folded weight is computed once instead of per run): the activation
    # quantizers after it may flip a level on a tie, nothing more.
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.98


def _plain_runner(path: Path, levels):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = levels.ORT_DISABLE_ALL  # reference semantics, no integer kernels
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda v: session.run(None, {"input": v})[0]


def test_the_cpu_form_runs_in_openvino(quantized, tmp_path):
    import openvino as ov

    _, x, ref, paths, _ = quantized
    compiled = ov.Core().compile_model(ov.convert_model(str(paths["cpu"])), "CPU")
    out = compiled(x.numpy())[compiled.output(0)]
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_an_unsigned_activation_quantizer_has_no_exact_tensorrt_form(quantized, tmp_path):
    from pruneflow.errors import ExportError

    _, x, _, _, model = quantized
    calib = build_calibration_set(Split(x, torch.zeros(len(x), dtype=torch.long)), size=64, strategy="random", seed=0)
    q = quantize(copy.deepcopy(model), calib, activations="auto").eval()
    with pytest.raises(ExportError, match="TensorRT"):
        export_int8_onnx(strip_quantizers(q, x), x[:2], tmp_path / "trt.onnx", form="tensorrt")
    assert not (tmp_path / "trt.onnx").exists()
    export_int8_onnx(strip_quantizers(q, x), x[:2], tmp_path / "cpu.onnx", form="cpu")  # uint8 (zero point 0) is fine on a CPU
    assert check_convention(onnx.load(str(tmp_path / "cpu.onnx")), "cpu") == []
