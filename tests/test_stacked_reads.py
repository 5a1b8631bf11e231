"""A ranker's per-field int8 table reads stacked into one read (``pruneflow/export/stacked.py``): exact, in onnxruntime and
OpenVINO, and only where the reads really are a stack of fields of one ids tensor."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from pruneflow.export.embedding import quantize_embeddings, snap_embedding_tables
from pruneflow.export.onnx import export_onnx
from pruneflow.export.stacked import notes, stack_field_reads


def _run(path, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    import onnxruntime as ort
    import openvino as ov

    got_ort = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    compiled = ov.Core().compile_model(ov.convert_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return got_ort, compiled(feed)[compiled.output(0)]


class Fields(nn.Module):
    """Four one-id fields (columns ``order`` of ``ids``) and two summed bags, stacked for an interaction, as a DLRM
    does; a fifth table of another width read beside them."""

    def __init__(self, order=(0, 1, 2, 3), wide: bool = False):
        super().__init__()
        self.order = order
        self.tables = nn.ModuleList(nn.Embedding(rows, 8) for rows in (50, 3, 400, 200))
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, 8, mode="sum", padding_idx=0) for rows in (30, 60))
        self.wide = nn.Embedding(50, 12) if wide else None

    def forward(self, ids: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        rows = [table(ids[:, c]) for table, c in zip(self.tables, self.order)]
        rows += [bag(bags[:, j]) for j, bag in enumerate(self.bags)]
        vectors = torch.stack(rows, dim=1)
        out = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)
        return out if self.wide is None else torch.cat([out, self.wide(ids[:, 0])], 1)


def _inputs(order=(0, 1, 2, 3), n: int = 64) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.zeros(n, 4, dtype=torch.int64)
    for rows, column in zip((50, 3, 400, 200), order):  # column c holds the ids of the table that reads it
        ids[:, column] = torch.randint(0, rows, (n,))
    bags = torch.randint(1, 30, (n, 2, 4))
    bags[0] = 0  # all padding
    bags[1, :, 2:] = 0  # partly padding
    return {"ids": ids, "bags": bags}


def _quantized_onnx(model: nn.Module, x: dict, tmp_path, name: str):
    """The model's tables snapped as a ranker's (``fields``), its ONNX with them stored int8; and the snapped model's output."""
    snap_embedding_tables(model, fields=True)
    with torch.no_grad():
        want = model(**x).numpy()
    export_onnx(model, x, tmp_path / f"{name}.onnx")
    proto = onnx.load(str(tmp_path / f"{name}.onnx"))
    quantize_embeddings(proto, on_grid=True)
    return proto, want


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 0, 2, 1)], ids=["consecutive", "permuted"])
def test_field_reads_stack_into_one_read_that_gives_the_same_values_in_both_runtimes(order, tmp_path):
    torch.manual_seed(0)
    model = Fields(order).eval()
    x = _inputs(order)
    proto, want = _quantized_onnx(model, x, tmp_path, "m")
    onnx.save(proto, str(tmp_path / "per_field.onnx"))
    before = len(proto.graph.node)
    stacked = stack_field_reads(proto)
    assert [(s["kind"], s["fields"]) for s in stacked] == [("one", list(order)), ("bag", [0, 1])]
    assert len(proto.graph.node) == before - sum(s["ops_saved"] for s in stacked)
    assert any("4 one-id table reads" in n for n in notes(stacked))
    # one Slice (consecutive columns) or one Gather of the listed columns, per stack
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Slice") == (2 if order == (0, 1, 2, 3) else 1) and "DequantizeLinear" not in ops
    # each table stored once, inside its stack, in field order (row offsets 0, 50, 53, 453 for the one-id fields)
    int8 = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert sorted(v.shape[0] for v in int8.values()) == [30 + 60, 50 + 3 + 400 + 200]
    offsets = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name.endswith("stacked0_offsets"))
    assert offsets.tolist() == [0, 50, 53, 453]
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(tmp_path / "stacked.onnx"))
    feed = {k: v.numpy() for k, v in x.items()}
    ref_ort, ref_ov = _run(tmp_path / "per_field.onnx", feed)
    got_ort, got_ov = _run(tmp_path / "stacked.onnx", feed)
    assert np.array_equal(got_ort, ref_ort) and np.array_equal(got_ov, ref_ov)  # exact: the same float(q) * scale
    assert np.abs(got_ort - want).max() < 1e-5  # and the snapped torch model's values


