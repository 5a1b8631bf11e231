"""INT8 ONNX in the TensorRT and CPU forms: graph conventions, exact rewrites, runs in onnxruntime and OpenVINO."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from pruneflow.calibrate.build import build_calibration_set
from pruneflow.data import Split
from pruneflow.export.onnx import export_int8_onnx, export_raw_qdq
from pruneflow.runtime import open_artifact
from pruneflow.export.qdq import check_convention, u8s8_overflow_risks
from pruneflow.stages.measure import PARITY_DEFAULTS, parity_metrics
from pruneflow.qat.nncf_quant import quantize, strip_quantizers
from pruneflow.qat.settings import NncfSettings


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
    # The residual Add: conv2 (BatchNorm folded) feeds it in float, so TensorRT fuses Conv+Add+ReLU; the skip is quantized.
    (add,) = [n for n in model.graph.node if n.op_type == "Add"]
    assert sorted(producers[i].op_type for i in add.input) == ["Conv", "DequantizeLinear"]
    assert check_convention(model, "tensorrt") == []


def test_cpu_form_writes_the_same_grid_with_uint8_activations(quantized):
    _, _, _, paths, _ = quantized
    model = onnx.load(str(paths["cpu"]))
    consts = _consts(model)
    producers = {o: n for n in model.graph.node for o in n.output}
    activation_dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in consts]
    zps = {n.name: consts[n.input[2]] for n in activation_dqs}
    assert zps and all(z.dtype == np.uint8 and z.size == 1 and int(z) in (0, 128) for z in zps.values())
    # Non-negative tensors (after each ReLU, and the pooling of one) are uint8 zero point 0 clipped to int8's 127;
    # the network input and the residual branch before the Add stay zero point 128.
    unsigned = [n for n in activation_dqs if int(zps[n.name]) == 0]
    # the third: the pooled features again after the Flatten (``requantize_moves``), so the classifier runs in int8
    assert len(unsigned) == 4 and len(activation_dqs) - len(unsigned) == 2
    assert [n.name for n in unsigned if n.name.endswith("_requant_dq")] == ["/Flatten_requant_dq"]
    for dq in unsigned:
        clip = producers[dq.input[0]]
        assert clip.op_type == "Clip" and producers[clip.input[0]].op_type == "QuantizeLinear"
        assert (int(consts[clip.input[1]]), int(consts[clip.input[2]])) == (0, 127)
    ops = [n.op_type for n in model.graph.node]
    assert "Relu" not in ops  # the uint8 zero point 0 quantizer saturates negatives itself
    assert check_convention(model, "cpu") == []
    assert u8s8_overflow_risks(model) == []  # no int16 pair sum can saturate on a CPU without VNNI


def test_the_overflow_check_finds_what_a_cpu_without_vnni_saturates():
    from onnx import TensorProto, helper

    def graph(zp: int, high: int | None, weights: np.ndarray):
        inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                 numpy_helper.from_array(np.array(zp, np.uint8), "z"),
                 numpy_helper.from_array(weights.astype(np.int8), "w"),
                 numpy_helper.from_array(np.full(weights.shape[0], 0.01, np.float32), "ws"),
                 numpy_helper.from_array(np.zeros(weights.shape[0], np.int8), "wz")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])]
        src = "q"
        if high is not None:
            inits += [numpy_helper.from_array(np.array(0, np.uint8), "lo"), numpy_helper.from_array(np.array(high, np.uint8), "hi")]
            nodes.append(helper.make_node("Clip", ["q", "lo", "hi"], ["qc"]))
            src = "qc"
        nodes += [helper.make_node("DequantizeLinear", [src, "s", "z"], ["a"]),
                  helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
                  helper.make_node("Conv", ["a", "wf"], ["y"], name="conv")]
        return helper.make_model(helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits))

    big = np.full((1, 2, 3, 3), 127)  # two input channels: every pair of weights sums to 254
    assert u8s8_overflow_risks(graph(128, None, big))  # raw activations up to 255: 255 * 254 > 32767
    assert u8s8_overflow_risks(graph(0, None, -big))
    assert u8s8_overflow_risks(graph(0, 127, big)) == []  # 127 * 254 = 32258
    assert u8s8_overflow_risks(graph(128, None, big // 2)) == []  # NNCF's 7-bit first layer: 255 * 126
    opposite = np.array([[[[127]], [[-127]]]])  # a pair of opposite signs stays within 255 * 127
    assert u8s8_overflow_risks(graph(128, None, opposite)) == []


def test_weights_reading_a_signed_input_are_regridded_until_no_pair_can_saturate():
    """A Linear exported as MatMul(x, Transpose(DQ(W))) on a zero-point-128 input: the channels with a weight
    pair (inputs 2p, 2p+1) over 128 get a coarser grid (same function), the others keep theirs, and
    onnxruntime's fused integer kernels then agree with its unfused float path on any x86 CPU (without VNNI,
    before the fit, they were off by 13 in 56 on an AVX2 EPYC)."""
    from onnx import TensorProto, helper

    from pruneflow.export.qdq.encodings import fit_u8s8_pairs
    from pruneflow.export.qdq.graph import PassReport, _Graph

    gen = np.random.default_rng(0)
    w = gen.integers(-127, 128, size=(4, 64)).astype(np.int8)
    w[0] = np.where(np.arange(64) % 2 == 0, 127, 0)  # channel 0: 127s, but never two in one pair (2p, 2p+1)
    scales = np.array([0.01, 0.02, 0.005, 0.01], np.float32)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s"), numpy_helper.from_array(np.array(128, np.uint8), "z"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(scales, "ws"), numpy_helper.from_array(np.zeros(4, np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["a"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
             helper.make_node("Transpose", ["wf"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["a", "wt"], ["y"], name="linear")]
    model = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
                              opset_imports=[helper.make_opsetid("", 13)])
    assert u8s8_overflow_risks(model)
    graph, report = _Graph(model), PassReport()
    fit_u8s8_pairs(graph, report)
    graph.prune_initializers()
    assert u8s8_overflow_risks(model) == [] and report.u8s8_channels_fitted == 3 and report.notes
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "wf")
    new_w, new_s = (numpy_helper.to_array(graph.inits[name]) for name in dq.input[:2])
    assert (new_w[0] == w[0]).all() and new_s[0] == scales[0]  # channel 0 keeps its grid
    before, after = w * scales[:, None], new_w * new_s[:, None]
    assert np.abs(after - before).max() <= new_s.max() / 2 + 1e-6  # the same weights, on a coarser grid
    x = gen.uniform(-2.5, 2.5, size=(256, 64)).astype(np.float32)  # raw activations across the whole 0..255
    fused = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(fused - plain).max() < 1e-3 * np.abs(plain).max()


def test_a_smooth_quant_mul_between_a_linear_and_its_quantizer_folds_into_the_weights_and_bias(tmp_path):
    """NNCF's SmoothQuant scale for the next layer sits between ``Gemm -> Relu`` and the int8 quantizer, which kept
    onnxruntime from fusing the Gemm into an integer QGemm (a DeepFM's whole MLP ran in float). Folded into the
    Gemm's per-channel weight scales and bias, the graph computes the same and onnxruntime runs QGemm."""
    from onnx import TensorProto, helper

    from pruneflow.export.onnx import ort_optimized_ops
    from pruneflow.export.qdq import convert

    gen = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(gen.normal(0, 0.05, (16, 32)).astype(np.float32), "w"),
             numpy_helper.from_array(np.full(16, 0.002, np.float32), "ws"), numpy_helper.from_array(np.zeros(16, np.int8), "wz"),
             numpy_helper.from_array(gen.normal(0, 0.1, 16).astype(np.float32), "b"),
             numpy_helper.from_array(gen.uniform(0.5, 2.0, 16).astype(np.float32), "smooth"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s2")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["a"]),
             helper.make_node("QuantizeLinear", ["w", "ws", "wz"], ["wq"], axis=0),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wf"], axis=0),
             helper.make_node("Gemm", ["a", "wf", "b"], ["g"], transB=1, name="linear"), helper.make_node("Relu", ["g"], ["r"]),
             helper.make_node("Mul", ["r", "smooth"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "s2", "z"], ["q2"]), helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 32])],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
                              opset_imports=[helper.make_opsetid("", 13)])
    x = gen.normal(size=(128, 32)).astype(np.float32)
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    before = ort.InferenceSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    report = convert(model, "cpu")
    assert report.smooth_quant_folded == 1 and not any(n.op_type == "Mul" for n in model.graph.node)
    onnx.save(model, tmp_path / "m.onnx")
    assert "QGemm" in ort_optimized_ops(tmp_path / "m.onnx")
    after = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(after - before).max() <= 0.05 * 0.5 + 1e-6  # at most half a step of the output grid (rounding ties)
    assert np.mean(after == before) > 0.99


