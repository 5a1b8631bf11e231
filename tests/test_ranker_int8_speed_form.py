"""The form a ranker's INT8 ONNX takes so that onnxruntime runs it no slower than FP32 (issue 37's acceptance: INT8 not
slower than FP32 at batch 64 in onnxruntime, interleaved).

What made the MMoE and DLRM INT8 ONNX slow was not arithmetic but ops: five a table read, a mask multiply on every
gathered value of a bag, and Q/DQ pairs before the DLRM's float interaction that onnxruntime fuses into nothing (the
figures are in the docstrings of ``embedding.gather_rows``, ``embedding._padding_masks`` and
``qdq.drop_rounding_before_float_concats``). These tests hold the graph to that form and its outputs to the float and
quantized models in onnxruntime and OpenVINO; they time nothing.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from pruneflow.export.embedding import is_row_dequantize, quantize_embeddings, snap_embedding_tables
from pruneflow.export.onnx import export_onnx
from pruneflow.zoo.bags import dlrm_bags
from pruneflow.zoo.mmoe import mmoe


def _runs(path, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The first output in onnxruntime and in OpenVINO (f32), both from the ONNX file."""
    import onnxruntime as ort
    import openvino as ov

    got_ort = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    compiled = ov.Core().compile_model(ov.convert_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return got_ort, compiled(feed)[compiled.output(0)]


class Fields(nn.Module):
    """One id a field (a ranker's one-hot fields) and a sequence of ids (read with 2-D ids) from two tables."""

    def __init__(self):
        super().__init__()
        self.users, self.items = nn.Embedding(300, 16), nn.Embedding(200, 16)

    def forward(self, ids: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.users(ids[:, 0]), self.items(ids[:, 1]), self.items(seq).sum(1)], 1)


def test_one_id_a_field_reads_rows_through_one_dequantize_and_a_sequence_through_cast_and_mul(tmp_path):
    torch.manual_seed(0)
    model = Fields().eval()
    snap_embedding_tables(model)
    x = {"ids": torch.stack([torch.randint(0, 300, (32,)), torch.randint(0, 200, (32,))], 1),
         "seq": torch.randint(0, 200, (32, 5))}
    with torch.no_grad():
        want = model(**x).numpy()
    export_onnx(model, x, tmp_path / "m.onnx")
    proto = onnx.load(str(tmp_path / "m.onnx"))
    report = quantize_embeddings(proto, on_grid=True)
    assert sorted(t["shape"][0] for t in report.tables) == [200, 300]
    ops = [n.op_type for n in proto.graph.node]
    # three reads: two of one id a field (Gather rows, Gather scales, DequantizeLinear axis 0), one of a sequence
    dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 2 and all(next(a.i for a in n.attribute if a.name == "axis") == 0 for n in dqs)
    assert ops.count("Cast") == 1 and ops.count("Unsqueeze") == 1
    onnx.save(proto, str(tmp_path / "q.onnx"))
    onnx.checker.check_model(str(tmp_path / "q.onnx"), full_check=True)
    got_ort, got_ov = _runs(tmp_path / "q.onnx", {k: v.numpy() for k, v in x.items()})
    assert np.abs(got_ort - want).max() < 1e-6 and np.abs(got_ov - want).max() < 1e-6


class PaddedBag(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(300, 16, mode=mode, padding_idx=0)
        with torch.no_grad():
            self.bag.weight[0] = 3.0  # a padding row that is not zero: only the mask (or its zero scale) keeps it out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bag(ids)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_padded_bag_reads_its_padding_row_as_zeros_and_needs_no_mask_multiply(mode, tmp_path):
    torch.manual_seed(0)
    model = PaddedBag(mode).eval()
    snap_embedding_tables(model)
    ids = torch.randint(1, 300, (16, 4))
    ids[0] = 0  # all padding: zeros
    ids[1, 2:] = 0  # partly padding (a mean over 2)
    with torch.no_grad():
        want = model(ids).numpy()
    export_onnx(model, ids, tmp_path / "m.onnx")
    proto = onnx.load(str(tmp_path / "m.onnx"))
    assert sum(n.op_type == "Mul" for n in proto.graph.node) == 1  # the float graph's mask multiply
    report = quantize_embeddings(proto, on_grid=True)
    (table,) = report.tables
    assert table["padding_row"] == 0 and "padding row 0 read as zeros" in report.notes()[0]
    scale = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name.endswith("_scale"))
    assert scale[0] == 0 and np.all(scale[1:] > 0)
    producer = {o: n for n in proto.graph.node for o in n.output}
    reduce = next(n for n in proto.graph.node if n.op_type == "ReduceSum" and producer[n.input[0]].op_type == "Mul")
    assert producer[reduce.input[0]].name.endswith("_Mul")  # the rows' own dequantizing Mul, no mask Mul after it
    # a mean still counts its ids with the mask (Equal/Not stay for the count only)
    assert ({"Equal", "Not"} <= {n.op_type for n in proto.graph.node}) == (mode == "mean")
    onnx.save(proto, str(tmp_path / "q.onnx"))
    got_ort, got_ov = _runs(tmp_path / "q.onnx", {"input": ids.numpy()})
    assert np.abs(got_ort - want).max() < 1e-6 and np.abs(got_ov - want).max() < 1e-6


