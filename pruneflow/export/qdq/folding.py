"""Folding passes: weight quantizers applied offline, BatchNorm and SmoothQuant scales folded into the weighted op
before them, Gemm biases stored as int32 (``pruneflow.export.qdq``'s docstring: why each is exact)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .graph import _attr, _bcast, _Graph, PassReport, _quantize, _set_attr, _stored_out_axis, _toposort


def fold_weight_quantizers(graph: _Graph, report: PassReport) -> None:
    """``QuantizeLinear(constant W) -> DequantizeLinear`` becomes ``DequantizeLinear(int8 W)``."""
    dead = []
    for q in list(graph.g.node):
        if q.op_type != "QuantizeLinear":
            continue
        w = graph.const(q.input[0])
        scale = graph.const(q.input[1])
        zp = graph.const(q.input[2]) if len(q.input) > 2 and q.input[2] else np.zeros((), np.uint8)
        if w is None or scale is None or zp is None or w.ndim < 1:  # any constant (LayerNorm weights too)
            continue
        axis = _attr(q, "axis", 1)
        axis = axis + w.ndim if axis < 0 else axis
        narrow = scale.ndim == 1 and scale.size > 1 and zp.dtype == np.int8  # NNCF weights: -127..127
        qw = _quantize(w, scale, zp, axis)
        if narrow:
            qw = np.clip(qw, -127, 127).astype(np.int8)
        name = graph.add_init(q.input[0] + "_int8", qw)
        graph.float_weights[name] = w
        for dq in graph.consumers.get(q.output[0], []):
            dq.input[0] = name
        dead.append(q)
        report.weights_folded += 1
    graph.remove(dead)


def fold_batchnorm(graph: _Graph, report: PassReport) -> None:
    """``DQ(int8 W, s) -> Conv -> BatchNormalization`` becomes ``DQ(±W, s|k|) -> Conv(+bias)`` (exact)."""
    dead = []
    for bn in list(graph.g.node):
        if bn.op_type != "BatchNormalization":
            continue
        conv = graph.producer.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or graph.only_consumer(conv.output[0]) is not bn:
            continue
        dq = graph.producer.get(conv.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in graph.inits:
            continue
        if len(graph.consumers.get(dq.output[0], [])) != 1:
            continue
        # Only constants fold offline; a statistic, scale or bias computed at run time keeps the BatchNorm.
        gamma, beta, mean, var = (graph.const(n) for n in bn.input[1:5])
        if gamma is None or beta is None or mean is None or var is None:
            continue
        scale = graph.const(dq.input[1])
        bias = graph.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros_like(mean)
        if scale is None or bias is None:
            continue
        eps = _attr(bn, "epsilon", 1e-5)
        k = (gamma / np.sqrt(var + eps)).astype(np.float32)
        qw = graph.nh.to_array(graph.inits[dq.input[0]])
        zp = graph.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros((), qw.dtype)
        axis = _attr(dq, "axis", 1)
        if scale.ndim != 1 or axis != 0 or np.any(zp != 0) or qw.dtype != np.int8 or qw.min() < -127:
            report.notes.append(f"BatchNorm {bn.name} kept: its conv's weights are not per-channel symmetric narrow-range")
            continue
        sign = np.where(k < 0, -1, 1).astype(np.int8)
        new_w = (qw * sign.reshape(-1, *([1] * (qw.ndim - 1)))).astype(np.int8)
        new_scale = (scale.astype(np.float32) * np.abs(k)).astype(np.float32)
        new_bias = ((bias - mean) * k + beta).astype(np.float32)
        dq.input[0] = graph.add_init(dq.input[0] + "_bnfold", new_w)
        dq.input[1] = graph.add_init(dq.input[1] + "_bnfold", new_scale)
        if len(dq.input) > 2 and dq.input[2]:
            dq.input[2] = graph.add_init(dq.input[2] + "_bnfold", np.zeros(new_scale.shape, np.int8))
        b = graph.add_init(conv.name + "_bnfold_bias", new_bias)
        if len(conv.input) > 2:
            conv.input[2] = b
        else:
            conv.input.append(b)
        # The conv now writes what the BatchNorm wrote.
        conv.output[0] = bn.output[0]
        dead.append(bn)
        report.batchnorms_folded += 1
    graph.remove(dead)


def _scale_chain(graph: _Graph, mul) -> tuple[Any, Any, Any, np.ndarray] | None:
    """For ``Mul(t, c)``: ``(weighted op, its bias Add or None, weight DQ, c)`` when t is a weighted op's
    output, through an optional bias ``Add`` (a MatMul's) and an optional ``Relu``, each read by the next only."""
    consts = [graph.const(i) for i in mul.input]
    if len(mul.input) != 2 or (consts[0] is None) == (consts[1] is None) or mul.output[0] in graph.outputs:
        return None
    t = mul.input[1] if consts[0] is not None else mul.input[0]
    c = consts[0] if consts[0] is not None else consts[1]
    if c is None or c.dtype != np.float32 or not np.all(np.isfinite(c)) or np.any(c <= 0):
        return None
    node, add = graph.producer.get(t), None
    for kind in ("Relu", "Add"):
        if node is not None and node.op_type == kind and graph.only_consumer(node.output[0]) is not None:
            if kind == "Relu":
                node = graph.producer.get(node.input[0])
            elif sum(graph.const(i) is not None for i in node.input) == 1:
                add, node = node, graph.producer.get(next(i for i in node.input if graph.const(i) is None))
    if node is None or node.op_type not in ("Gemm", "MatMul", "Conv") or graph.only_consumer(node.output[0]) is None:
        return None
    if add is not None and node.op_type != "MatMul":
        return None
    wdq = graph.producer.get(node.input[1])
    if wdq is not None and wdq.op_type == "Transpose" and graph.only_consumer(wdq.output[0]) is node:
        wdq = graph.producer.get(wdq.input[0])
    if wdq is None or wdq.op_type != "DequantizeLinear" or len(graph.consumers.get(wdq.output[0], [])) != 1:
        return None
    return node, add, wdq, c


def fold_smooth_quant_scales(graph: _Graph, report: PassReport) -> None:
    """``W -> [Add b] -> [Relu] -> Mul(c)`` (c > 0 per output channel: NNCF's SmoothQuant scale for the next
    layer) folds into W's per-channel scales and its bias: exact, since DQ(q, s) c == DQ(q, s c) and
    relu(x) c == relu(x c) for c > 0.

    onnxruntime fuses ``DQ -> Gemm/MatMul/Conv [-> Relu] -> Q`` into an integer QGemm/QLinearConv only when
    the quantizer follows directly: a Mul in between leaves the op in float (measured: every Gemm of a
    DeepFM's MLP ran in float in its "INT8" ONNX). A Mul after a LayerNorm (a transformer's) stays, since
    the LayerNorm's output also feeds the residual stream. No library we use does this on a QDQ graph.
    """
    dead = []
    for mul in list(graph.g.node):
        found = _scale_chain(graph, mul) if mul.op_type == "Mul" else None
        if found is None:
            continue
        node, add, wdq, c = found
        w, scale = graph.const(wdq.input[0]), graph.const(wdq.input[1])
        if w is None or scale is None:
            continue
        out_axis = _stored_out_axis(graph, node, w)
        if out_axis is None:
            continue
        channels = int(w.shape[out_axis])
        per_channel_ok = scale.size == channels and _attr(wdq, "axis", 1) % w.ndim == out_axis
        if not (per_channel_ok or scale.size == 1 and out_axis == 0):  # the convention keeps weight scales on axis 0
            continue
        if c.size not in (1, channels) or (c.size > 1 and not _channel_axis(c, node)):
            continue
        vec = np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float32)
        wdq.input[1] = graph.add_init(wdq.input[1] + "_smooth", (scale.reshape(-1) * vec).astype(np.float32))
        _set_attr(wdq, "axis", out_axis)
        if wdq.input[0] in graph.float_weights:  # the float weights behind the int8 ones scale with them
            graph.float_weights[wdq.input[0]] = graph.float_weights[wdq.input[0]] * _bcast(vec, out_axis, w.ndim)
        owner, index = (node, 2) if add is None else (add, next(i for i, n in enumerate(add.input) if graph.const(n) is not None))
        bias = graph.const(owner.input[index]) if len(owner.input) > index and owner.input[index] else None
        if bias is not None:
            owner.input[index] = graph.add_init(owner.input[index] + "_smooth", (bias * vec).astype(bias.dtype))
        source = next(i for i in mul.input if graph.const(i) is None)
        for user in graph.consumers.get(mul.output[0], []):
            user.input[:] = [source if n == mul.output[0] else n for n in user.input]
        dead.append(mul)
        report.smooth_quant_folded += 1
    graph.remove(dead)


