"""The attention-mask fill rewrite (pruneflow/export/attention_mask.py): finfo.min -> -60 before Softmax."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from pruneflow.export.attention_mask import FILL, soften_mask_fill
from pruneflow.export.onnx import export_onnx

MIN = np.finfo(np.float32).min


def _fills(model) -> dict[str, float]:
    return {i.name: float(numpy_helper.to_array(i)) for i in model.graph.initializer
            if i.data_type == TensorProto.FLOAT and not i.dims}


def test_a_bert_export_masks_with_the_soft_fill_and_still_matches_torch(tmp_path):
    from pruneflow.zoo.hf import bert_classifier

    model = bert_classifier(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=500, seed=0).eval()
    ids = torch.randint(1, 500, (6, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row, length in enumerate([20, 14, 9, 5, 3, 17]):
        ids[row, length:], mask[row, length:] = 0, 0
    batch = {"input_ids": ids, "attention_mask": mask}
    path = tmp_path / "bert.onnx"
    export_onnx(model, batch, path)
    fills = _fills(onnx.load(str(path)))
    assert FILL in fills.values() and min(fills.values()) > -1e30, fills  # finfo.min gone, -60 in its place
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {k: v.numpy() for k, v in batch.items()})[0]
    with torch.no_grad():
        out = model(**batch)
    want = getattr(out, "logits", out).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)  # a padded key now weighs exp(-60) at most: nothing measurable


def _graph(fill_readers: list[str]):
    """scores [2, 4] + Where(keep, 0, MIN) -> Softmax; ``fill_readers`` lists extra ops reading the MIN constant."""
    nodes = [helper.make_node("Where", ["keep", "zero", "fill"], ["bias"]),
             helper.make_node("Add", ["scores", "bias"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1)]
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [2, 4])]
    for k, op in enumerate(fill_readers):
        nodes.append(helper.make_node(op, ["scores", "fill"], [f"other{k}"]))
        outputs.append(helper.make_tensor_value_info(f"other{k}", TensorProto.FLOAT, [2, 4]))
    constants = [numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array(MIN, np.float32), "fill")]
    return _model(nodes, outputs, constants)


def _model(nodes: list, outputs: list, constants: list):
    inputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 4]), helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 4])]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, constants), opset_imports=[helper.make_opsetid("", 17)])


def test_only_a_fill_read_by_mask_wheres_alone_is_rewritten():
    model = _graph([])
    assert soften_mask_fill(model) == ["fill"] and _fills(model)["fill"] == FILL
    scores = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32) * 5
    keep = np.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probs = session.run(None, {"scores": scores, "keep": keep})[0]
    assert probs[~keep].max() < 1e-20  # masked keys still weigh nothing
    np.testing.assert_allclose(probs.sum(-1), 1, rtol=1e-6)
    shared = _graph(["Max"])  # the same constant also read by another op: a value that op needs, left alone
    assert soften_mask_fill(shared) == [] and _fills(shared)["fill"] == MIN


def test_a_fill_that_replaces_scores_is_left_alone():
    """``Where(keep, scores, -inf)`` (a mask that replaces masked scores, as masked_fill exports): -60 could
    outrank real scores there, so the fill stays."""
    nodes = [helper.make_node("Where", ["keep", "scores", "fill"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1)]
    model = _model(nodes, [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [2, 4])],
                   [numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")])
    assert soften_mask_fill(model) == [] and _fills(model)["fill"] == -np.inf