def test_both_forms_compute_what_the_quantized_torch_model_computes(quantized):
    _, x, ref, paths, model = quantized
    outs = {form: open_artifact(path)(x.numpy()) for form, path in paths.items()}
    with torch.no_grad():
        fp32 = model(x).numpy()
    scale = np.abs(ref).max()
    for out in outs.values():
        assert np.abs(out - ref).max() < 0.1 * scale
        assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.95
        assert parity_metrics(ref, out)["cosine"] >= PARITY_DEFAULTS["int8"].min_cosine
    # The cpu form holds every quantizer of the torch model: the runtime rounds at other points than torch's
    # fake quantization, and the result stays much closer to the quantized model than the float model is.
    assert np.abs(outs["cpu"] - ref).mean() < 0.5 * np.abs(fp32 - ref).mean() + 1e-3 * scale
    # The tensorrt form leaves the conv branch of the residual Add in float (TensorRT's placement): one
    # quantizer fewer than the torch model, so it lies between the quantized and the float model.
    trt = np.abs(outs["tensorrt"] - ref).mean()
    assert trt < 1.5 * np.abs(fp32 - ref).mean() + 1e-3 * scale
    assert np.abs(outs["cpu"] - outs["tensorrt"]).max() < 0.05 * scale


def test_batchnorm_folding_through_the_weight_quantizer_is_exact(quantized):
    from pruneflow.export.qdq.folding import fold_batchnorm, fold_weight_quantizers
    from pruneflow.export.qdq.graph import PassReport, _Graph

    q, x, _, paths, _ = quantized
    from pruneflow.export.onnx import export_onnx

    raw = paths["cpu"].parent / "raw.onnx"
    export_onnx(strip_quantizers(q, x), x[:2], raw)
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

    _, x, ref, paths, model = quantized
    compiled = ov.Core().compile_model(ov.convert_model(str(paths["cpu"])), "CPU")
    out = compiled(x.numpy())[compiled.output(0)]
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.95
    with torch.no_grad():
        fp32 = model(x).numpy()
    # OpenVINO's int8 kernels add u8 x s8 pairs in int16 on CPUs without VNNI too (see the module docstring).
    assert np.abs(out - ref).mean() < 0.5 * np.abs(fp32 - ref).mean() + 1e-3 * np.abs(ref).max()


