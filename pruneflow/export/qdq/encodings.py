"""Activation encodings and their fit: each activation quantizer written in the form's encoding (int8 for tensorrt;
u8s8, u8s8_vnni or s8s8 for cpu), a ReLU taken into the integer domain, and the u8s8 weight fit that keeps x86
pair sums from saturating (``u8s8_overflow_risks``: what still could)."""

from __future__ import annotations

import numpy as np

from ...errors import ExportError

from .graph import _activation_zero_point, _attr, _bcast, convention, Form, _Graph, PASS_THROUGH, PassReport, _stored_out_axis, _toposort, WEIGHTED_OPS


def per_tensor_activations(graph: _Graph, report: PassReport) -> None:
    """tensorrt form: each per-channel activation quantizer (NNCF's choice before depthwise convolutions)
    becomes per-tensor with the largest of its channel scales, the only activation grid TensorRT takes.

    Every value the per-channel grid could hold stays in range; channels with a smaller scale lose
    resolution, so the artifact's parity (measured against the quantized torch model) shows the cost.
    Written by hand: no library we depend on converts activation quantizer granularity in an ONNX graph.
    """
    changed = []
    for q in graph.g.node:
        zp = _activation_zero_point(graph, q, per_channel=True)
        if q.op_type != "QuantizeLinear" or zp is None or zp.size == 1:
            continue
        scale = graph.const(q.input[1])
        assert scale is not None  # _activation_zero_point checked it
        one_scale = graph.add_init(q.input[1] + "_per_tensor", np.asarray(scale.max(), np.float32))
        one_zp = graph.add_init(q.input[2] + "_per_tensor", np.zeros((), zp.dtype))
        users = [c for c in graph.consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]
        for n in (q, *users):
            n.input[1], n.input[2] = one_scale, one_zp
            for a in [a for a in n.attribute if a.name == "axis"]:
                n.attribute.remove(a)
        changed.append(q.name)
    if changed:
        report.notes.append(f"{len(changed)} per-channel activation quantizer(s) written per-tensor with the largest channel "
                            "scale (TensorRT quantizes activations per tensor): " + ", ".join(changed[:5]))
    graph.refresh()


def _u8_zero_point(graph: _Graph, zps: dict[tuple[str, int], str], node, zp: np.ndarray, value: int) -> str:
    """The uint8 initializer (shared per int8 zero point and value) replacing ``node``'s int8 zero point."""
    if np.any(zp != 0):
        raise ExportError(f"{node.name}: an int8 activation zero point is not 0; expected symmetric activations")
    key = (node.input[2], value)
    if key not in zps:
        zps[key] = graph.add_init(f"{node.input[2]}_u8_{value}", np.full(zp.shape, value, np.uint8))
    return zps[key]


def _rewrite_cpu_quantizer(graph: _Graph, node, zp: np.ndarray, nonnegative: bool, zps: dict, report: PassReport,
                           guard: bool = True):
    """One int8 QuantizeLinear (and its DQs) as uint8: zero point 0 + Clip(0, 127) (``guard``; without it the
    full uint8 range) for a tensor that cannot be negative, zero point 128 otherwise. Returns the Clip node to
    add, or None."""
    from onnx import helper

    users = graph.consumers.get(node.output[0], [])
    dqs = [c for c in users if c.op_type == "DequantizeLinear" and c.input[1:3] == node.input[1:3]]
    # zero point 0 (and its Clip) only where every reader of the quantized tensor is its own DQ
    unsigned = nonnegative and len(dqs) == len(users) and node.output[0] not in graph.outputs
    name = _u8_zero_point(graph, zps, node, zp, 0 if unsigned else 128)
    for n in (node, *dqs):
        n.input[2] = name
    report.activations_rewritten += 1
    if unsigned:
        report.activations_unsigned += 1
    if not unsigned or not guard:
        return None
    # int8 saturates at 127 where uint8 would go on to 255: the Clip keeps the int8 grid exactly,
    # and keeps every integer dot product inside the u8s8 kernels' 16-bit pair sums (127 * 2 * 127).
    low = graph.add_init(node.name + "_u8_min", np.zeros((), np.uint8))
    high = graph.add_init(node.name + "_u8_max", np.full((), 127, np.uint8))
    clipped = node.output[0] + "_int8_range"
    for dq in dqs:
        dq.input[0] = clipped
    return helper.make_node("Clip", [node.output[0], low, high], [clipped], name=node.name + "_int8_range")


