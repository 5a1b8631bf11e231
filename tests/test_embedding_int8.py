"""INT8 word-embedding tables (issue 13, Deliver 6): pruneflow/export/embedding.py."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pruneflow.export.embedding import quantize_embeddings, quantize_rows
from pruneflow.export.onnx import export_onnx

VOCAB, HIDDEN = 30522, 64
WORD = "word_embeddings"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 2-layer, 64-wide BERT from a config (BERT's 30522-word vocabulary), its FP32 ONNX and some ids."""
    from pruneflow.zoo.hf import bert_classifier

    model = bert_classifier(num_layers=2, hidden_size=HIDDEN, num_heads=4, intermediate_size=128, seed=0).eval()
    ids = torch.randint(1, VOCAB, (16, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 18:] = 0  # padding
    path = tmp_path_factory.mktemp("bert") / "fp32.onnx"
    export_onnx(model, ids, path)
    return model, ids, path


def _rounded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its word-embedding table replaced by what the int8 table dequantizes to."""
    copied = copy.deepcopy(model)
    table = copied.model.bert.embeddings.word_embeddings.weight
    q, scale = quantize_rows(table.detach().numpy())
    with torch.no_grad():
        table.copy_(torch.from_numpy(q.astype(np.float32) * scale[:, None]))
    return copied


def _ort(path: Path, ids: torch.Tensor) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": ids.numpy()})[0]


@pytest.mark.parametrize("layout", ["gather_rows", "dequantize_table"])
def test_tiny_bert_table_int8_in_onnxruntime_and_openvino(tmp_path, tiny_bert, layout):
    import openvino as ov

    model, ids, fp32_path = tiny_bert
    proto = onnx.load(str(fp32_path))
    report = quantize_embeddings(proto, layout=layout)
    # only the word embedding: the position (512x64) and token-type tables are small
    assert [t["shape"] for t in report.tables] == [[VOCAB, HIDDEN]] and WORD in report.tables[0]["name"]
    zero_points = VOCAB if layout == "dequantize_table" else 0
    assert report.tables[0]["bytes_after"] == VOCAB * HIDDEN + 4 * VOCAB + zero_points
    path = tmp_path / "int8emb.onnx"
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    shrink = fp32_path.stat().st_size - path.stat().st_size
    assert abs(shrink - report.saved_bytes) < 4096  # the file shrinks by what the table saves (a few nodes added)

    # onnxruntime computes exactly the model whose table is the dequantized int8 one ...
    got = _ort(path, ids)
    exact = _rounded(model)(ids).detach().numpy()
    assert np.abs(got - exact).max() < 1e-4
    # ... which is within the rounding error of the unmodified model
    original = _ort(fp32_path, ids)
    bound = report.tables[0]["max_abs_error"]
    assert 0 < np.abs(got - original).max() < 10 * bound
    assert (got.argmax(-1) == original.argmax(-1)).all()

    # OpenVINO runs it (f32, to compare tightly) and its IR keeps the table as an i8 constant
    core = ov.Core()
    converted = ov.convert_model(str(path))
    compiled = core.compile_model(converted, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert np.abs(compiled(ids.numpy())[compiled.output(0)] - exact).max() < 1e-4
    xml = tmp_path / "model.xml"
    ov.save_model(converted, str(xml), compress_to_fp16=False)
    consts = [(t, s.replace(" ", "")) for t, s in re.findall(r"<data element_type=\"(\w+)\" shape=\"([\d, ]+)\"", xml.read_text())]
    assert ("i8", f"{VOCAB},{HIDDEN}") in consts
    assert ("f32", f"{VOCAB},{HIDDEN}") not in consts


def _gather_model(table: np.ndarray, *, tied: bool = False) -> onnx.ModelProto:
    """ids -> Gather(table) [-> MatMul(table^T) when tied, as a language-model head shares the table]."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)]
    out = "rows"
    if tied:
        nodes += [helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["rows", "table_t"], ["scores"])]
        out = "scores"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_thresholds_and_shared_tables_are_left_alone():
    rng = np.random.default_rng(0)
    big = rng.normal(size=(4096, 64)).astype(np.float32)  # 1.05 MB
    tied = _gather_model(big, tied=True)
    assert quantize_embeddings(tied).tables == []  # also read by a MatMul: a tied projection keeps its floats
    small = _gather_model(big[:100])
    assert quantize_embeddings(small, min_bytes=10**6, min_share=1.01).tables == []  # under both thresholds
    assert len(quantize_embeddings(_gather_model(big[:100]), min_share=0.25).tables) == 1  # the whole model
    plain = _gather_model(big)
    report = quantize_embeddings(plain)
    assert len(report.tables) == 1 and report.tables[0]["bytes_before"] == big.nbytes