def test_an_unsigned_activation_quantizer_has_no_exact_tensorrt_form(quantized, tmp_path):
    from pruneflow.errors import ExportError

    _, x, _, _, model = quantized
    calib = build_calibration_set(Split(x, torch.zeros(len(x), dtype=torch.long)), size=64, strategy="random", seed=0)
    q = quantize(copy.deepcopy(model), calib, NncfSettings(activations="auto")).eval()
    with pytest.raises(ExportError, match="TensorRT"):
        export_int8_onnx(strip_quantizers(q, x), x[:2], tmp_path / "trt.onnx", form="tensorrt")
    assert not (tmp_path / "trt.onnx").exists()
    export_int8_onnx(strip_quantizers(q, x), x[:2], tmp_path / "cpu.onnx", form="cpu")  # uint8 (zero point 0) is fine on a CPU
    assert check_convention(onnx.load(str(tmp_path / "cpu.onnx")), "cpu") == []


# --------------------------------------------------------------------------- residual Adds, TensorRT placement


@pytest.fixture(scope="module")
def resnet20_int8(tmp_path_factory):
    """The zoo's ResNet-20 (option-A shortcuts: 7 identity skips, 2 sliced and zero-padded ones) quantized by NNCF."""
    from pruneflow.export.onnx import export_onnx
    from pruneflow.zoo import resnet20

    torch.manual_seed(0)
    model = resnet20().eval()
    x = torch.randn(96, 3, 32, 32)
    calib = build_calibration_set(Split(x, torch.zeros(len(x), dtype=torch.long)), size=32, strategy="random", seed=0)
    q = quantize(copy.deepcopy(model), calib).eval()
    out = tmp_path_factory.mktemp("resnet20")
    stripped = strip_quantizers(q, x)
    export_onnx(stripped, x[:2], out / "raw.onnx")
    export_int8_onnx(stripped, x[:2], out / "trt.onnx", form="tensorrt")
    export_int8_onnx(stripped, x[:2], out / "cpu.onnx", form="cpu")
    onnx.save(export_raw_qdq(stripped, x[:2], out), str(out / "qdq.raw.onnx"))
    with torch.no_grad():
        ref, fp32 = q(x).numpy(), model(x).numpy()
    return x, ref, fp32, out