def _check_tensorrt_activations(graph: _Graph) -> None:
    for node in graph.g.node:
        zp = _activation_zero_point(graph, node)
        if zp is not None and zp.dtype == np.uint8:
            raise ExportError(
                f"{node.name}: an unsigned (uint8) activation quantizer cannot be written in TensorRT's int8 convention "
                "without changing its scale",
                hint="quantize with the qat/ptq defaults `preset: performance` and `activations: signed`, "
                "or write `int8_forms: [cpu]` only")


def rewrite_activations(graph: _Graph, form: Form, report: PassReport, guard: bool = True) -> None:
    """Per-tensor activation Q/DQ pairs into the target form's dtype (see the module docstring).

    cpu form: a tensor that cannot be negative (after a ReLU, a pooling of one, ...) becomes uint8 with
    zero point 0 followed by ``Clip(0, 127)`` (``guard``; without it, the full uint8 range); any other tensor
    becomes uint8 with zero point 128.
    """
    if convention(form).symmetric_activations:
        per_tensor_activations(graph, report)
        _check_tensorrt_activations(graph)
        graph.refresh()
        return
    memo: dict[str, bool] = {}
    for node in graph.g.node:  # decided on the graph as exported, before any rewrite below
        if node.op_type == "QuantizeLinear":
            _nonnegative(graph, node.input[0], memo)
    zps: dict[tuple[str, int], str] = {}
    clips = []
    for node in list(graph.g.node):
        zp = _activation_zero_point(graph, node, per_channel=True)
        # DQs follow their Q; an unsigned quantizer (`activations: auto`) runs as it is
        if zp is not None and node.op_type == "QuantizeLinear" and zp.dtype == np.int8:
            clip = _rewrite_cpu_quantizer(graph, node, zp, memo[node.input[0]], zps, report, guard)
            clips += [clip] if clip is not None else []
    for node in graph.g.node:  # anything left (a DQ no Q feeds, a shared zero point): uint8 zero point 128
        zp = _activation_zero_point(graph, node, per_channel=True)
        if zp is not None and zp.dtype == np.int8:
            node.input[2] = _u8_zero_point(graph, zps, node, zp, 128)
    if clips:
        graph.g.node.extend(clips)
        _toposort(graph)
    else:
        graph.refresh()


_NONNEG_PASS_THROUGH = PASS_THROUGH + ("GlobalMaxPool", "Identity", "Slice", "DequantizeLinear", "QuantizeLinear")


def _nonnegative(graph: _Graph, name: str, memo: dict[str, bool]) -> bool:
    """Whether the tensor ``name`` cannot be negative, from the ops that produce it (ReLU, pooling of one, ...)."""
    if name in memo:
        return memo[name]
    memo[name] = False  # a cycle (none in a valid graph) counts as unknown
    node = graph.producer.get(name)
    result = False
    if node is None:
        value = graph.const(name) if name in graph.inits else None
        result = value is not None and bool(np.all(value >= 0))
    elif node.op_type in ("Relu", "Sigmoid", "Softmax"):
        result = True
    elif node.op_type == "Clip":
        low = graph.const(node.input[1]) if len(node.input) > 1 and node.input[1] else _attr(node, "min", None)
        result = low is not None and bool(np.all(np.asarray(low) >= 0))
    elif node.op_type in _NONNEG_PASS_THROUGH:
        # Q/DQ keep the sign with a zero point of 0 (the only activation zero point this pass accepts).
        result = _nonnegative(graph, node.input[0], memo)
    elif node.op_type in ("Concat", "Max", "Add", "Mul"):
        result = all(_nonnegative(graph, i, memo) for i in node.input if i)
    memo[name] = result
    return result