def _channel_axis(c: np.ndarray, node) -> bool:
    """Whether a per-channel constant lies on the op output's channel axis (last for Gemm/MatMul, 1 for Conv)."""
    dims = [i for i, d in enumerate(c.shape) if d > 1]
    if len(dims) != 1:
        return False
    return dims[0] == c.ndim - 1 if node.op_type != "Conv" else c.ndim - dims[0] == 3


def quantize_gemm_biases(graph: _Graph, report: PassReport) -> None:
    """A Gemm whose data and weights are dequantized gets its float bias as int32 on the scale ``a_scale * w_scale``
    (per output channel, zero point 0) behind a DequantizeLinear: onnxruntime fuses DQ -> Gemm into QGemm only when
    every input is dequantized (its QDQ Gemm selector wants an int32 bias), as its own ``quantize_static`` writes it.
    The bias moves by at most half a step of that product, far below the int8 grid of the output."""
    from onnx import helper

    added = []
    for node in [n for n in graph.g.node if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]]:
        a_dq, w_dq = graph.producer.get(node.input[0]), graph.producer.get(node.input[1])
        bias = graph.const(node.input[2])
        if (a_dq is None or w_dq is None or a_dq.op_type != "DequantizeLinear" or w_dq.op_type != "DequantizeLinear"
                or bias is None or bias.ndim != 1 or _attr(node, "beta", 1.0) != 1.0 or _attr(node, "alpha", 1.0) != 1.0):
            continue
        a_scale, w_scale = graph.const(a_dq.input[1]), graph.const(w_dq.input[1])
        if a_scale is None or w_scale is None or a_scale.size != 1 or w_scale.size not in (1, bias.size):
            continue
        scale = (np.broadcast_to(w_scale.reshape(-1), bias.shape) * a_scale.reshape(())).astype(np.float32)
        q = np.clip(np.round(bias / scale), np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
        stored = graph.add_init(node.name + "_bias_int32", q)
        scale_name = graph.add_init(node.name + "_bias_scale", scale)
        zero = graph.add_init(node.name + "_bias_zero", np.zeros(bias.shape, np.int32))
        dq = helper.make_node("DequantizeLinear", [stored, scale_name, zero], [node.name + "_bias_dq"],
                              name=node.name + "_bias_dq", axis=0)
        node.input[2] = dq.output[0]
        added.append(dq)
        report.gemm_biases_quantized += 1
    if added:
        graph.g.node.extend(added)
        _toposort(graph)