def _nncf_placement(raw: Path):
    """The tensorrt form as it was before the residual pass: every pass of ``convert`` but that one."""
    from pruneflow.export.qdq.encodings import rewrite_activations
    from pruneflow.export.qdq.folding import fold_batchnorm, fold_weight_quantizers
    from pruneflow.export.qdq.graph import PassReport, _Graph, _remove_identities

    model = onnx.load(str(raw))
    graph, report = _Graph(model), PassReport()
    fold_weight_quantizers(graph, report)
    fold_batchnorm(graph, report)
    rewrite_activations(graph, "tensorrt", report)
    _remove_identities(graph)
    return model


@pytest.mark.slow  # ResNet-20 through NNCF: about 15 s on two cores
def test_resnet20_tensorrt_form_quantizes_the_skip_and_leaves_the_conv_branch_float(resnet20_int8):
    from pruneflow.export.qdq.graph import _Graph
    from pruneflow.export.qdq.placement import residual_adds

    _, _, _, out = resnet20_int8
    model = onnx.load(str(out / "trt.onnx"))
    graph = _Graph(model)
    adds = [n for n in model.graph.node if n.op_type == "Add"]
    residual = residual_adds(graph)
    assert len(adds) == 9 and len(residual) == 9  # one per BasicBlock
    producers = graph.producer
    consts = _consts(model)
    for add, branch in residual:
        conv = producers[add.input[branch]]
        assert conv.op_type == "Conv" and conv.name.endswith("conv2/Conv")  # no Q/DQ between conv2 (+BN) and the Add
        skip = producers[add.input[1 - branch]]
        assert skip.op_type == "DequantizeLinear" and consts[skip.input[2]].dtype == np.int8
        before = producers[skip.input[0]]
        if before.op_type == "QuantizeLinear" and producers[before.input[0]].op_type == "Pad":
            # a sliced, zero-padded shortcut: re-quantized with the scale of the quantizer it came through (exact)
            node = producers[before.input[0]]
            while node.op_type in ("Pad", "Slice"):
                node = producers[node.input[0]]
            assert node.op_type == "DequantizeLinear" and skip.input[1] == node.input[1]
    assert sum(producers[producers[a.input[1 - b]].input[0]].op_type == "QuantizeLinear"
               and producers[producers[producers[a.input[1 - b]].input[0]].input[0]].op_type == "Pad" for a, b in residual) == 2
    assert check_convention(model, "tensorrt") == []


