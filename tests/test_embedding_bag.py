"""nn.EmbeddingBag end to end (issue 37, item 3): exported in plain ops (pruneflow/export/bags.py) that onnxruntime
and OpenVINO run as torch computes, the table a top-level Gather stored int8 row-wise like an nn.Embedding's, kept
whole by channel pruning, and the DLRM with bags of the zoo (pruneflow/zoo/bags.py)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from pruneflow.errors import ExportError
from pruneflow.export.bags import FixedLengthBag, exportable_bags
from pruneflow.export.embedding import quantize_embeddings, snap_embedding_tables
from pruneflow.export.onnx import export_onnx
from pruneflow.zoo.bags import dlrm_bags

#: What a bag must never become in the graph: the legacy exporter's and dynamo's way of writing a bag.
LOOP_OPS = {"Loop", "SequenceConstruct", "SequenceInsert", "SequenceAt", "SequenceEmpty", "ConcatFromSequence"}


class OneBag(nn.Module):
    def __init__(self, mode: str, padding_idx: int | None, weighted: bool):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode=mode, padding_idx=padding_idx)
        self.weighted = weighted
        with torch.no_grad():
            self.bag.weight[0] = 3.0  # a padding row that is not zero: only the mask keeps it out

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.bag(ids, per_sample_weights=weights if self.weighted else None)


def _bag_inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (6, 5))
    ids[0] = 0  # all padding: torch gives zeros in every mode
    ids[1, :3] = 0  # partly padding: a mean over the 2 others
    return {"ids": ids, "weights": torch.rand(6, 5)}


def _runs(path, x: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The ONNX file's output in onnxruntime and in OpenVINO (converted from the ONNX, compiled in f32 on CPU)."""
    import onnxruntime as ort
    import openvino as ov

    names = [i.name for i in onnx.load(str(path)).graph.input]
    feed = {n: x[n].numpy() for n in names}
    got_ort = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    compiled = ov.Core().compile_model(ov.convert_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return got_ort, compiled(feed)[compiled.output(0)]


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


CASES = [("sum", None, False), ("sum", 0, False), ("sum", None, True), ("sum", 0, True), ("mean", None, False),
         ("mean", 0, False), ("max", None, False), ("max", 0, False)]


@pytest.mark.parametrize("mode, padding_idx, weighted", CASES)
def test_a_bag_exports_in_plain_ops_that_onnxruntime_and_openvino_run_as_torch_does(mode, padding_idx, weighted, tmp_path):
    model, x = OneBag(mode, padding_idx, weighted).eval(), _bag_inputs()
    with torch.no_grad():
        want = model(**x).numpy()
    if padding_idx is not None:
        assert not want[0].any()  # torch's answer for an all-padding bag, which the export must match
    export_onnx(model, x, tmp_path / "bag.onnx")  # the legacy exporter alone refuses padding_idx
    got_ort, got_ov = _runs(tmp_path / "bag.onnx", x)
    assert np.abs(got_ort - want).max() < 2e-6 and np.abs(got_ov - want).max() < 2e-6
    ops = _ops(tmp_path / "bag.onnx")
    assert not ops & LOOP_OPS and "Gather" in ops
    assert isinstance(model.bag, nn.EmbeddingBag)  # the caller's model is untouched: the export swaps a copy


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_the_dynamo_exporter_writes_the_same_plain_ops(mode, tmp_path):
    model, x = OneBag(mode, 0, mode == "sum").eval(), _bag_inputs()
    with torch.no_grad():
        want = model(**x).numpy()
    export_onnx(model, x, tmp_path / "bag.onnx", exporter="dynamo")
    got_ort, got_ov = _runs(tmp_path / "bag.onnx", x)
    assert np.abs(got_ort - want).max() < 2e-6 and np.abs(got_ov - want).max() < 2e-6
    assert not _ops(tmp_path / "bag.onnx") & LOOP_OPS


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_offsets_bags_are_refused_naming_the_module_and_the_fix(exporter, tmp_path):
    class Offsets(nn.Module):
        def __init__(self):
            super().__init__()
            self.clicks = nn.EmbeddingBag(50, 8, padding_idx=0)

        def forward(self, ids, offsets):
            return self.clicks(ids, offsets)

    x = {"ids": torch.randint(0, 50, (10,)), "offsets": torch.tensor([0, 4])}
    with pytest.raises(ExportError, match=r"clicks \(nn.EmbeddingBag\) is called with 1-D ids and offsets") as err:
        export_onnx(Offsets(), x, tmp_path / "bag.onnx", exporter=exporter)
    assert "fixed-length 2-D bags" in (err.value.hint or "")


def test_a_bag_with_max_norm_is_refused_and_a_model_without_bags_is_not_copied():
    with pytest.raises(ExportError, match="max_norm"):
        exportable_bags(nn.Sequential(nn.EmbeddingBag(10, 4, max_norm=1.0)))
    plain = nn.Sequential(nn.Linear(2, 2))
    assert exportable_bags(plain) == (plain, [])
    model = OneBag("sum", 0, False)
    swapped, notes = exportable_bags(model)
    assert isinstance(swapped.bag, FixedLengthBag) and isinstance(model.bag, nn.EmbeddingBag) and len(notes) == 1
    assert torch.equal(swapped.bag.weight, model.bag.weight) and swapped.bag.weight is not model.bag.weight


def _dlrm(mode: str = "sum", cardinalities: list[int] | None = None, dim: int = 16):
    torch.manual_seed(0)
    cards = [7, 50] if cardinalities is None else cardinalities
    model = dlrm_bags(cards, [300, 400, 30], 4, 3, embedding_dim=dim, hidden=32, mode=mode).eval()
    n = 64
    bags = torch.randint(1, 30, (n, 3, 4))
    bags[0] = 0
    bags[1, :, 2:] = 0
    ids = torch.stack([torch.randint(0, c, (n,)) for c in cards], 1) if cards else torch.zeros(n, 0, dtype=torch.long)
    return model, {"ids": ids, "bags": bags, "dense": torch.randn(n, 3)}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_dlrm_bags_gives_one_logit_and_exports_without_a_loop(mode, tmp_path):
    model, x = _dlrm(mode)
    with torch.no_grad():
        want = model(**x).numpy()
    assert want.shape == (64, 1)
    with pytest.raises(ValueError, match=r"bags must be \[batch, 3, 4\]"):
        model(x["ids"], x["bags"][:, :, :3], x["dense"])
    export_onnx(model, x, tmp_path / "dlrm.onnx")
    got_ort, got_ov = _runs(tmp_path / "dlrm.onnx", x)
    assert np.abs(got_ort - want).max() < 1e-6 and np.abs(got_ov - want).max() < 1e-6
    assert not _ops(tmp_path / "dlrm.onnx") & LOOP_OPS


def test_bag_tables_are_snapped_and_stored_int8_row_wise_as_embedding_tables_are(tmp_path):
    model, x = _dlrm(dim=64)
    snapped = snap_embedding_tables(model)
    assert {"bags.0.weight", "bags.1.weight", "bags.2.weight"} <= set(snapped)
    with torch.no_grad():
        want = model(**x).numpy()
    export_onnx(model, x, tmp_path / "m.onnx")
    proto = onnx.load(str(tmp_path / "m.onnx"))
    report = quantize_embeddings(proto, on_grid=True)  # found as top-level Gather tables, as nn.Embedding's are
    stored = {t["shape"][0]: t for t in report.tables}
    for rows in (300, 400, 30):
        table = stored[rows]
        assert table["bits"] == 8 and table["max_abs_error"] < 1e-6
        assert table["bytes_before"] == rows * 64 * 4 and table["bytes_after"] == rows * (64 + 4)  # int8 + a scale a row
        assert table["bytes_before"] / table["bytes_after"] > 3.7
    onnx.save(proto, str(tmp_path / "q.onnx"))
    got_ort, got_ov = _runs(tmp_path / "q.onnx", x)
    assert np.abs(got_ort - want).max() < 1e-6 and np.abs(got_ov - want).max() < 1e-6


def test_the_int8_export_of_a_quantized_dlrm_keeps_nncf_quantizers_on_the_bags_and_stores_their_tables_int8(tmp_path):
    """The INT8 path traces the NNCF-stripped model (export_int8_onnx -> export_raw_qdq -> export_onnx): its bags are
    swapped too, and the quantizers NNCF hung on each bag's output (named after the embedding_bag op) still run (the
    tensorrt form keeps them; the cpu form drops those that feed only float ops)."""
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.export.onnx import export_int8_onnx
    from pruneflow.qat.nncf_quant import quantize, strip_quantizers
    from pruneflow.qat.settings import NncfSettings

    model, x = _dlrm()
    snap_embedding_tables(model)  # what the qat and ptq stages do first
    stripped = strip_quantizers(quantize(copy.deepcopy(model), CalibrationSet(x=x), NncfSettings(batch_size=16)), x)
    swapped, _ = exportable_bags(stripped)
    with torch.no_grad():
        want = stripped(**x)
        assert torch.allclose(swapped(**x), want, atol=1e-6)  # the bag outputs' fake-quant still runs after the swap
        assert (want - model(**x)).abs().max() > 1e-5  # (and does something: the quantized model is not the float one)
    report = export_int8_onnx(stripped, x, tmp_path / "model.int8.onnx", form="cpu")
    assert sum("stored int8 with per-row scales" in n for n in report.notes) == 4  # 3 bags, the 50-row table (7 rows: < 1 KiB)
    proto = onnx.load(str(tmp_path / "model.int8.onnx"))
    # the three bags' tables stored once each, stacked into one (stacked.py: one read for the three bags)
    assert 300 + 400 + 30 in {t.dims[0] for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert sum("summed bag table reads (input columns [0, 1, 2]) stacked" in n for n in report.notes) == 1
    assert not {n.op_type for n in proto.graph.node} & LOOP_OPS
    got_ort, got_ov = _runs(tmp_path / "model.int8.onnx", x)
    scale = np.abs(want.numpy()).max()  # the cpu form's weights are re-gridded for u8s8 kernels: close, not equal
    assert np.abs(got_ort - want.numpy()).max() < 0.05 * scale and np.abs(got_ov - want.numpy()).max() < 0.05 * scale
    # The tensorrt form keeps NNCF's grids as they are: OpenVINO computes its Q/DQ graph as the stripped torch model
    # does, to float rounding, so every quantizer (those on the bags' outputs too) is in the graph where torch ran it.
    export_int8_onnx(stripped, x, tmp_path / "model.int8.tensorrt.onnx", form="tensorrt")
    _, exact = _runs(tmp_path / "model.int8.tensorrt.onnx", x)
    assert np.abs(exact - want.numpy()).max() < 1e-6


@pytest.mark.parametrize("cardinalities", [[], [7, 50]], ids=["bags_only", "with_tables"])
def test_channel_pruning_keeps_every_bag_table_whole(cardinalities, tmp_path):
    from pruneflow.prune.channels import check_prunable
    from pruneflow.prune.engine import PruneOptions, measure, prune_step
    from pruneflow.prune.importance import magnitude_saliency

    model, x = _dlrm(cardinalities=cardinalities)
    ignored = check_prunable(model, None, lambda *keys: ("stages", 0, *keys), x)  # what the prune stage keeps whole
    assert {"bags.0", "bags.1", "bags.2", "bottom.2"} <= set(ignored)  # the bags and the layer tied to their columns
    before = measure(model, x, ignored)
    prune_step(model, x, magnitude_saliency(model), 0.5, PruneOptions(ignored=ignored))
    assert measure(model, x, ignored)["macs"] < before["macs"]  # it did prune
    assert [b.weight.shape for b in model.bags] == [(300, 16), (400, 16), (30, 16)]
    assert all(b.embedding_dim == 16 for b in model.bags) and model.bottom[2].out_features == 16
    with torch.no_grad():
        want = model(**x).numpy()
    export_onnx(model, x, tmp_path / "pruned.onnx")
    got_ort, _ = _runs(tmp_path / "pruned.onnx", x)
    assert np.abs(got_ort - want).max() < 1e-5


def test_table_pruning_leaves_bags_whole_and_says_why():
    from pruneflow.prune.tables import bag_note, candidate_tables

    model, _ = _dlrm(cardinalities=[7, 500])
    assert candidate_tables(model, 100) == ["tables.1"]
    note = bag_note(model)
    assert note is not None and note.startswith("3 nn.EmbeddingBag table(s) left whole (bags.0 (300 rows)")
    assert bag_note(nn.Sequential(nn.Embedding(3, 2))) is None
