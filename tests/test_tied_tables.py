"""Tied item tables stored once (issue 37, item 5): pruneflow/export/tied.py, through the ONNX and OpenVINO exports.

A sequential recommender scores the next item against its own item table: SASRec ties a Linear to the Embedding
(``output.weight = items.weight``), and a model we never saw may write ``h @ items.weight.T`` in forward. Each
artifact must hold that [V, H] table once, compute what the torch model it came from computes, and count the
table once in its ``table_bytes``/``other_bytes``.

Why the float readers go through a ``Transpose`` of the table, not a Gemm(transB=1): timed interleaved on the
20000 x 64, 2-block SASRec (one thread, AVX-512 VNNI EPYC, medians of 300 runs at batch 1 and 100 at batch 64), the
two-copy file, MatMul(h, Transpose(table)) and Gemm(h, table, transB=1) ran within 3 % of each other in onnxruntime
(b1 0.548 / 0.549 / 0.535 ms, b64 5.21 / 5.19 / 5.11 ms) and OpenVINO (b1 0.592 / 0.568 / 0.576 ms, b64 5.52 / 5.41 /
5.38 ms; the same IR bytes for all three): both runtimes fold a Transpose of a constant when they load the model,
and the Transpose keeps the MatMul of any rank.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from pruneflow.export.embedding import component_bytes
from pruneflow.export.onnx import export_onnx, export_raw_qdq, to_fp16, write_int8_onnx
from pruneflow.export.tied import share_tied_tables
from pruneflow.zoo.sequence import sasrec

from conftest import run_recipe_dict, runs_a_recipe

V, H, L = 3000, 32, 10


class FunctionalTie(nn.Module):
    """The tie written in forward: no Linear shares the table, the scores read ``items.weight.T`` directly."""

    def __init__(self, num_items: int = V, dim: int = H):
        super().__init__()
        self.items = nn.Embedding(num_items, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mix(self.items(seq)))
        return self.norm(h[:, -1]) @ self.items.weight.T


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return (sasrec(V, H, heads=2, blocks=1, max_len=L, dropout=0.0) if kind == "sasrec" else FunctionalTie()).eval()


def _ids(n: int = 64) -> torch.Tensor:
    ids = torch.randint(1, V, (n, L), generator=torch.Generator().manual_seed(1))
    ids[: n // 4, :4] = 0  # left padding, as the seqlog data has
    return ids


def _tables(proto) -> list[tuple[int, list[int]]]:
    """(data type, dims) of every initializer holding V*H values: a copy of the item table."""
    return [(t.data_type, list(t.dims)) for t in proto.graph.initializer if int(np.prod(t.dims)) == V * H]


def _readers(proto, name: str) -> set[str]:
    return {n.op_type for n in proto.graph.node if name in n.input}


def _session(model: str | bytes):
    """An onnxruntime CPU session without the layout (level 3) optimizations: onnxruntime 1.32's NchwcTransformer
    crashes the process (SIGSEGV) loading SASRec's FP16 ONNX, tied or not (the FP16 file converted from the FP32
    export before this change crashed it too); extended optimizations include the Q/DQ fusions."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _ort(path: Path, ids: torch.Tensor) -> np.ndarray:
    session = _session(str(path))
    return session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]


def _openvino(path: Path, ids: torch.Tensor, tmp: Path) -> tuple[np.ndarray, list[str]]:
    """Outputs of the IR converted from the ONNX at ``path`` (f32 inference, to compare tightly), and the element
    types of the constants of V*H values its .bin stores (the writer stores equal bytes once: counted by offset)."""
    import openvino as ov

    xml = tmp / (path.stem + ".xml")
    ov.save_model(ov.convert_model(str(path)), str(xml), compress_to_fp16=False)
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    out = compiled(ids.numpy())[compiled.output(0)]
    stored = {}
    for kind, shape, offset in re.findall(r'<data element_type="(\w+)" shape="([\d, ]+)" offset="(\d+)"', xml.read_text()):
        if int(np.prod([int(d) for d in shape.split(",")])) == V * H:
            stored[offset] = kind
    return out, sorted(stored.values())


def _top_k_overlap(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    ta, tb = np.argsort(-a, 1)[:, :k], np.argsort(-b, 1)[:, :k]
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ta, tb)]))