@pytest.mark.slow  # ResNet-20 through NNCF: about 15 s on two cores
def test_the_convention_check_rejects_nncfs_placement_on_residual_adds(resnet20_int8):
    _, _, _, out = resnet20_int8
    problems = check_convention(_nncf_placement(out / "raw.onnx"), "tensorrt")
    branch = [p for p in problems if "feeding a residual Add" in p]
    skips = [p for p in problems if "skip (residual) input is not quantized" in p]
    assert len(branch) == 9 and all("conv2/Conv" in p for p in branch)
    assert len(skips) == 2  # the two zero-padded shortcuts reach the Add through Slice/Pad, not a DQ
    assert len(problems) == 11


@pytest.mark.slow  # ResNet-20 through NNCF: about 15 s on two cores
def test_resnet20_tensorrt_form_keeps_int8_parity_in_onnxruntime(resnet20_int8):
    x, ref, fp32, out = resnet20_int8
    got = open_artifact(out / "trt.onnx")(x.numpy())
    parity = parity_metrics(ref, got)
    limits = PARITY_DEFAULTS["int8"]
    assert parity["cosine"] >= limits.min_cosine and parity["top1_agreement"] >= 0.95, parity  # classification's int8 limit
    # nine quantizers fewer than the torch model (the conv branches): no farther from it than the float model is
    assert np.abs(got - ref).mean() < 1.5 * np.abs(fp32 - ref).mean()


class ProjectionNet(nn.Module):
    """A residual block whose shortcut is a 1x1 convolution (as after pruning rewrites ResNet's option-A shortcut)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.shortcut = nn.Conv2d(8, 16, 1, bias=False)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        y = torch.relu(y + self.shortcut(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def test_with_a_convolution_on_both_inputs_the_longer_branch_stays_float(tmp_path):
    torch.manual_seed(0)
    model = ProjectionNet().eval()
    x = torch.randn(64, 3, 8, 8)
    calib = build_calibration_set(Split(x, torch.zeros(64, dtype=torch.long)), size=32, strategy="random", seed=0)
    q = quantize(copy.deepcopy(model), calib).eval()
    export_int8_onnx(strip_quantizers(q, x), x[:2], tmp_path / "trt.onnx", form="tensorrt")
    onnx_model = onnx.load(str(tmp_path / "trt.onnx"))
    producers = {o: n for n in onnx_model.graph.node for o in n.output}
    (add,) = [n for n in onnx_model.graph.node if n.op_type == "Add"]
    by_op = {producers[i].op_type: producers[i] for i in add.input}
    assert set(by_op) == {"Conv", "DequantizeLinear"}
    assert "conv2" in by_op["Conv"].name  # the main branch feeds the Add in float: TensorRT fuses conv2+Add+ReLU
    shortcut = producers[producers[by_op["DequantizeLinear"].input[0]].input[0]]
    assert shortcut.op_type == "Conv" and "shortcut" in shortcut.name  # the projection's output is the quantized skip
    assert check_convention(onnx_model, "tensorrt") == []
    with torch.no_grad():
        ref = q(x).numpy()
    parity = parity_metrics(ref, open_artifact(tmp_path / "trt.onnx")(x.numpy()))
    assert parity["cosine"] >= PARITY_DEFAULTS["int8"].min_cosine and parity["top1_agreement"] >= 0.95, parity


@pytest.mark.slow  # ResNet-20 through NNCF: about 15 s on two cores
def test_resnet20_cpu_form_keeps_a_quantizer_after_every_conv_so_onnxruntime_runs_them_all_in_int8(resnet20_int8, tmp_path):
    """TensorRT's residual placement is not the CPU's: onnxruntime fuses DQ -> Conv -> Q into an integer QLinearConv
    only with the Q after the Conv (measured: ResNet-20 with the conv branches left float ran 2.9x slower)."""
    import onnxruntime as ort

    _, _, _, out = resnet20_int8
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(out / "cpu.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert optimized.count("QLinearConv") == 19 and "Conv" not in optimized
    assert check_convention(onnx.load(str(out / "cpu.onnx")), "cpu") == []
    # the two zero-padded shortcuts' Adds and the classifier run in int8 too (Q/DQ after Pad and Flatten), as in
    # onnxruntime's own quantize_static output: no float Add or Gemm left between a DQ and a Q
    assert optimized.count("QLinearAdd") == 9 and "Add" not in optimized and "Gemm" not in optimized
    assert "QGemm" in optimized or "MatMulIntegerToFloat" in optimized


@pytest.mark.slow  # ResNet-20 through NNCF: about 15 s on two cores
def test_requantizing_moves_and_the_gemm_bias_changes_no_prediction(resnet20_int8, tmp_path, monkeypatch):
    """The Q/DQ after a shortcut's zero Pad and the classifier's Flatten repeat the grid their input is on (exact);
    the classifier's int32 bias moves by at most half a step of its input x weight scale. Against the same file
    without either pass, in onnxruntime's reference semantics (no integer kernels): the same top-1 everywhere."""
    import pruneflow.export.qdq as qdq
    from pruneflow.export.onnx import write_int8_onnx

    x, _, _, out = resnet20_int8
    raw = onnx.load(str(out / "qdq.raw.onnx"))
    report = write_int8_onnx(raw, tmp_path / "with.onnx", form="cpu")
    assert report.moves_requantized == 3 and report.gemm_biases_quantized == 1  # two shortcut Pads and the Flatten
    monkeypatch.setattr(qdq, "requantize_moves", lambda graph, report: None)
    monkeypatch.setattr(qdq, "quantize_gemm_biases", lambda graph, report: None)
    write_int8_onnx(raw, tmp_path / "without.onnx", form="cpu")
    with_, without = (open_artifact(tmp_path / f"{n}.onnx", exact_int8=True)(x.numpy()) for n in ("with", "without"))
    assert (with_.argmax(1) == without.argmax(1)).all()
    assert np.abs(with_ - without).max() < 1e-3 * np.abs(without).max()


