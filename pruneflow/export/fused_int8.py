"""An INT8 transformer in onnxruntime's fused ops, with the quantization parameters NNCF trained (issue 25, item 2).

onnxruntime's own path to a fast INT8 BERT on CPU is its transformer optimizer (``fusion.py``) and then
``quantize_dynamic``: ``QAttention`` (Q, K and V in one integer GEMM, scores and softmax in one kernel) and integer
MatMuls whose activation scales are measured on every call. A QDQ graph cannot take that path (the optimizer
matches float weights only), so a QAT model's integer arithmetic stayed spread over separate MatMuls with a Q/DQ
on every attention input. This module builds the fused graph with the trained parameters instead:

1. a float *scaffold* of the QDQ graph (the ``s8s8`` cpu form): each weighted MatMul reads its dequantized
   int8 weights as a float initializer, each activation Q/DQ pair and SmoothQuant ``Mul`` is bypassed, and what
   each MatMul's weights were trained with (int8 values, per-channel scales, input scale and zero point,
   SmoothQuant vector) is kept, keyed by the float weights' bytes;
2. onnxruntime's transformer optimizer fuses the scaffold (``fusion.pin_head_counts`` first: per-layer heads);
3. each fused weight is looked up by its bytes (an ``Attention``'s Q, K and V blocks one by one) and the op is
   replaced: ``Attention`` by ``QAttention`` on the trained int8 weights, a MatMul by ``MatMulIntegerToFloat``;
   their inputs are quantized with the trained scale (``static``: one ``QuantizeLinear``, the SmoothQuant ``Mul``
   before it) or measured per call (``dynamic``: ``DynamicQuantizeLinear``, as ``quantize_dynamic`` does).
   A SmoothQuant vector on an attention output is folded into the V projection's scales and bias (exact: the
   attention output is linear in V channel by channel); the bias of a MatMul goes into its MatMulIntegerToFloat.
   The others (after a LayerNorm whose output also feeds the residual stream, after a GELU) stay a ``Mul``:
   folded into a per-channel ``QuantizeLinear`` instead, onnxruntime 1.32 ran the model 5x slower.

The scores and softmax run in float inside ``QAttention`` (NNCF had quantized the Q and K inputs of the score
MatMul), as do the pooler and classifier Gemms (their activation Q/DQ bypassed with the rest): where the graph
computes more precisely than the trained model. The caller compares the result with the quantized torch model
(``forms.choose``) and times it against the QDQ forms; none of this is in onnxruntime, NNCF or torch, so it is
written here. Static activations are uint8 with zero point 128 (the int8 grid, shifted; ``dynamic``: whatever
``DynamicQuantizeLinear`` measures): exact where the CPU has VNNI, AMX or no int16 pair sums, like ``u8s8_vnni``.
``dynamic`` makes a row's result depend on the rows batched with it (the scale is the batch's), so the onnx
target times it only when the recipe pins `form: fused_dynamic`.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import ExportError
from .embedding import quantize_embeddings
from .fusion import optimize_bert, pin_head_counts
from .qdq.graph import _attr, _Graph

Mode = Literal["static", "dynamic"]
#: The onnx target's cpu-form encodings this module writes (``fused``: static, ``fused_dynamic``: dynamic).
FUSED_ENCODINGS = ("fused", "fused_dynamic")
#: Those ``form: auto`` tries: a dynamic one's outputs for a row depend on its batch-mates, never chosen unasked.
AUTO_FUSED = ("fused",)
MS = "com.microsoft"


@dataclass
class _Trained:
    """How one MatMul's weights were quantized: int8 values laid out as the MatMul reads them ([in, out]), their
    per-output-channel scales, the input's scale and uint8 zero point, and the SmoothQuant vector on the input."""

    q: np.ndarray
    scale: np.ndarray
    a_scale: float
    a_zero: int
    smooth: np.ndarray | None


@dataclass
class FusedReport:
    heads: list[int] = field(default_factory=list)
    attention: int = 0
    matmuls: int = 0
    float_matmuls: int = 0
    smooth_folded: int = 0
    notes: list[str] = field(default_factory=list)


def _key(w: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(w, dtype=np.float32).tobytes()).hexdigest()


