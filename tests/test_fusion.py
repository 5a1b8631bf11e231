"""onnxruntime's fused transformer ops for pruned encoders (issue 25, item 2): per-layer head counts pinned so
the optimizer fuses every layer right, the fused FP32 checked against the unfused graph (right- and left-padded
rows), and the INT8 rebuilt in QAttention / MatMulIntegerToFloat on the trained parameters."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("nncf")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from pruneflow.calibrate.calibset import CalibrationSet  # noqa: E402
from pruneflow.export.fusion import fuse_for_onnxruntime, is_portable, pin_head_counts  # noqa: E402
from pruneflow.export.onnx import export_onnx  # noqa: E402
from pruneflow.prune.transformer import attention_sites, prune_heads  # noqa: E402
from pruneflow.qat.nncf_quant import quantize, strip_quantizers  # noqa: E402
from pruneflow.qat.settings import NncfSettings  # noqa: E402
from tests.test_bert_int8 import _cosine, _tiny_bert, _tokens  # noqa: E402


def _pruned_bert() -> torch.nn.Module:
    """The tiny BERT (2 layers, 4 heads of 16) with layers keeping 3 and 1 heads, as head pruning leaves them."""
    model = _tiny_bert()
    first, second = attention_sites(model)
    prune_heads(first, [0])
    prune_heads(second, [1, 2, 3])
    assert [s.heads for s in attention_sites(model)] == [3, 1]
    return model


def _holed(x: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The rows with tokens 1 and 2 masked out (mask 0 inside the row, [CLS] kept): a mask read as one length per
    row (onnxruntime's default for BERT, right for right-padded rows only) would still attend to them."""
    out = {k: v.numpy().copy() for k, v in x.items()}
    out["attention_mask"][:, 1:3] = 0
    return out


def _noisy_padding(x: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """``x`` with random token ids where the mask is 0: a graph that honours the mask answers the same at [CLS]."""
    out = {k: v.copy() for k, v in x.items()}
    noise = np.random.default_rng(seed).integers(103, 1000, out["input_ids"].shape)
    out["input_ids"] = np.where(out["attention_mask"] == 0, noise, out["input_ids"])
    return out


def _run(path, inputs) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {k: np.asarray(v) for k, v in inputs.items() if k in names})[0]


@pytest.fixture(scope="module")
def pruned_fp32(tmp_path_factory):
    model, x = _pruned_bert(), _tokens()
    path = tmp_path_factory.mktemp("fusion") / "fp32.onnx"
    export_onnx(model, x, path)
    return model, x, path


def test_pinned_head_counts_fuse_every_pruned_layer_and_compute_the_same(pruned_fp32, tmp_path):
    from onnxruntime.transformers.optimizer import optimize_model

    model, x, path = pruned_fp32
    # what onnxruntime's optimizer does alone: torch writes the head count as -1, so it fuses no attention
    alone = optimize_model(str(path), model_type="bert", num_heads=0, hidden_size=0, opt_level=0)
    assert alone.get_fused_operator_statistics()["Attention"] == 0
    assert pin_head_counts(onnx.load(str(path))) == [3, 1]

    samples = {k: v.numpy() for k, v in x.items()}
    fusion = fuse_for_onnxruntime(path, tmp_path / "fused.onnx", samples)
    assert fusion.kept and fusion.heads == [3, 1] and fusion.ops["Attention"] == 2
    # BiasGelu fused; the residual Add + LayerNormalization kept (onnxruntime's SkipLayerNormalization ran 10x slower)
    assert fusion.ops["BiasGelu"] == 2 and "SkipLayerNormalization" not in fusion.ops and fusion.max_diff < 1e-5
    assert not is_portable(tmp_path / "fused.onnx") and is_portable(path)
    with torch.no_grad():
        expected = model(**x).numpy()
    np.testing.assert_allclose(_run(tmp_path / "fused.onnx", x), expected, atol=1e-4)
    # the model's own 0/1 mask is kept, token by token: rows with masked tokens inside answer as the unfused graph
    # does and ignore what those tokens hold
    holed = _holed(x)
    np.testing.assert_allclose(_run(tmp_path / "fused.onnx", holed), _run(path, holed), atol=1e-5)  # 3e-4 with one length a row
    np.testing.assert_allclose(_run(tmp_path / "fused.onnx", _noisy_padding(holed)), _run(tmp_path / "fused.onnx", holed),
                               atol=1e-5)


def test_three_layers_with_their_own_head_counts_and_a_static_batch(tmp_path):
    """Each layer's count read from its own projections (not every third reshape), and a graph exported for batch 1
    checked a row at a time."""
    from pruneflow.zoo.hf import bert_classifier

    model = bert_classifier(vocab_size=1000, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128,
                            max_positions=64, seed=0).eval()
    for site, remove in zip(attention_sites(model), ([0], [1, 2, 3], [0, 3])):
        prune_heads(site, remove)
    x = _tokens(16)
    export_onnx(model, x, tmp_path / "static.onnx", dynamic_batch=False)
    assert pin_head_counts(onnx.load(str(tmp_path / "static.onnx"))) == [3, 1, 2]
    fusion = fuse_for_onnxruntime(tmp_path / "static.onnx", tmp_path / "fused.onnx", {k: v.numpy() for k, v in x.items()})
    assert fusion.kept and fusion.heads == [3, 1, 2] and fusion.ops["Attention"] == 3, fusion.note()
    with torch.no_grad():
        expected = model(**{k: v[:1] for k, v in x.items()}).numpy()
    np.testing.assert_allclose(_run(tmp_path / "fused.onnx", {k: v[:1].numpy() for k, v in x.items()}), expected, atol=1e-4)