def test_a_bag_table_read_without_a_mask_keeps_its_padding_row():
    """Only a table every read of which is a masked bag read gets the zero scale: a plain lookup reads row 0 as it is."""
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(table, "table")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = quantize_embeddings(proto, min_bytes=0)
    assert report.tables[0]["padding_row"] is None


def _quantized(model: nn.Module, x: dict[str, torch.Tensor]) -> nn.Module:
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.qat.nncf_quant import is_ranker, quantize, strip_quantizers
    from pruneflow.qat.settings import NncfSettings

    snap_embedding_tables(model, fields=is_ranker(model))  # what the qat and ptq stages do first
    return strip_quantizers(quantize(copy.deepcopy(model), CalibrationSet(x=x), NncfSettings(batch_size=16)), x)


def _dlrm_inputs(n: int = 64) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    bags = torch.randint(1, 30, (n, 2, 4))
    bags[0] = 0
    bags[1, :, 2:] = 0
    return {"ids": torch.stack([torch.randint(0, c, (n,)) for c in (7, 500)], 1), "bags": bags, "dense": torch.randn(n, 3)}


def test_a_dlrm_runs_its_interaction_on_unrounded_int8_table_rows_and_keeps_its_int8_mlps(tmp_path):
    pytest.importorskip("nncf")
    import onnxruntime as ort

    from pruneflow.export.onnx import export_int8_onnx

    torch.manual_seed(0)
    model = dlrm_bags([7, 500], [300, 30], 4, 3, embedding_dim=16, hidden=64).eval()
    x = _dlrm_inputs()
    stripped = _quantized(model, x)
    report = export_int8_onnx(stripped, x, tmp_path / "model.int8.onnx", form="cpu")
    proto = onnx.load(str(tmp_path / "model.int8.onnx"))
    # NNCF's quantizers on the stacked vectors fed only the float interaction: gone, one pair a vector
    assert report.float_concat_quantizers_dropped == 5  # 2 tables, 2 bags, the bottom MLP
    producer = {o: n for n in proto.graph.node for o in n.output}
    # the tables' one-id reads and the bags' sums each one stacked read (stacked.py): the Concat takes two [B, 2, 16]
    stack = next(n for n in proto.graph.node if n.op_type == "Concat" and "_stacked" in n.input[0])
    assert [producer[i].op_type for i in stack.input] == ["Mul", "ReduceSum"]
    assert sum("stacked into one read" in n for n in report.notes) == 2
    # the tables are int8 (the 7-row field too: its width is the id tables'), stored once each in the stacked tables,
    # and the bags read their padding rows as zeros (scale 0 in the stacked scales)
    tables = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.dims[-1] == 16 and t.dims[0] > 64]
    assert sorted(t.dims[0] for t in tables) == [300 + 30, 7 + 500] and all("_stacked" in t.name for t in tables)
    assert sum("padding row 0 read as zeros" in n for n in report.notes) == 2
    bag_scale = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer
                     if t.name.endswith("_scale") and t.dims[0] == 330)
    assert bag_scale[0] == 0 and bag_scale[300] == 0 and np.all(np.delete(bag_scale, [0, 300]) > 0)
    assert not any(n.name.endswith("_Dequantize") for n in proto.graph.node)  # no per-field read left
    # the MLPs keep their int8 GEMMs: onnxruntime runs them as QGemm
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "model.int8.onnx"), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node].count("QGemm") >= 4
    feed = {k: v.numpy() for k, v in x.items()}
    got_ort, got_ov = _runs(tmp_path / "model.int8.onnx", feed)
    with torch.no_grad():
        float_model, quantized = model(**x).numpy(), stripped(**x).numpy()
    scale = np.abs(float_model).max()
    for got in (got_ort, got_ov):
        assert np.abs(got - quantized).max() < 0.05 * scale
        assert np.corrcoef(got.ravel(), quantized.ravel())[0, 1] > 0.995  # (u8s8 re-grids some weights: close, not equal)