def _weight(graph: _Graph, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(int8 [in, out], scales [out]) of a MatMul's B input ``DQ(int8 const)`` (through a Transpose), else None."""
    node, transposed = graph.producer.get(name), False
    if node is not None and node.op_type == "Transpose":
        node, transposed = graph.producer.get(node.input[0]), True
    if node is None or node.op_type != "DequantizeLinear":
        return None
    q, scale = graph.const(node.input[0]), graph.const(node.input[1])
    zero = graph.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if q is None or scale is None or q.dtype != np.int8 or q.ndim != 2 or (zero is not None and np.any(zero != 0)):
        return None
    axis = _attr(node, "axis", 1) % 2  # per-channel scales must lie on the MatMul's output axis (1 of [in, out])
    if scale.size > 1 and (scale.size != q.shape[axis] or (1 - axis if transposed else axis) != 1):
        return None
    q = q.T if transposed else q
    return q, np.broadcast_to(scale.reshape(-1).astype(np.float32), (q.shape[1],)).copy()


def _activation(graph: _Graph, name: str) -> tuple[str, float, int, np.ndarray | None] | None:
    """(source tensor, scale, uint8 zero point, SmoothQuant vector) for ``DQ(Q(x))`` with x = ``Mul(source, c)`` or
    the source itself; None when ``name`` is not a per-tensor activation quantizer's output."""
    dq = graph.producer.get(name)
    qn = graph.producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if qn is None or qn.op_type != "QuantizeLinear":
        return None
    scale, zero = graph.const(qn.input[1]), graph.const(qn.input[2]) if len(qn.input) > 2 else np.zeros((), np.uint8)
    if scale is None or zero is None or scale.size != 1 or zero.size != 1:
        return None
    u8_zero = int(zero.reshape(-1)[0]) + (128 if zero.dtype == np.int8 else 0)
    source, smooth = qn.input[0], None
    mul = graph.producer.get(source)
    if mul is not None and mul.op_type == "Mul":
        consts = [graph.const(i) for i in mul.input]
        vec = next((c for c in consts if c is not None and c.size > 1), None)
        if vec is not None and sum(c is None for c in consts) == 1 and vec.shape[-1] == vec.size:
            smooth, source = vec.reshape(-1).astype(np.float32), next(i for i, c in zip(mul.input, consts) if c is None)
    return source, float(scale.reshape(-1)[0]), u8_zero, smooth


def scaffold(model) -> dict[str, _Trained | None]:
    """Turn the s8s8 QDQ graph into its float scaffold in place (see the module docstring); return what each
    weighted MatMul was trained with, keyed by its float weights' bytes (None for weights two MatMuls share with
    different input quantizers: ambiguous, left in float)."""
    graph = _Graph(model)
    trained: dict[str, _Trained | None] = {}
    matched = []
    for node in [n for n in graph.g.node if n.op_type == "MatMul"]:
        weight, act = _weight(graph, node.input[1]), _activation(graph, node.input[0])
        if weight is None or act is None:
            continue
        q, scale = weight
        w = (q.astype(np.float32) * scale[None, :]).astype(np.float32)
        found, key = _Trained(q, scale, *act[1:]), _key(w)
        earlier = trained.get(key)
        trained[key] = found if key not in trained or (earlier is not None and _same_trained(earlier, found)) else None
        matched.append((node, key, w, act[0]))
    for node, key, w, source in matched:  # an ambiguous one keeps its Mul and Q/DQ: a float MatMul the fusion skips
        if trained[key] is not None:
            node.input[1] = graph.add_init(node.name + "_w", w)
            node.input[0] = source
    graph.refresh()
    for dq in [n for n in graph.g.node if n.op_type == "DequantizeLinear"]:  # the activation pairs left (attention inputs)
        qn = graph.producer.get(dq.input[0])
        if qn is not None and qn.op_type == "QuantizeLinear" and dq.output[0] not in graph.outputs:
            for user in graph.consumers.get(dq.output[0], []):
                user.input[:] = [qn.input[0] if i == dq.output[0] else i for i in user.input]
    _drop_dead(graph)
    return trained


def _drop_dead(graph: _Graph) -> None:
    while True:
        graph.refresh()
        dead = [n for n in graph.g.node if all(o not in graph.consumers and o not in graph.outputs for o in n.output)]
        if not dead:
            break
        graph.remove(dead)
    graph.prune_initializers()


def build(model, mode: Mode = "static") -> tuple[object, FusedReport]:
    """The fused INT8 ModelProto built from an s8s8 cpu-form ``model`` (a copy is taken), and what it holds.
    Raises ExportError when the optimizer fuses no attention or a fused weight has no trained counterpart."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    if not any(n.op_type == "Softmax" for n in model.graph.node):
        raise ExportError("no attention (no Softmax): not a BERT-like encoder")
    work = type(model)()
    work.CopyFrom(model)
    trained = scaffold(work)
    report = FusedReport(heads=pin_head_counts(work))
    # the embedding tables on their int8 rows, as in the QDQ forms (a quarter of the bytes): onnxruntime's
    # EmbedLayerNormalization reads float tables only, so the embeddings' Add + LayerNormalization stay unfused
    report.notes += quantize_embeddings(work, on_grid=True).notes()
    if not report.heads:
        raise ExportError("no attention layer whose head count could be read: not a BERT-like encoder")
    with tempfile.TemporaryDirectory() as tmp:
        fused = optimize_bert(work, Path(tmp)).model
    graph = _Graph(fused)
    report.attention = sum(n.op_type == "Attention" for n in graph.g.node)
    if report.attention != len(report.heads):
        raise ExportError(f"onnxruntime's optimizer fused {report.attention} of {len(report.heads)} attention layers")
    _quantize(graph, trained, mode, report)
    _drop_dead(graph)
    OnnxModel.graph_topological_sort(graph.g)
    if not any(o.domain == MS for o in graph.model.opset_import):
        graph.model.opset_import.append(__import__("onnx").helper.make_opsetid(MS, 1))
    return graph.model, report


class _Quantizers:
    """One input quantizer per (tensor, scale, zero point, SmoothQuant vector), shared by the ops that read it."""

    def __init__(self, graph: _Graph, mode: Mode):
        self.graph, self.mode = graph, mode
        self.made: dict[tuple, tuple[str, str, str]] = {}
        self.nodes: list = []

    def __call__(self, x: str, scale: float, zero: int, smooth: np.ndarray | None) -> tuple[str, str, str]:
        """(quantized tensor, its scale, its zero point)."""
        from onnx import helper

        vec = None if smooth is None else _key(smooth)
        key = (x, scale, zero, vec) if self.mode == "static" else (x, vec)  # dynamic: the scale is measured per call
        if key in self.made:
            return self.made[key]
        g, base = self.graph, f"{x}_q{len(self.made)}"
        if smooth is not None:
            c = g.add_init(base + "_smooth", smooth.reshape(-1))
            self.nodes.append(helper.make_node("Mul", [x, c], [base + "_smoothed"], name=base + "_smooth"))
            x = base + "_smoothed"
        if self.mode == "dynamic":
            outs = (base, base + "_scale", base + "_zero")
            self.nodes.append(helper.make_node("DynamicQuantizeLinear", [x], list(outs), name=base))
        else:
            s, z = g.add_init(base + "_scale", np.array(scale, np.float32)), g.add_init(base + "_zero", np.array(zero, np.uint8))
            self.nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [base], name=base))
            outs = (base, s, z)
        self.made[key] = outs
        return outs


def _quantize(graph: _Graph, trained: dict[str, _Trained | None], mode: Mode, report: FusedReport) -> None:
    """Replace each fused Attention by QAttention and each MatMul with trained weights by MatMulIntegerToFloat."""
    quantize = _Quantizers(graph, mode)
    smooth_on = _attention_output_smoothing(graph, trained)
    new, dead = [], []
    for node in list(graph.g.node):
        if node.op_type == "Attention" and node.domain == MS:
            new.append(_qattention(graph, node, trained, quantize, smooth_on.get(node.output[0]), report))
            dead.append(node)
        elif node.op_type == "MatMul" and (w := graph.const(node.input[1])) is not None:
            t = trained.get(_key(w))
            if t is None:
                report.float_matmuls += 1
                continue
            if node.input[0] in smooth_on:  # folded into the V projection before this op
                t = _Trained(t.q, t.scale, t.a_scale, t.a_zero, None)
            made, replaced = _matmul(graph, node, t, quantize)
            new.append(made)
            dead += replaced
            report.matmuls += 1
    graph.g.node.extend(quantize.nodes + new)
    graph.remove(dead)
    if report.float_matmuls:
        report.notes.append(f"{report.float_matmuls} MatMul(s) left in float (weights NNCF did not quantize, or that two "
                            "MatMuls share with different input quantizers)")


def _attention_output_smoothing(graph: _Graph, trained: dict[str, _Trained | None]) -> dict[str, np.ndarray]:
    """{Attention output: SmoothQuant vector} where every reader of the output is a trained MatMul with the same
    vector on its input: folded into the V projection (``_qattention``)."""
    out: dict[str, np.ndarray] = {}
    for node in graph.g.node:
        if node.op_type != "Attention" or node.domain != MS:
            continue
        vecs: list[np.ndarray | None] = []
        for r in graph.consumers.get(node.output[0], []):
            w = graph.const(r.input[1]) if r.op_type == "MatMul" and r.input[0] == node.output[0] else None
            t = trained.get(_key(w)) if w is not None else None
            vecs.append(t.smooth if t is not None else None)
        first = vecs[0] if vecs else None
        if first is not None and all(_same(v, first) for v in vecs):
            out[node.output[0]] = first
    return out


def _qattention(graph: _Graph, node, trained: dict[str, _Trained | None], quantize: _Quantizers, v_smooth: np.ndarray | None,
                report: FusedReport):
    from onnx import helper

    w, bias = graph.const(node.input[1]), graph.const(node.input[2])
    found = [trained.get(_key(b)) for b in np.split(w, 3, axis=1)] if w is not None else []
    blocks = [b for b in found if b is not None]
    if len(blocks) != 3 or bias is None:
        raise ExportError(f"fused attention {node.name}: its Q, K and V weights have no trained INT8 counterpart")
    if len({b.a_zero for b in blocks}) != 1 or not all(_same(b.smooth, blocks[0].smooth) for b in blocks):
        raise ExportError(f"fused attention {node.name}: Q, K and V were trained with different input zero points or "
                          "SmoothQuant vectors")
    if any(a.name == "qkv_hidden_sizes" for a in node.attribute):
        raise ExportError(f"fused attention {node.name}: Q, K and V of different widths (QAttention has one width)")
    if len({b.a_scale for b in blocks}) > 1:  # one quantizer reads the shared input: the widest of the trained grids
        report.notes.append(f"{node.name}: Q, K and V read their shared input on trained scales "
                            f"{', '.join(f'{b.a_scale:.6g}' for b in blocks)}; QAttention quantizes it once, on the largest")
    scales = np.concatenate([b.scale for b in blocks]).astype(np.float32)
    bias = bias.astype(np.float32).copy()
    if v_smooth is not None:  # attention output channel j is V's channel j
        width = blocks[2].q.shape[1]
        scales[-width:] *= v_smooth
        bias[-width:] *= v_smooth
        report.smooth_folded += 1
    xq, s, z = quantize(node.input[0], max(b.a_scale for b in blocks), blocks[0].a_zero, blocks[0].smooth)
    name = node.name + "_int8"
    inputs = [xq, graph.add_init(name + "_w", np.concatenate([b.q for b in blocks], axis=1)),
              graph.add_init(name + "_b", bias), s, graph.add_init(name + "_wscale", scales),
              node.input[3] if len(node.input) > 3 else "", z,
              graph.add_init(name + "_wzero", np.zeros(scales.size, np.int8))]
    kept = ("num_heads", "unidirectional", "scale", "mask_filter_value", "do_rotary", "past_present_share_buffer")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in kept}
    return helper.make_node("QAttention", inputs, list(node.output[:1]), name=name, domain=MS, **attrs)


def _matmul(graph: _Graph, node, t: _Trained, quantize: _Quantizers) -> tuple[Any, list]:
    """MatMulIntegerToFloat for ``node``, taking in the bias of an ``Add`` that is its only reader (that Add's
    output becomes its output), and the nodes it replaces."""
    from onnx import helper

    xq, s, z = quantize(node.input[0], t.a_scale, t.a_zero, t.smooth)
    name = node.name + "_int8"
    inputs = [xq, graph.add_init(name + "_w", t.q), s, graph.add_init(name + "_wscale", t.scale), z,
              graph.add_init(name + "_wzero", np.zeros(t.scale.size, np.int8))]
    output = node.output[0]
    add = graph.only_consumer(output)
    bias = next((graph.const(i) for i in add.input if i != output), None) if add is not None and add.op_type == "Add" else None
    replaced = [node]
    if bias is not None and bias.dtype == np.float32 and bias.shape == (t.q.shape[1],):
        inputs.append(graph.add_init(name + "_bias", bias))
        output = add.output[0]
        replaced.append(add)
    return helper.make_node("MatMulIntegerToFloat", inputs, [output], name=name, domain=MS), replaced


def _same_trained(a: _Trained, b: _Trained) -> bool:
    return (a.a_scale, a.a_zero) == (b.a_scale, b.a_zero) and np.array_equal(a.q, b.q) and _same(a.smooth, b.smooth)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