def test_a_graph_without_attention_is_left_alone(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    export_onnx(net, torch.randn(4, 8), tmp_path / "mlp.onnx")
    fusion = fuse_for_onnxruntime(tmp_path / "mlp.onnx", tmp_path / "out.onnx", {"input": np.zeros((2, 8), np.float32)})
    assert not fusion.kept and not fusion.heads and "no attention layer" in fusion.note()
    assert not (tmp_path / "out.onnx").exists()


@pytest.fixture(scope="module")
def pruned_int8():
    """(stripped quantized pruned BERT, inputs, its s8s8 QDQ ONNX as a ModelProto)."""
    from pruneflow.export.attention_mask import soften_mask_fill
    from pruneflow.export.embedding import snap_embedding_tables
    from pruneflow.export.onnx import export_raw_qdq, fold_constants
    from pruneflow.export.qdq import convert

    model, x = _pruned_bert(), _tokens()
    snapped = copy.deepcopy(model)
    snap_embedding_tables(snapped)
    stripped = strip_quantizers(quantize(snapped, CalibrationSet(x=x), NncfSettings(batch_size=16)), x)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        raw = export_raw_qdq(stripped, x, Path(tmp))
    convert(raw, "cpu", "s8s8")
    proto = fold_constants(raw)
    soften_mask_fill(proto)
    return stripped, x, proto


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_fused_int8_runs_qattention_on_the_trained_weights(pruned_int8, tmp_path, mode):
    from pruneflow.export.fused_int8 import build

    stripped, x, proto = pruned_int8
    fused, report = build(proto, mode)
    ops = Counter(n.op_type for n in fused.graph.node)
    assert report.heads == [3, 1] and ops["QAttention"] == 2 and ops["MatMulIntegerToFloat"] == 6
    assert ops["DynamicQuantizeLinear" if mode == "dynamic" else "QuantizeLinear"] >= 4
    assert report.smooth_folded == 2 and report.float_matmuls == 0  # SmoothQuant on each attention output -> V
    assert not ops.get("Attention") and not ops.get("MatMul")
    # the bias of the attention output and FFN output projections taken into their MatMulIntegerToFloat
    assert sum(len(n.input) == 7 for n in fused.graph.node if n.op_type == "MatMulIntegerToFloat") == 4
    tables = [t for t in fused.graph.initializer if t.data_type == onnx.TensorProto.INT8 and list(t.dims) == [1000, 64]]
    assert tables, "the word-embedding table stays int8 as in the QDQ forms"
    onnx.save(fused, str(tmp_path / "fused.onnx"))
    onnx.checker.check_model(str(tmp_path / "fused.onnx"))
    with torch.no_grad():
        expected = stripped(**x).numpy()
    got = _run(tmp_path / "fused.onnx", x)
    assert _cosine(expected, got) > 0.999
    assert (expected.argmax(1) == got.argmax(1)).mean() >= 0.95
    if mode == "static":  # the mask is read token by token (dynamic scales would see the masked tokens' values)
        holed = _holed(x)
        np.testing.assert_allclose(_run(tmp_path / "fused.onnx", _noisy_padding(holed)), _run(tmp_path / "fused.onnx", holed),
                                   atol=1e-6)


def test_fused_int8_refuses_a_model_without_attention():
    from pruneflow.errors import ExportError
    from pruneflow.export.fused_int8 import build

    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])])
    with pytest.raises(ExportError, match="not a BERT-like encoder"):
        build(onnx.helper.make_model(graph))


def test_a_fused_file_says_it_needs_onnxruntime_and_bench_opens_it_there_only(pruned_fp32, tmp_path):
    from pruneflow.benchmark.measure import open_lanes
    from pruneflow.benchmark.variants import _from_file
    from pruneflow.benchmark.measure import BenchSettings
    from pruneflow.deployment import onnxruntime_fused_runtime, onnxruntime_only
    from pruneflow.formats.onnx import stamp_onnx

    _, x, path = pruned_fp32
    assert fuse_for_onnxruntime(path, tmp_path / "fused.onnx", {k: v.numpy() for k, v in x.items()}).kept
    proto = onnx.load(str(tmp_path / "fused.onnx"))
    stamp_onnx(proto, {"runtime": onnxruntime_fused_runtime(None)}, "fp32")
    onnx.save(proto, str(tmp_path / "fused.onnx"))
    variant = _from_file(tmp_path / "fused.onnx")
    assert set(variant.refused) == {"openvino"} and not onnxruntime_only({"runtime": None})
    lanes = open_lanes([variant], BenchSettings())
    assert {lane.runtime for lane in lanes} == {"onnxruntime"} and all(lane.error is None for lane in lanes)
    assert any("OpenVINO does not read this file" in n for n in variant.notes)