def test_each_cpu_encoding_writes_the_grid_its_name_says_and_computes_the_quantized_model(quantized, tmp_path):
    """Issue 25, item 1: ``u8s8`` (guarded: Clip to 127, exact on every x86), ``u8s8_vnni`` (no Clip, one op fewer
    per activation) and ``s8s8`` (int8 activations as NNCF trained them) encode the same model. Each is checked here
    in onnxruntime's reference semantics (no integer kernels: the same on every CPU) against the quantized torch model,
    and, on a CPU whose int8 kernels compute it exactly, in the integer kernels too."""
    from pruneflow.export.forms import exact_encodings
    from pruneflow.export.onnx import export_raw_qdq, write_int8_onnx
    from pruneflow.export.qdq import ENCODINGS

    q, x, ref, _, _ = quantized
    raw = export_raw_qdq(strip_quantizers(q, x), x[:2], tmp_path)
    exact, _ = exact_encodings()
    for encoding in ENCODINGS:
        path = tmp_path / f"{encoding}.onnx"
        write_int8_onnx(raw, path, form="cpu", encoding=encoding)
        model = onnx.load(str(path))
        consts = _consts(model)
        ops = [n.op_type for n in model.graph.node]
        zps = [consts[n.input[2]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in consts]
        if encoding == "s8s8":
            assert all(z.dtype == np.int8 and not z.any() for z in zps) and ops.count("Relu") == 2 and "Clip" not in ops
        else:
            # 3 non-negative tensors, one of them again after the classifier's Flatten (``requantize_moves``)
            assert all(z.dtype == np.uint8 for z in zps) and sum(int(z) == 0 for z in zps) == 4 and "Relu" not in ops
            assert ops.count("Clip") == (4 if encoding == "u8s8" else 0)
        assert check_convention(model, "cpu") == []
        runs = [open_artifact(path, exact_int8=True)] + ([open_artifact(path)] if encoding in exact else [])
        for run in runs:
            out = run(x.numpy())
            assert parity_metrics(ref, out)["cosine"] >= PARITY_DEFAULTS["int8"].min_cosine, encoding
            assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.95, encoding