def test_snapped_tables_are_the_ones_the_export_stores_and_it_stores_them_exactly(tmp_path, tiny_bert):
    """qat/ptq put the word table on its int8 grid before quantizing (snap_embedding_tables): the export's
    rounding then changes nothing, so the artifact reads the rows the measured torch model read."""
    from pruneflow.export.embedding import snap_embedding_tables

    model, ids, _ = tiny_bert
    snapped_model = copy.deepcopy(model)
    names = snap_embedding_tables(snapped_model)
    # every table of 2+ columns and 1 KiB+: the word and the 512x64 position tables, not the 2x64 token-type one
    assert names == ["model.bert.embeddings.word_embeddings.weight", "model.bert.embeddings.position_embeddings.weight"]
    table = snapped_model.model.bert.embeddings.word_embeddings.weight
    assert not table.requires_grad  # frozen: trained further it would leave its grid
    before = model.model.bert.embeddings.word_embeddings.weight.detach()
    q, scale = quantize_rows(before.numpy())
    np.testing.assert_array_equal(table.detach().numpy(), q * scale[:, None])
    path = tmp_path / "snapped.onnx"
    export_onnx(snapped_model, ids, path)
    proto = onnx.load(str(path))
    report = quantize_embeddings(proto, on_grid=True)  # what the INT8 export does: exactly the snapped tables
    assert len(report.tables) == 2 and max(t["max_abs_error"] for t in report.tables) < 1e-6  # the same values
    # a tied table (also an output projection) is left alone, as the export leaves it
    tied = torch.nn.Sequential(torch.nn.Embedding(8000, 64), torch.nn.Linear(64, 8000))
    tied[1].weight = tied[0].weight
    assert snap_embedding_tables(tied) == [] and tied[0].weight.requires_grad


def test_rows_round_symmetrically_per_row():
    table = np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [1e-3, -1e-3, 0.0]], np.float32)
    q, scale = quantize_rows(table)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    np.testing.assert_array_equal(q[0], [0, 0, 0])
    np.testing.assert_allclose(scale, [1.0, 2 / 127, 1e-3 / 127], rtol=1e-6)
    np.testing.assert_array_equal(q[1], [64, -127, 32])
    assert np.abs(q * scale[:, None] - table).max() <= scale.max() / 2 + 1e-7


def test_cpu_int8_onnx_path_stores_a_float_embedding_as_int8(tmp_path):
    """The onnx target's INT8 path (export_int8_onnx, CPU form): an embedding NNCF left float, snapped by the
    quantization stage, is stored int8; one left off its grid stays float (rounding it there would change the
    model the stage measured)."""
    from pruneflow.export.embedding import snap_embedding_tables
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.export.onnx import export_int8_onnx
    from pruneflow.qat.nncf_quant import quantize, strip_quantizers
    from pruneflow.qat.settings import NncfSettings

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20000, 32)
            self.fc = torch.nn.Linear(32, 4)

        def forward(self, ids):
            return self.fc(self.emb(ids).mean(1))

    torch.manual_seed(0)
    ids = torch.randint(0, 20000, (64, 12))
    model = Bag().eval()
    unsnapped = strip_quantizers(quantize(copy.deepcopy(model), CalibrationSet(x=ids), NncfSettings(batch_size=16)), ids[:2])
    notes = export_int8_onnx(unsnapped, ids[:2], tmp_path / "unsnapped.onnx", form="cpu").notes
    assert not any("stored int8" in n for n in notes)
    assert snap_embedding_tables(model) == ["emb.weight"]  # what the qat and ptq stages do first
    quantized = quantize(model, CalibrationSet(x=ids), NncfSettings(batch_size=16, ignore=["emb"]))
    stripped = strip_quantizers(quantized, ids[:2])
    cpu, trt = tmp_path / "model.int8.onnx", tmp_path / "model.int8.tensorrt.onnx"
    report = export_int8_onnx(stripped, ids[:2], cpu, form="cpu")
    export_int8_onnx(stripped, ids[:2], trt, form="tensorrt")
    assert any("20000x32 stored int8 with per-row scales" in n for n in report.notes)
    proto = onnx.load(str(cpu))
    assert [t.dims for t in proto.graph.initializer if t.data_type == TensorProto.INT8 and list(t.dims) == [20000, 32]]
    assert cpu.stat().st_size < 20000 * 32 * 1.3 < trt.stat().st_size  # the TensorRT form keeps the float table
    got = _ort(cpu, ids)
    want = stripped(ids).detach().numpy()
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.shared_data
def test_minilm_table_before_and_after(tmp_path, shared_data):
    """The figure issue 13 asks for: MiniLM-L6's 30522x384 table, float vs int8 + scales."""
    from pruneflow.zoo.hf import bert_classifier

    model = bert_classifier(folder=str(shared_data / "minilm_l6_h384")).eval()
    ids = torch.randint(1, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "fp32.onnx"
    export_onnx(model, ids, path)
    proto = onnx.load(str(path))
    report = quantize_embeddings(proto)
    table = report.tables[0]
    assert table["shape"] == [30522, 384]
    assert table["bytes_before"] == 46_881_792 and table["bytes_after"] == 30522 * 384 + 4 * 30522  # 11.84 MB
    onnx.save(proto, str(tmp_path / "int8emb.onnx"))
    assert path.stat().st_size - (tmp_path / "int8emb.onnx").stat().st_size > 35_000_000
    got, original = _ort(tmp_path / "int8emb.onnx", ids), _ort(path, ids)
    assert (got.argmax(-1) == original.argmax(-1)).all() and np.abs(got - original).max() < 0.01