@pytest.mark.parametrize("kind", ["sasrec", "functional"])
def test_float_onnx_and_ir_hold_the_tied_table_once(tmp_path, kind):
    model, ids = _model(kind), _ids()
    fp32, fp16 = tmp_path / "model.fp32.onnx", tmp_path / "model.fp16.onnx"
    export_onnx(model, ids[:2], fp32)
    to_fp16(fp32, fp16)
    for path, dtype, width in ((fp32, TensorProto.FLOAT, 4), (fp16, TensorProto.FLOAT16, 2)):
        proto = onnx.load(str(path))
        assert _tables(proto) == [(dtype, [V, H])], path.name  # before: a second, transposed [H, V] initializer
        table = next(t.name for t in proto.graph.initializer if list(t.dims) == [V, H])
        assert _readers(proto, table) == {"Gather", "Transpose"}  # the lookup, and the scores through one Transpose
        parts = component_bytes(proto)
        assert V * H * width <= parts["table_bytes"] < 1.1 * V * H * width and parts["other_bytes"] < V * H * width / 4
        assert path.stat().st_size < 1.5 * V * H * width  # one table and a small model (twice: over 2 V H)
    with torch.no_grad():
        want = model(ids).numpy()
    assert np.abs(_ort(fp32, ids) - want).max() < 1e-4
    half = _ort(fp16, ids)
    assert np.abs(half - want).max() < 0.02 * np.abs(want).max() and _top_k_overlap(half, want) >= 0.9
    got, stored = _openvino(fp32, ids, tmp_path)
    assert np.abs(got - want).max() < 1e-4 and stored == ["f32"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """SASRec and the functional tie after what the ptq stage does (tables snapped to their int8 grid where untied,
    NNCF post-training quantization), stripped to torch's fake-quant ops, and exported once to raw Q/DQ."""
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.export.embedding import snap_embedding_tables
    from pruneflow.qat.nncf_quant import quantize, strip_quantizers
    from pruneflow.qat.settings import NncfSettings

    tmp, ids, out = tmp_path_factory.mktemp("tied-int8"), _ids(), {}
    for kind in ("sasrec", "functional"):
        model = _model(kind)
        snap_embedding_tables(model)
        stripped = strip_quantizers(quantize(copy.deepcopy(model), CalibrationSet(x=ids), NncfSettings(batch_size=16)), ids[:2])
        with torch.no_grad():
            want = stripped(ids).numpy()
        out[kind] = (export_raw_qdq(stripped, ids[:2], tmp), want)
    return out, ids


@pytest.mark.parametrize("form,encoding", [("cpu", "s8s8"), ("cpu", "u8s8"), ("tensorrt", "u8s8")])
def test_int8_forms_read_one_int8_table_for_the_lookup_and_the_scores(tmp_path, quantized, form, encoding):
    """SASRec's output is quantized per row of the table: that int8 weight and its row scales serve the lookup too."""
    (raw, want), ids = quantized[0]["sasrec"], quantized[1]
    path = tmp_path / f"{form}-{encoding}.onnx"
    report = write_int8_onnx(raw, path, form=form, encoding=encoding)
    proto = onnx.load(str(path))
    assert _tables(proto) == [(TensorProto.INT8, [V, H])]  # before: int8 twice (cpu), or float + int8 (tensorrt)
    table = next(t.name for t in proto.graph.initializer if list(t.dims) == [V, H])
    lookup = {"cpu": {"Gather", "DequantizeLinear"}, "tensorrt": {"DequantizeLinear"}}[form]
    assert _readers(proto, table) == lookup  # cpu: int8 rows gathered; tensorrt: the Gather reads the DequantizeLinear
    parts = component_bytes(proto)
    # once: int8 values, a float scale (and, tensorrt, an int8 zero point) a row, and the float position table
    assert V * H <= parts["table_bytes"] <= V * H + 5 * V + 4 * L * H and parts["other_bytes"] < V * H / 4
    assert path.stat().st_size < 1.5 * V * H
    tied = [n for n in report.notes if n.startswith("tied table")]
    assert len(tied) == 1 and ("re-gridded" in tied[0]) == (encoding == "u8s8" and form == "cpu")
    got = _ort(path, ids)
    scale = np.abs(want).max()
    # the u8s8 fit re-grids the rows the output reads (and now the lookup): coarser than s8s8 and tensorrt
    assert np.abs(got - want).max() < (0.1 if "re-gridded" in tied[0] else 0.05) * scale
    assert _top_k_overlap(got, want) >= 0.9
    from_ir, stored = _openvino(path, ids, tmp_path)
    assert np.abs(from_ir - got).max() < 0.02 * scale and stored == ["i8"]  # before: i8 + f32 (a tensorrt-form IR)


@pytest.mark.parametrize("form,encoding", [("cpu", "s8s8"), ("cpu", "u8s8"), ("tensorrt", "u8s8")])
def test_a_tie_written_in_forward_is_one_int8_table_for_the_lookup_and_the_scores(tmp_path, quantized, form, encoding):
    """The functional tie: NNCF quantizes the activation of ``h @ items.weight.T`` but not the transposed table; the
    export gives the table (snapped, on its int8 grid) the per-row weight quantizer a Linear has (``quantize_float_ties``),
    so the scores are an int8 MatMul and the lookup reads the same int8 table: stored once, int8 (it had been float, the
    file as large as FP32)."""
    (raw, want), ids = quantized[0]["functional"], quantized[1]
    path = tmp_path / f"{form}-{encoding}.onnx"
    report = write_int8_onnx(raw, path, form=form, encoding=encoding)
    proto = onnx.load(str(path))
    assert _tables(proto) == [(TensorProto.INT8, [V, H])]
    assert path.stat().st_size < 1.5 * V * H  # one int8 copy and a scale a row (float: 4 V H)
    tied = [n for n in report.notes if n.startswith("tied table")]
    assert len(tied) == 1 and ("re-gridded" in tied[0]) == (encoding == "u8s8" and form == "cpu")
    got = _ort(path, ids)
    if "re-gridded" in tied[0]:  # the u8s8 fit re-grids the rows the output reads (and so the lookup): close, not equal
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max() and _top_k_overlap(got, want) >= 0.9
    else:  # the same values torch multiplied: the table was on that grid
        assert np.abs(got - want).max() < 1e-3 * np.abs(want).max() and _top_k_overlap(got, want) >= 0.99
    if form == "cpu":  # onnxruntime runs the scores as an integer MatMul
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        assert "MatMulIntegerToFloat" in {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}


def _graph(nodes, inits, out_shape) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                           helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", 8]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, out_shape)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(proto, feeds) -> list[np.ndarray]:
    return _session(proto.SerializeToString()).run(None, feeds)


def test_gemm_copies_are_read_through_its_transpose_flags_and_lookalikes_are_left():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 8)).astype(np.float32)
    feeds = {"ids": np.array([3, 0, 49]), "h": rng.normal(size=(3, 8)).astype(np.float32)}
    gather = helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)
    # a Gemm reading the transposed copy [8, 50] (transB=0) and one reading an equal copy [50, 8] (transB=1)
    for copy_, trans_b in ((table.T.copy(), 0), (table.copy(), 1)):
        proto = _graph([gather, helper.make_node("Gemm", ["h", "w"], ["scores"], transB=trans_b)],
                       {"table": table, "w": copy_}, ["n", 50])
        before = _run(proto, feeds)
        report = share_tied_tables(proto)
        assert [t.name for t in proto.graph.initializer] == ["table"] and report.saved_bytes == table.nbytes
        gemm = next(n for n in proto.graph.node if n.op_type == "Gemm")
        assert gemm.input[1] == "table" and helper.get_attribute_value(gemm.attribute[0]) == 1
        for a, b in zip(_run(proto, feeds), before):
            np.testing.assert_array_equal(a, b)
    # one value apart: not the table
    lookalike = table.T.copy()
    lookalike[0, 0] += 1e-3
    proto = _graph([gather, helper.make_node("MatMul", ["h", "w"], ["scores"])], {"table": table, "w": lookalike}, ["n", 50])
    assert share_tied_tables(proto).tables == [] and len(proto.graph.initializer) == 2