def test_only_neighbouring_reads_of_one_width_and_one_ids_tensor_are_stacked(tmp_path):
    """A table of another width (read from the same ids column) stays its own read; the column read it shares with a
    stacked field survives the rewrite."""
    torch.manual_seed(0)
    model = Fields(wide=True).eval()
    x = _inputs()
    proto, want = _quantized_onnx(model, x, tmp_path, "m")
    stacked = stack_field_reads(proto)
    assert [s["fields"] for s in stacked] == [[0, 1, 2, 3], [0, 1]]
    assert sum(n.name.endswith("_Dequantize") for n in proto.graph.node) == 1  # the width-12 table's own read
    onnx.save(proto, str(tmp_path / "stacked.onnx"))
    got_ort, got_ov = _run(tmp_path / "stacked.onnx", {k: v.numpy() for k, v in x.items()})
    assert np.abs(got_ort - want).max() < 1e-5 and np.abs(got_ov - want).max() < 1e-5


def test_a_float_table_between_int8_fields_splits_the_stack_and_a_lone_field_is_left_alone(tmp_path):
    """Without ``fields`` the 3-row table stays float (under 1 KiB): the reads on either side of it are no run of two
    (50 | 3 float | 400, 200): only 400 and 200 stack."""
    torch.manual_seed(0)
    model = Fields().eval()
    x = _inputs()
    snap_embedding_tables(model)
    export_onnx(model, x, tmp_path / "m.onnx")
    proto = onnx.load(str(tmp_path / "m.onnx"))
    quantize_embeddings(proto, on_grid=True)
    assert [s["fields"] for s in stack_field_reads(proto) if s["kind"] == "one"] == [[2, 3]]


def test_a_graph_without_field_reads_is_unchanged():
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((10, 4), np.float32), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("Concat", ["rows", "rows"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    copy = proto.SerializeToString()
    assert stack_field_reads(proto) == [] and proto.SerializeToString() == copy


class FlatFields(nn.Module):
    """An MMoE's input: one-id rows and a bag side by side in one flat [B, F * D + dense] Concat."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, 8) for rows in (50, 3, 400, 200))
        self.bag = nn.EmbeddingBag(30, 8, mode="sum", padding_idx=0)

    def forward(self, ids: torch.Tensor, bags: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return torch.cat([table(ids[:, c]) for c, table in enumerate(self.tables)] + [self.bag(bags[:, 0]), dense], dim=1)


def test_reads_into_a_flat_concat_stack_and_flatten_back_to_the_same_columns(tmp_path):
    torch.manual_seed(0)
    model = FlatFields().eval()
    x = {**_inputs(), "dense": torch.randn(64, 3)}
    proto, want = _quantized_onnx(model, x, tmp_path, "m")
    onnx.save(proto, str(tmp_path / "per_field.onnx"))
    stacked = stack_field_reads(proto)
    # the lone bag too: its sum runs over the outer axis of its transposed ids
    assert [(s["kind"], s["fields"]) for s in stacked] == [("one", [0, 1, 2, 3]), ("bag", [0])]
    assert [n.op_type for n in proto.graph.node].count("Reshape") == 2 and "Transpose" in {n.op_type for n in proto.graph.node}
    onnx.save(proto, str(tmp_path / "stacked.onnx"))
    feed = {k: v.numpy() for k, v in x.items()}
    got_ort, got_ov = _run(tmp_path / "stacked.onnx", feed)
    ref_ort, ref_ov = _run(tmp_path / "per_field.onnx", feed)
    assert got_ort.shape == want.shape == (64, 4 * 8 + 8 + 3)
    assert np.array_equal(got_ort, ref_ort) and np.array_equal(got_ov, ref_ov) and np.abs(got_ort - want).max() < 1e-5