def relu_in_integer_domain(graph: _Graph, report: PassReport) -> None:
    """``Relu -> Q(uint8, zero point 0)`` becomes ``Q`` (cpu form): Q already saturates negatives to 0.

    onnxruntime fuses ``DQ -> Conv -> Q`` into an integer QLinearConv (and Add into QLinearAdd) only
    when Q follows directly. For a zero point at the type's minimum Q(relu(x)) == Q(x) exactly.
    """
    dead = []
    for relu in list(graph.g.node):
        if relu.op_type != "Relu":
            continue
        q = graph.only_consumer(relu.output[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        zp = graph.const(q.input[2]) if len(q.input) > 2 and q.input[2] else None
        if zp is None or zp.dtype != np.uint8 or np.any(zp != 0):
            continue
        q.input[0] = relu.input[0]
        dead.append(relu)
        report.relus_in_integer_domain += 1
    graph.remove(dead)


def _u8s8_weighted(graph: _Graph):
    """``(node, weight DQ, a_max, out_axis, int8 weights, adjacent)`` for each weighted op an x86 CPU runs as
    uint8 x int8.

    ``a_max`` is the largest raw activation (255, or the max of a Clip on the quantized tensor); ``out_axis``
    the weights' output-channel axis (None where the op type has none we know); ``adjacent`` whether the
    kernels pair inputs 2p and 2p+1 (see ``_pair_peaks``).
    """
    for node in list(graph.g.node):
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2:
            continue
        src = graph.producer.get(node.input[0])
        while src is not None and src.op_type in PASS_THROUGH:
            src = graph.producer.get(src.input[0])
        wdq = graph.producer.get(node.input[1])
        if wdq is not None and wdq.op_type == "Transpose":  # a Linear exported as MatMul(x, Transpose(DQ(W)))
            wdq = graph.producer.get(wdq.input[0])
        if src is None or src.op_type != "DequantizeLinear" or wdq is None or wdq.op_type != "DequantizeLinear":
            continue
        zp = graph.const(src.input[2]) if len(src.input) > 2 and src.input[2] else None
        w = graph.const(wdq.input[0])
        if zp is None or zp.dtype != np.uint8 or w is None or w.dtype != np.int8:
            continue
        clip = graph.producer.get(src.input[0])
        high = graph.const(clip.input[2]) if clip is not None and clip.op_type == "Clip" and len(clip.input) > 2 and clip.input[2] else None
        a_max = int(high) if high is not None and high.size == 1 else 255
        yield node, wdq, a_max, _stored_out_axis(graph, node, w), w, node.op_type in ("Gemm", "MatMul") and w.ndim == 2


def _pair_peaks(w: np.ndarray, out_axis: int | None, adjacent: bool) -> np.ndarray:
    """Per output channel, the largest same-sign weight pair a u8s8 kernel may add in int16: of inputs 2p and 2p+1
    (``adjacent``: a 2-D Gemm/MatMul weight, whose reduction runs in input order in both runtimes), else of any two
    (a convolution, whose reduction order is the kernel's layout)."""
    w = w.astype(np.int32) if w.dtype.kind in "iu" else w
    per_channel = np.moveaxis(w, out_axis, 0).reshape(w.shape[out_axis], -1) if out_axis is not None else w.reshape(1, -1)
    if adjacent:
        if per_channel.shape[1] % 2:
            per_channel = np.pad(per_channel, ((0, 0), (0, 1)))
        pairs = per_channel.reshape(per_channel.shape[0], -1, 2)
        return np.maximum(np.clip(pairs, 0, None).sum(2).max(1), np.clip(-pairs, 0, None).sum(2).max(1))
    top = np.sort(np.clip(per_channel, 0, None), axis=1)[:, -2:].sum(1)
    bottom = np.sort(np.clip(-per_channel, 0, None), axis=1)[:, -2:].sum(1)
    return np.maximum(top, bottom)


def u8s8_overflow_risks(model) -> list[str]:
    """Weighted ops whose integer dot products can leave the 16-bit pair sums of x86 u8s8 kernels.

    Without VNNI, onnxruntime's and OpenVINO's u8s8 kernels (vpmaddubsw) add two uint8 x int8 products
    in a saturating int16 before widening: a0 w0 + a1 w1 must stay within -32768..32767. With raw
    activations up to ``a_max`` (255, or the max of a Clip on the quantized tensor) that holds when each
    same-sign pair of an output channel's weights sums to at most 32767 / a_max in magnitude. For a 2-D
    Gemm/MatMul weight the pairs are inputs (2p, 2p+1): measured on an AVX2 EPYC with onnxruntime 1.32
    and OpenVINO 2026.4, weights of 127 at every input saturated both, 127 at even inputs only (or at
    inputs 1, 2 mod 4) neither. A convolution's pairs follow the kernel's layout, so any two count.
    """
    risks = []
    for node, _, a_max, out_axis, w, adjacent in _u8s8_weighted(_Graph(model)):
        peak = int(_pair_peaks(w, out_axis, adjacent).max())
        if a_max * peak > 32767:
            risks.append(f"{node.op_type} {node.name}: activations up to {a_max} times weight pairs up to "
                         f"{peak} reach {a_max * peak} > 32767")
    return risks


def fit_u8s8_pairs(graph: _Graph, report: PassReport) -> None:
    """cpu form: re-grid the weights of each op that ``u8s8_overflow_risks`` names so that no pair can saturate.

    A signed activation (zero point 128: a network input, a LayerNorm or residual output, a concat of
    embeddings and dense features) reaches raw values up to 255, so a pair of weights the kernel adds (see
    ``u8s8_overflow_risks``) may sum to at most 128 in magnitude. NNCF's own overflow fix (7-bit weights)
    covers only the first convolution; an MLP's first Linear or a transformer's projections keep full 8-bit
    weights, and on an AVX2 EPYC a regressor's INT8 ONNX then read a relative error of 0.071 against the
    quantized torch model (MSE 0.0439 against 0.0295; fitted, 0.0296). Each offending output channel c is
    multiplied by f_c = (limit - 1) / peak_c and its scale divided by f_c: the channel computes the same
    function on a coarser grid (rounding the two weights adds at most 1, so the new peak is at most the
    limit), rounded once from the float weights where ``fold_weight_quantizers`` kept them. Channels within
    the limit keep their grid; where the scale is per tensor one factor serves the whole tensor. Neither
    onnxruntime's quantizer (``reduce_range`` takes every weight of every op to 7 bits) nor NNCF (the first
    convolution, or every layer) does this per channel, so it is written here.
    """
    ops = channels = 0
    for node, wdq, a_max, out_axis, _, adjacent in list(_u8s8_weighted(graph)):
        limit = 32767 // a_max
        w, scale = graph.const(wdq.input[0]), graph.const(wdq.input[1])  # as now: a DQ shared by two ops is fitted once
        if w is None or scale is None:
            continue
        peaks = _pair_peaks(w, out_axis, adjacent)
        if peaks.max() <= limit:
            continue
        per_channel = scale.size > 1 and out_axis is not None and _attr(wdq, "axis", 1) % w.ndim == out_axis
        if scale.size > 1 and not per_channel:
            continue  # per-channel scales on another axis: no op we export has them
        # one rounding from the float weights where the fold kept them (two roundings lose ~25 % more)
        wf = graph.float_weights.get(wdq.input[0])
        step = _bcast(scale, out_axis, w.ndim) if per_channel else scale
        grid = np.clip(wf / step, -127, 127) if wf is not None and wf.shape == w.shape else None
        if grid is None or np.abs(grid - w).max() > 0.5 + 1e-3:  # float weights of another grid: re-grid the ints
            grid = w.astype(np.float64)
        factor = np.where(peaks > limit, (limit - 1) / np.maximum(_pair_peaks(grid, out_axis, adjacent), 1), 1.0)
        if not per_channel:
            factor = np.full_like(factor, factor.min())
        fitted = np.round(grid * (_bcast(factor, out_axis, w.ndim) if per_channel else factor[0]))
        new_scale = (scale / (factor if per_channel else factor[0])).astype(scale.dtype)
        channels += int((factor < 1).sum())
        wdq.input[0] = graph.add_init(wdq.input[0] + "_u8s8", fitted.astype(np.int8))
        wdq.input[1] = graph.add_init(wdq.input[1] + "_u8s8", new_scale)
        ops += 1
    if ops:
        graph.refresh()
        report.notes.append(f"{channels} output channel(s) of {ops} weighted op(s) with a signed input re-gridded so "
                            "that no weight pair exceeds what x86 u8s8 kernels without VNNI add in int16 (the channel's "
                            "weight step grows; a CPU with VNNI would run the 8-bit grid safely)")
    report.u8s8_channels_fitted = channels