def test_an_int8_weight_of_another_grid_is_not_taken_for_the_table():
    """Only a DequantizeLinear whose grid the table lies on (or rounds onto) is its quantization."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 8)).astype(np.float32)
    scale = (np.abs(table).max(1) / 127).astype(np.float32)
    q = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["w"], axis=0),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "wt"], ["scores"])]
    feeds = {"ids": np.array([3, 0, 49]), "h": rng.normal(size=(3, 8)).astype(np.float32)}
    other = np.roll(q, 1, axis=1)  # the same shape and scales, other values
    proto = _graph(nodes, {"table": table, "q": other, "scale": scale, "zp": np.zeros(50, np.int8)}, ["n", 50])
    assert share_tied_tables(proto, "cpu").tables == [] and "table" in {t.name for t in proto.graph.initializer}
    on_grid = (q.astype(np.float32) * scale[:, None]).astype(np.float32)  # what the quantization stage leaves
    proto = _graph(nodes, {"table": on_grid, "q": q, "scale": scale, "zp": np.zeros(50, np.int8)}, ["n", 50])
    report = share_tied_tables(proto, "cpu")
    assert [t["grid"] for t in report.tables] == ["int8"] and "table" not in {t.name for t in proto.graph.initializer}
    rows, scores = _run(proto, feeds)
    np.testing.assert_array_equal(rows, on_grid[feeds["ids"]])  # the int8 rows times their scales: the table's rows
    np.testing.assert_allclose(scores, feeds["h"] @ on_grid.T, rtol=1e-6, atol=1e-5)


@pytest.fixture(scope="module")
@runs_a_recipe
def tied_run(tmp_path_factory):
    recipe = {
        "name": "sasrec-tied", "seed": 0,
        "model": {"factory": "sasrec", "kwargs": {"num_items": 1000, "dim": 16, "heads": 2, "blocks": 1, "max_len": 10}},
        "task": {"type": "next_item", "k": 10},
        "data": {"format": "seqlog", "seqlog": {"rows": 2000, "items": 1000, "length": 10}, "input_column": "seq",
                 "label_column": "next_item"},
        "stages": [{"type": "train", "epochs": 1, "batch_size": 256, "lr": 0.003, "optimizer": "adamw"},
                   {"type": "calibrate", "size": 64}, {"type": "ptq"},
                   {"type": "export", "targets": [{"type": "onnx", "form": "u8s8"}, {"type": "openvino", "form": "tensorrt"}],
                    # no fp16: its ONNX crashes onnxruntime's default session (see _session), so the run would
                    "precisions": ["fp32", "int8"], "latency": None}],
    }
    return run_recipe_dict(recipe, tmp_path_factory.mktemp("tied-run"))[1]


def test_every_artifact_of_a_run_holds_the_table_once(tied_run):
    r = tied_run
    assert r.exit_code == 0, [g for g in r.gates if not g.passed]
    values = 1000 * 16
    widths = {"onnx.fp32": 4, "onnx.int8": 1, "onnx.int8_tensorrt": 1}
    for label, width in widths.items():
        artifact = next(a for a in r.artifacts if a.label == label)
        proto = onnx.load(str(r.run_dir / artifact.path))
        assert sum(int(np.prod(t.dims)) == values for t in proto.graph.initializer) == 1, label
        assert r.metrics[f"{label}.other_bytes"] < values * width / 2, label  # the table is not counted again
        assert values * width <= r.metrics[f"{label}.table_bytes"], label
        assert r.metrics[f"{label}.topk_overlap"] >= 0.9, label
    for label in ("openvino.fp32", "openvino.int8"):
        artifact = next(a for a in r.artifacts if a.label == label)
        xml = (r.run_dir / artifact.path).read_text()
        stored = {o for shape, o in re.findall(r'shape="([\d, ]+)" offset="(\d+)"', xml)
                  if int(np.prod([int(d) for d in shape.split(",")])) == values}
        assert len(stored) == 1, label
        assert r.metrics[f"{label}.topk_overlap"] >= 0.9, label
    notes = json.dumps([a.notes for a in r.artifacts if a.label in ("onnx.int8", "onnx.int8_tensorrt")])
    assert notes.count("tied table") == 2


def test_a_tie_is_quantized_only_on_its_grid_and_under_a_quantized_activation():
    """``quantize_float_ties`` needs the table on its per-row int8 grid (what the stage measured) and the projection's
    activation quantized; otherwise the float graph is left exactly as it was."""
    from pruneflow.export.embedding import quantize_rows
    from pruneflow.export.tied import quantize_float_ties

    rng = np.random.default_rng(0)
    q, scale = quantize_rows(rng.standard_normal((50, 8)).astype(np.float32))
    snapped = (q.astype(np.float32) * scale[:, None]).astype(np.float32)

    def model(table: np.ndarray, quantized: bool) -> onnx.ModelProto:
        s, z = np.array(0.05, np.float32), np.array(0, np.int8)
        nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)]
        h = "h"
        if quantized:
            nodes += [helper.make_node("QuantizeLinear", ["h", "s", "z"], ["hq"]),
                      helper.make_node("DequantizeLinear", ["hq", "s", "z"], ["hd"])]
            h = "hd"
        nodes.append(helper.make_node("MatMul", [h, "table_t"], ["scores"]))
        return _graph(nodes, {"table": table, "table_t": np.ascontiguousarray(table.T), "s": s, "z": z}, ["n", 50])

    for table, quantized in ((rng.standard_normal((50, 8)).astype(np.float32), True), (snapped, False)):
        proto = model(table, quantized)
        before = proto.SerializeToString()
        assert quantize_float_ties(proto) == [] and proto.SerializeToString() == before
    proto = model(snapped, True)
    assert quantize_float_ties(proto) == ["table"]
    ops = [n.op_type for n in proto.graph.node]
    assert ops[:3] == ["QuantizeLinear", "DequantizeLinear", "Transpose"] and "table_t" not in {t.name for t in proto.graph.initializer}
    feeds = {"ids": np.array([1, 7]), "h": rng.standard_normal((2, 8)).astype(np.float32)}
    rows, scores = _run(proto, feeds)
    hd = np.clip(np.round(feeds["h"] / 0.05), -128, 127) * 0.05
    assert np.array_equal(rows, snapped[[1, 7]]) and np.allclose(scores, hd @ snapped.T, atol=1e-5)