def test_an_mmoe_keeps_nncf_placement_where_its_concat_feeds_int8_experts(tmp_path):
    """The MMoE's concatenated rows are quantized once, after the Concat, for its int8 experts and gates: nothing is
    dropped there, and its one-id reads are one stacked read of its three tables."""
    pytest.importorskip("nncf")
    from pruneflow.export.onnx import export_int8_onnx

    torch.manual_seed(0)
    model = mmoe([300, 200, 5], num_dense=3, embedding_dim=16, experts=2, expert_hidden=64, tower_hidden=16).eval()
    n = 64
    x = {"ids": torch.stack([torch.randint(0, c, (n,)) for c in (300, 200, 5)], 1), "dense": torch.randn(n, 3)}
    stripped = _quantized(model, x)
    report = export_int8_onnx(stripped, x, tmp_path / "model.int8.onnx", form="cpu", output_name=["click", "finish"])
    assert report.float_concat_quantizers_dropped == 0
    proto = onnx.load(str(tmp_path / "model.int8.onnx"))
    # the 300-, 200- and 5-row tables (the 5-row field joins them: a ranker's tables of one width are stored alike) read
    # by one stacked read (stacked.py) whose [B, 3, 16] rows are flattened into the Concat with the dense features
    assert not any(n.name.endswith("_Dequantize") for n in proto.graph.node)
    assert sum("3 one-id table reads (input columns [0, 1, 2]) stacked" in n for n in report.notes) == 1
    producer = {o: n for n in proto.graph.node for o in n.output}
    concat = next(n for n in proto.graph.node if n.op_type == "Concat" and any("_stacked" in i for i in n.input))
    assert concat.input[-1] == "dense" and producer[concat.input[0]].op_type == "Reshape"  # the fields' rows, then the dense
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "model.int8.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["click", "finish"], {k: v.numpy() for k, v in x.items()})
    with torch.no_grad():
        want = stripped(**x)
    for name, value in zip(["click", "finish"], got):
        assert np.abs(value - want[name].numpy()).max() < 0.05 * float(want[name].abs().max())


def test_a_model_without_tables_keeps_every_quantizer(tmp_path):
    """The Concat rule is for rankers (a graph that reads embedding tables): a model without tables keeps NNCF's
    quantizers before a Concat."""
    from onnx import TensorProto, helper, numpy_helper

    from pruneflow.export.qdq import convert

    s, z = numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["a", "s", "z"], ["qa"]), helper.make_node("DequantizeLinear", ["qa", "s", "z"], ["da"]),
             helper.make_node("Concat", ["da", "b"], ["c"], axis=1), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [s, z])
    plain = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert convert(plain, "cpu").float_concat_quantizers_dropped == 0
    assert [n.op_type for n in plain.graph.node].count("QuantizeLinear") == 1
    # the same graph reading a table drops the pair: the Concat runs in float in onnxruntime either way
    table = numpy_helper.from_array(np.ones((10, 3), np.float32), "table")
    ranker = copy.deepcopy(plain)
    ranker.graph.initializer.append(table)
    ranker.graph.input.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [2]))
    ranker.graph.node.insert(0, helper.make_node("Gather", ["table", "ids"], ["b2"], axis=0))
    ranker.graph.output.append(helper.make_tensor_value_info("b2", TensorProto.FLOAT, None))
    assert convert(ranker, "cpu").float_concat_quantizers_dropped == 1
    assert "QuantizeLinear" not in [n.op_type for n in ranker.graph.node]
    assert convert(copy.deepcopy(ranker), "tensorrt").float_concat_quantizers_dropped == 0
