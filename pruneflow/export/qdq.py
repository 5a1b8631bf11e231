"""INT8 ONNX from a quantized torch model, in the form each runtime runs best.

One set of trained quantization parameters, two forms:

- ``tensorrt``: TensorRT's explicit-quantization convention. Every QuantizeLinear/DequantizeLinear is
  int8 with zero point 0 (symmetric); weights are stored as int8 initializers with per-channel scales on
  axis 0 (output channels); activations are per-tensor. Q/DQ sit on the inputs of Conv/Gemm/MatMul;
  at a residual Add after a convolution only the skip input is quantized and the convolution branch feeds
  it in float, so TensorRT fuses Conv(+BN)+Add(+ReLU) into one int8 kernel (``place_residual_quantizers``).
  A residual Add after a MatMul/Gemm (a transformer's residual stream) keeps NNCF's placement: TensorRT has
  no MatMul+Add int8 fusion that needs it, and quantizing the stream would change what the model computes
  (measured on MiniLM-L6 QAT: 3.5 % of SST-2 dev predictions differed from the torch model).
- ``cpu``: the same grid written with uint8 activations (u8s8), which x86 onnxruntime and OpenVINO run
  fastest. Weights stay int8 per channel. Each activation gets one of two exact encodings:

  - a tensor that cannot be negative (after a ReLU, or a pooling of one): uint8 with zero point 0,
    then ``Clip(0, 127)`` on the quantized tensor (int8 stops at 127 where uint8 would go on to 255);
  - any other tensor: uint8 with zero point 128 (the same values as int8 with zero point 0, -128 s .. 127 s).

  Why not zero point 128 everywhere: x86 CPUs without VNNI (AVX2, AVX-512 without VNNI) multiply u8 by
  s8 with ``vpmaddubsw``, which adds *pairs* of products in a saturating int16. Raw activations are
  what the kernels multiply, and with zero point 128 a ReLU output is 128..255, so two large weights of
  the same sign (|w0 + w1| > 128) can push a pair past 32767: onnxruntime's QLinearConv/QGemm and
  OpenVINO's int8 convolutions and FC then return wrong values. Measured on an AVX2 EPYC (no VNNI):
  onnxruntime's mean |error| to the float reference path of the same graph (``ORT_DISABLE_ALL``) was
  2.2x (pretrained ResNet-20) to 76x (tests/test_qdq.py's net) what its slower, non-saturating u8u8
  path (``session.x64quantprecision=1``) gives. With raw values 0..127 a pair is at most
  2 * 127 * 127 = 32258, so it cannot saturate on any x86 CPU; the graph runs the same integer kernels
  (now equal, bit for bit, to the u8u8 path) at the same speed. Signed tensors (the network input, a
  residual branch, a LayerNorm output) keep zero point 128, so the weights that read them must keep each
  pair within 128: NNCF's overflow fix does that for the first convolution only, and ``fit_u8s8_pairs``
  re-grids the output channels of every other such op that needs it (an MLP's first Linear, a
  transformer's projections). ``u8s8_overflow_risks`` lists what could still saturate (nothing, after the
  fit); the export adds it to the artifact's notes.

The model comes already stripped to torch's native fake-quant ops (``ModelHandle.int8_module``: for the
NNCF kind, ``nncf.strip`` in qat/), so this module imports no quantization backend. torch's exporter
writes it as Q/DQ pairs around float weights and leaves BatchNorm after the quantized convolution;
neither runtime then runs the convolution in int8. No library we depend on does the two fixes below,
so they are written here:

- weight quantizers are applied offline: ``QuantizeLinear(W)`` becomes an int8 initializer;
- BatchNorm is folded into the preceding Conv *through* its weight quantizer. With symmetric
  narrow-range (-127..127) per-channel weights this is exact: BN multiplies output channel c by
  k_c = gamma_c / sqrt(var_c + eps), and DQ(q, s_c) * k_c == DQ(sign(k_c) q, s_c |k_c|), with the
  sign flip staying inside -127..127. The bias becomes (b - mean) k + beta.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..errors import ExportError

Form = Literal["tensorrt", "cpu"]
#: How the ``cpu`` form encodes activations (``pruneflow/export/forms.py`` picks one per host, by measuring):
#:
#: - ``u8s8``: uint8, zero point 0 and ``Clip(0, 127)`` for a tensor that cannot be negative, zero point 128
#:   otherwise, with weights fitted to the 16-bit pair sums of x86 kernels without VNNI: exact on every x86 CPU.
#: - ``u8s8_vnni``: the same without the Clips and the fit: a non-negative tensor keeps the full uint8 range
#:   (values NNCF clipped at 127 steps reach 255), one op fewer per activation. Exact only where the CPU
#:   multiplies u8 by s8 without int16 pair sums (VNNI, AMX, ARM); faster there (ResNet-56 on an AVX-512 VNNI
#:   EPYC: 7 % in onnxruntime and OpenVINO at batch 32).
#: - ``s8s8``: int8 activations with zero point 0 as NNCF trained them (onnxruntime's documented first choice
#:   where the CPU has VNNI); a ReLU stays a float op before its quantizer.
Encoding = Literal["u8s8", "u8s8_vnni", "s8s8"]
ENCODINGS: tuple[Encoding, ...] = ("u8s8", "u8s8_vnni", "s8s8")
QUANT_OPS = ("QuantizeLinear", "DequantizeLinear")
WEIGHTED_OPS = ("Conv", "Gemm", "MatMul", "ConvTranspose")
PASS_THROUGH = ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "GlobalAveragePool", "AveragePool", "MaxPool")


@dataclass
class PassReport:
    weights_folded: int = 0
    batchnorms_folded: int = 0
    activations_rewritten: int = 0
    activations_unsigned: int = 0
    relus_in_integer_domain: int = 0
    #: tensorrt form: residual Adds whose weighted branch left Q/DQ, and skip inputs given a Q/DQ
    residual_branches_float: int = 0
    residual_skips_quantized: int = 0
    #: SmoothQuant Muls folded into the weighted op before them (``fold_smooth_quant_scales``)
    smooth_quant_folded: int = 0
    #: cpu form: output channels whose weights were re-gridded to fit x86 u8s8 pair sums (``fit_u8s8_pairs``)
    u8s8_channels_fitted: int = 0
    #: cpu form: data-movement ops given a Q/DQ after them so what reads them runs in int8 (``requantize_moves``)
    moves_requantized: int = 0
    #: cpu form: Gemm biases stored as int32 on the product of their input's and weights' scales
    gemm_biases_quantized: int = 0
    #: quantizers of one tensor merged into one (``share_input_quantizers``)
    quantizers_shared: int = 0
    #: cpu form: activation Q/DQ pairs before a float Concat dropped (``drop_rounding_before_float_concats``)
    float_concat_quantizers_dropped: int = 0
    #: weighted ops left in float (``float_ops``: ignored, or NNCF's choice)
    float_ops: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Graph:
    """Just enough of a graph view to rewrite Q/DQ patterns on an onnx.ModelProto in place."""

    def __init__(self, model):
        from onnx import numpy_helper

        self.model = model
        self.g = model.graph
        self.nh = numpy_helper
        self.inits = {i.name: i for i in self.g.initializer}
        #: the float weights behind each int8 initializer ``fold_weight_quantizers`` wrote (for a later re-grid)
        self.float_weights: dict[str, np.ndarray] = {}
        self.refresh()

    def refresh(self) -> None:
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        # Names read inside If/Loop subgraphs count as outputs: never renamed, rewired or removed (issue 15:
        # lstm_text's `squeeze(1)` exports as an If whose branches read a tensor of the main graph).
        self.outputs = {o.name for o in self.g.output} | _subgraph_reads(self.g.node)

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output (through Identity), else None."""
        if name in self.inits:
            return self.nh.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "Identity":
            return self.const(node.input[0])
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return self.nh.to_array(attr.t)
        return None

    def add_init(self, name: str, value: np.ndarray) -> str:
        base, i = name, 0
        while name in self.inits or name in self.producer:
            i += 1
            name = f"{base}_{i}"
        tensor = self.nh.from_array(value, name)
        self.g.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def only_consumer(self, name: str):
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def remove(self, nodes) -> None:
        drop = {id(n) for n in nodes}
        keep = [n for n in self.g.node if id(n) not in drop]
        del self.g.node[:]
        self.g.node.extend(keep)
        self.refresh()

    def prune_initializers(self) -> None:
        used = {i for n in self.g.node for i in n.input} | self.outputs
        keep = [t for t in self.g.initializer if t.name in used]
        del self.g.initializer[:]
        self.g.initializer.extend(keep)
        self.inits = {i.name: i for i in self.g.initializer}


def _attr(node, name: str, default):
    for a in node.attribute:
        if a.name == name:
            from onnx import helper

            return helper.get_attribute_value(a)
    return default


def _set_attr(node, name: str, value) -> None:
    from onnx import helper

    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    node.attribute.append(helper.make_attribute(name, value))


def _bcast(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    if v.ndim == 0:
        return v
    shape = [1] * ndim
    shape[axis] = v.size
    return v.reshape(shape)


def _quantize(w: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear semantics: round half to even, saturate to the zero point's type."""
    info = np.iinfo(zp.dtype)
    s = _bcast(scale.astype(np.float32), axis, w.ndim)
    z = _bcast(zp.astype(np.int32), axis, w.ndim)
    q = np.rint(w.astype(np.float32) / s) + z
    return np.clip(q, info.min, info.max).astype(zp.dtype)


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


def _activation_zero_point(graph: _Graph, node, per_channel: bool = False) -> np.ndarray | None:
    """The zero point of a per-tensor activation Q/DQ node (also of a per-channel one with ``per_channel``,
    as NNCF places before depthwise convolutions); None for weights."""
    if node.op_type not in QUANT_OPS or len(node.input) < 3 or node.input[0] in graph.inits:
        return None
    scale, zp = graph.const(node.input[1]), graph.const(node.input[2])
    return zp if scale is not None and zp is not None and (scale.size == 1 or per_channel) else None


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
    if form == "tensorrt":
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


def _stored_out_axis(graph: _Graph, node, w: np.ndarray) -> int | None:
    """The stored weight's axis that becomes the op's output-channel axis, through a Transpose between the weight's
    DequantizeLinear and the op (a Linear exported as MatMul(x, Transpose(DQ(W)))); None for an op type we don't know."""
    axis = {"Conv": 0, "ConvTranspose": 1, "Gemm": 0 if _attr(node, "transB", 0) else 1, "MatMul": w.ndim - 1}.get(node.op_type)
    transpose = graph.producer.get(node.input[1])
    if axis is not None and transpose is not None and transpose.op_type == "Transpose":
        perm = _attr(transpose, "perm", None) or list(range(w.ndim))[::-1]
        axis = int(perm[axis])
    return axis


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


# --------------------------------------------------------------------------- residual Adds (tensorrt form)
#
# TensorRT fuses Conv(+BN)+Add(+ReLU) into one int8 kernel when the convolution's output goes straight
# into the Add (in float) and the Add's other, residual input arrives quantized (TensorRT's Q/DQ
# placement guide; NVIDIA pytorch-quantization's ResNet `residual_quantizer`; Model Optimizer's ONNX
# PTQ). NNCF quantizes both Add inputs, so a Q/DQ sits between the convolution and the Add and TensorRT
# has to run the Add on its own. ``place_residual_quantizers`` moves the graph to TensorRT's placement.

#: Ops that keep every value of an int8 grid on it (a zero pad included): a quantizer before them
#: quantizes their output too, so a Q/DQ after them with the same scale changes nothing.
_GRID_PRESERVING = ("Slice", "Pad", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "Identity")


@dataclass
class _Branch:
    """An Add input computed by a weighted op: its float tensor, the op, and the Q/DQ after it (if any)."""

    tensor: str
    op: Any
    dq: Any | None


def _weighted_branch(graph: _Graph, name: str) -> _Branch | None:
    """The weighted op (Conv/Gemm/MatMul, through a BatchNorm or a constant bias Add) computing tensor
    ``name``, directly or through one activation Q/DQ pair; None when another op computes it."""
    node, dq = graph.producer.get(name), None
    if node is not None and node.op_type == "DequantizeLinear" and node.input[0] not in graph.inits:
        q = graph.producer.get(node.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            return None
        dq, name = node, q.input[0]
        node = graph.producer.get(name)
    op = node
    if op is not None and op.op_type == "BatchNormalization":
        op = graph.producer.get(op.input[0])
    elif op is not None and op.op_type == "Add" and len(op.input) == 2:
        const = [graph.const(i) is not None for i in op.input]
        op = graph.producer.get(op.input[const.index(False)]) if sum(const) == 1 else None
    if op is None or op.op_type not in WEIGHTED_OPS:
        return None
    return _Branch(name, op, dq)


def _ancestors(graph: _Graph, name: str) -> dict[int, int]:
    """``id(node) -> distance`` of every node upstream of tensor ``name`` (1: its producer)."""
    seen: dict[int, int] = {}
    frontier, depth = [name], 0
    while frontier:
        depth += 1
        nxt = []
        for tensor in frontier:
            node = graph.producer.get(tensor)
            if node is not None and id(node) not in seen:
                seen[id(node)] = depth
                nxt += [i for i in node.input if i and i not in graph.inits]
        frontier = nxt
    return seen


#: The weighted ops whose residual Add TensorRT fuses with them in int8 (the residual rule applies after these only).
RESIDUAL_FUSED_OPS = ("Conv", "ConvTranspose")


def residual_adds(graph: _Graph) -> list[tuple[Any, int]]:
    """``(Add, index of its weighted-branch input)`` for every residual Add after a convolution.

    A residual Add sums a weighted op's output with another computed tensor (not a constant, not a graph
    input) that does not itself come from that op. When both inputs come from weighted ops (a projection
    shortcut), the branch is the input farther from their lowest common ancestor, as in Model Optimizer.
    Adds whose branch is a MatMul/Gemm are not listed (see the module docstring).
    """
    found = []
    for add in graph.g.node:
        if add.op_type != "Add" or len(add.input) != 2 or any(i not in graph.producer for i in add.input):
            continue
        if any(graph.const(i) is not None for i in add.input):  # a bias, not a residual
            continue
        branches = [_weighted_branch(graph, i) for i in add.input]
        if branches[0] is None and branches[1] is None:
            continue
        up = [_ancestors(graph, i) for i in add.input]
        if branches[0] is not None and branches[1] is not None:
            common = set(up[0]) & set(up[1])
            if not common:
                continue
            lca = min(common, key=lambda n: up[0][n] + up[1][n])
            index = 0 if up[0][lca] > up[1][lca] else 1
            if branches[index].op.op_type in RESIDUAL_FUSED_OPS:  # type: ignore[union-attr]
                found.append((add, index))
            continue
        index = 0 if branches[0] is not None else 1
        branch = branches[index]
        # the other input computed from the branch's own op (Conv -> X -> Add <- Conv): not a residual
        if branch is not None and branch.op.op_type in RESIDUAL_FUSED_OPS and id(branch.op) not in up[1 - index]:
            found.append((add, index))
    return found


def _skip_quantizer(graph: _Graph, name: str):
    """The activation DQ whose grid tensor ``name`` is on (through grid-preserving ops), or None."""
    node = graph.producer.get(name)
    while node is not None and node.op_type in _GRID_PRESERVING:
        if node.op_type == "Pad" and (_attr(node, "mode", b"constant") not in (b"constant", "constant") or (
                len(node.input) > 2 and node.input[2] and np.any(graph.const(node.input[2]) != 0))):
            return None
        node = graph.producer.get(node.input[0])
    if node is not None and _activation_zero_point(graph, node) is not None and node.op_type == "DequantizeLinear":
        return node
    return None


def _sibling_quantizer(graph: _Graph, name: str):
    """A per-tensor QuantizeLinear that already reads tensor ``name`` (NNCF's, for another consumer), or None."""
    for user in graph.consumers.get(name, []):
        if user.op_type == "QuantizeLinear" and _activation_zero_point(graph, user) is not None:
            return user
    return None


def _quantize_skip(graph: _Graph, add, index: int, new_nodes: list, report: PassReport) -> bool:
    """Make Add input ``index`` (the skip) arrive through a DQ. False when no quantizer gives it a scale."""
    from onnx import helper

    name = add.input[index]
    producer = graph.producer.get(name)
    if producer is not None and producer.op_type == "DequantizeLinear":
        return True
    source = _skip_quantizer(graph, name)
    if source is not None:  # values already on that grid (a sliced, zero-padded shortcut): Q/DQ is exact
        scale, zp = source.input[1], source.input[2]
        q = helper.make_node("QuantizeLinear", [name, scale, zp], [f"{name}_skip_q"], name=f"{add.name}_skip_q")
        new_nodes.append(q)
    else:
        q = _sibling_quantizer(graph, name)
        if q is None:
            return False
        scale, zp = q.input[1], q.input[2]
    dq = helper.make_node("DequantizeLinear", [q.output[0], scale, zp], [f"{name}_skip_dq_{add.name}"],
                          name=f"{add.name}_skip_dq")
    new_nodes.append(dq)
    add.input[index] = dq.output[0]
    report.residual_skips_quantized += 1
    return True


def place_residual_quantizers(graph: _Graph, report: PassReport) -> None:
    """TensorRT's residual placement: the weighted branch of each residual Add in float, its skip quantized.

    The skip takes the scale of the quantizer its values already sit on (a shortcut that slices and
    zero-pads a quantized tensor: exact) or of the quantizer NNCF placed on the same tensor for another
    consumer. A skip with neither keeps NNCF's placement for that Add, with a note.
    """
    new_nodes: list = []
    for add, index in residual_adds(graph):
        if not _quantize_skip(graph, add, 1 - index, new_nodes, report):
            report.notes.append(f"residual Add {add.name}: its skip input has no quantizer to take a scale from; "
                                "NNCF's Q/DQ placement kept there (TensorRT runs that Add unfused)")
            continue
        branch = _weighted_branch(graph, add.input[index])
        if branch is not None and branch.dq is not None:
            add.input[index] = branch.tensor
            report.residual_branches_float += 1
    graph.g.node.extend(new_nodes)
    graph.refresh()
    _drop_unused_quantizers(graph)
    _toposort(graph)


def _drop_unused_quantizers(graph: _Graph) -> None:
    """Remove Q/DQ nodes nothing reads any more (a DQ first, then the Q that fed only it)."""
    while True:
        dead = [n for n in graph.g.node if n.op_type in QUANT_OPS
                and not any(graph.consumers.get(o) or o in graph.outputs for o in n.output)]
        if not dead:
            return
        graph.remove(dead)


def residual_problems(graph: _Graph) -> list[str]:
    """The tensorrt form's residual rule: no Q/DQ on a weighted op's output feeding a residual Add; the
    skip input is quantized."""
    problems = []
    for add, index in residual_adds(graph):
        branch = _weighted_branch(graph, add.input[index])
        if branch is not None and branch.dq is not None:
            problems.append(f"Add {add.name}: Q/DQ on the output of {branch.op.op_type} {branch.op.name} "
                            "feeding a residual Add (TensorRT fuses Conv+Add only when that branch is float)")
        skip = graph.producer.get(add.input[1 - index])
        if skip is None or skip.op_type != "DequantizeLinear":
            problems.append(f"Add {add.name}: the skip (residual) input is not quantized")
    return problems


def _subgraph_reads(nodes) -> set[str]:
    """Every tensor name read by a node inside a subgraph (If/Loop/Scan branches) of ``nodes``, at any depth."""
    names: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                names |= {i for n in sub.node for i in n.input} | _subgraph_reads(sub.node)
    return names


#: Per-tensor quantizers of one tensor whose scales differ by at most this share become one (``share_input_quantizers``).
SHARED_SCALE_SPREAD = 0.01


def share_input_quantizers(graph: _Graph, report: PassReport) -> None:
    """One QuantizeLinear, on the largest of their scales, for the per-tensor quantizers that read the same tensor with
    the same zero point and scales within ``SHARED_SCALE_SPREAD`` of each other; each DequantizeLinear they fed reads it.

    NNCF trains a quantizer per reader: a transformer's Q, K and V projections each quantize the same (SmoothQuant-
    scaled) LayerNorm output, on scales within 0.1 % of each other. OpenVINO's CPU plugin fuses a FakeQuantize into the
    op before it only when it is that op's one reader, so the three stayed standalone after every SmoothQuant Multiply
    (18 FakeQuantize in the MiniLM-L6 QAT IR, where NNCF's own IR shares one and has none), and onnxruntime quantized
    the tensor three times. The grid moves by at most ``SHARED_SCALE_SPREAD`` of a step."""
    dead = []
    for name, users in list(graph.consumers.items()):
        qs = [u for u in users if u.op_type == "QuantizeLinear" and u.input[0] == name]
        found = [(graph.const(q.input[1]), graph.const(q.input[2]) if len(q.input) > 2 and q.input[2] else None) for q in qs]
        params = [(sc, zp) for sc, zp in found if sc is not None and sc.size == 1 and zp is not None and zp.size == 1]
        if len(qs) < 2 or len(params) != len(qs):
            continue
        readers = [graph.consumers.get(q.output[0], []) for q in qs]
        if len({(zp.dtype, int(zp.reshape(-1)[0])) for _, zp in params}) != 1 or any(
                not r or any(d.op_type != "DequantizeLinear" or d.input[0] != q.output[0] for d in r) for q, r in zip(qs, readers)):
            continue
        scales = [float(sc.reshape(-1)[0]) for sc, _ in params]
        if max(scales) > min(scales) * (1 + SHARED_SCALE_SPREAD) or any(q.output[0] in graph.outputs for q in qs):
            continue
        keep = qs[scales.index(max(scales))]
        for q, dqs in zip(qs, readers):
            for dq in dqs:
                dq.input[:] = [keep.output[0], keep.input[1], keep.input[2], *dq.input[3:]]
            if q is not keep:
                dead.append(q)
        report.quantizers_shared += len(qs) - 1
    graph.remove(dead)


#: Ops that move, cut or zero-pad values without changing any: a Q/DQ after them with their input's scale and zero point
#: is exact (a constant pad of 0 is the zero point).
MOVES = ("Pad", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Slice")


def requantize_moves(graph: _Graph, report: PassReport) -> None:
    """A Q/DQ pair (the dequantized input's own scale and zero point, and its Clip in the guarded form) after a chain
    of ``MOVES`` that leaves the int8 grid for an op that would otherwise read it in float: a Gemm after Flatten
    (ResNet's classifier), an Add after a downsampling shortcut's Slice + Pad. Without it onnxruntime runs that
    Gemm and Add in float between a DequantizeLinear and a QuantizeLinear; with it they fuse into QGemm and
    QLinearAdd, as in onnxruntime's own ``quantize_static`` output (ResNet-56 had 2 float Adds and a float Gemm)."""
    from onnx import helper

    added = []
    for end in [n for n in graph.g.node if n.op_type in MOVES and n.output[0] not in graph.outputs]:
        users = graph.consumers.get(end.output[0], [])
        dq = _moved_from(graph, end)
        if dq is None or not users or not all(_int8_reader(graph, u, end.output[0]) for u in users):
            continue
        source = graph.producer.get(dq.input[0])
        clip = source if source is not None and source.op_type == "Clip" else None
        q_out = end.output[0] + "_requant"
        nodes = [helper.make_node("QuantizeLinear", [end.output[0], *dq.input[1:3]], [q_out], name=end.name + "_requant")]
        if clip is not None:  # the guarded u8s8 form: the same bound, so the u8s8 checks read the same range
            nodes.append(helper.make_node("Clip", [q_out, *clip.input[1:]], [q_out + "_int8_range"],
                                          name=end.name + "_requant_int8_range"))
        nodes.append(helper.make_node("DequantizeLinear", [nodes[-1].output[0], *dq.input[1:3]], [end.output[0] + "_dq"],
                                      name=end.name + "_requant_dq"))
        for user in users:
            user.input[:] = [nodes[-1].output[0] if i == end.output[0] else i for i in user.input]
        added += nodes
        report.moves_requantized += 1
    if added:
        graph.g.node.extend(added)
        _toposort(graph)


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


def _moved_from(graph: _Graph, end):
    """The per-tensor DequantizeLinear a chain of ``MOVES`` ending at ``end`` starts from (a Pad only with value 0)."""
    node = end
    while node is not None and node.op_type in MOVES:
        if node.op_type == "Pad":
            value = graph.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if _attr(node, "mode", b"constant") not in (b"constant", "constant") or (value is not None and np.any(value != 0)):
                return None
        node = graph.producer.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear":
        return None
    scale = graph.const(node.input[1])
    return node if scale is not None and scale.size == 1 and len(node.input) > 2 and node.input[2] else None


def _int8_reader(graph: _Graph, user, name: str) -> bool:
    """Whether ``user`` would run in int8 given ``name`` dequantized: a weighted op reading it as its data (with
    dequantized weights), or an
    Add/Concat whose other inputs are dequantized and whose output only goes to QuantizeLinear."""
    if user.op_type in WEIGHTED_OPS:  # its weights dequantized too (not two activations NNCF left in float)
        return user.input[0] == name and len(user.input) > 1 and _dequantized(graph, user.input[1])
    if user.op_type in ("Add", "Concat"):
        others = [i for i in user.input if i != name]
        outs = graph.consumers.get(user.output[0], [])
        return (all(_dequantized(graph, i) for i in others) and bool(outs)
                and all(o.op_type == "QuantizeLinear" for o in outs) and user.output[0] not in graph.outputs)
    return False


def _toposort(graph: _Graph) -> None:
    known = {i.name for i in graph.g.input} | set(graph.inits)
    produced = {o for n in graph.g.node for o in n.output}  # a subgraph also reads its own tensors: only these wait
    pending, ordered = list(graph.g.node), []
    while pending:
        ready = [n for n in pending if all(not i or i in known for i in n.input)
                 and all(i in known for i in _subgraph_reads([n]) if i in produced)]
        if not ready:
            raise ExportError("internal error: the rewritten INT8 graph has a cycle")
        for n in ready:
            known.update(n.output)
        ordered += ready
        ids = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in ids]
    del graph.g.node[:]
    graph.g.node.extend(ordered)
    graph.refresh()


def convert(model, form: Form, encoding: str = "u8s8") -> PassReport:
    """Apply the passes to an onnx.ModelProto (exported from a stripped NNCF model) in place; ``encoding`` is
    the cpu form's activation encoding (``Encoding``)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown INT8 encoding {encoding!r}: one of {', '.join(ENCODINGS)}")
    graph = _Graph(model)
    report = PassReport()
    fold_weight_quantizers(graph, report)
    share_input_quantizers(graph, report)
    fold_batchnorm(graph, report)
    fold_smooth_quant_scales(graph, report)
    if form == "cpu":
        drop_rounding_before_float_concats(graph, report)
    guarded = form == "cpu" and encoding == "u8s8"
    if form == "tensorrt" or encoding != "s8s8":
        rewrite_activations(graph, form, report, guard=guarded)
    if form == "cpu" and encoding != "s8s8":
        relu_in_integer_domain(graph, report)
    if guarded:
        fit_u8s8_pairs(graph, report)
    if form == "cpu" and encoding == "u8s8_vnni" and report.activations_unsigned:
        report.notes.append(f"{report.activations_unsigned} non-negative activation(s) in the full uint8 range (no Clip at "
                            "NNCF's 127 steps): exact on CPUs with VNNI or AMX, may saturate on x86 CPUs without them")
    _remove_identities(graph)
    if form == "cpu":
        requantize_moves(graph, report)
        quantize_gemm_biases(graph, report)
    if form == "tensorrt":
        place_residual_quantizers(graph, report)
    graph.prune_initializers()
    _short_tensor_names(graph)
    left = Counter(n.op_type for n in graph.g.node)
    if guarded:
        for risk in u8s8_overflow_risks(model):
            report.notes.append("may saturate in u8s8 kernels of x86 CPUs without VNNI (signed input, 8-bit weights): " + risk)
    if left.get("BatchNormalization"):
        report.notes.append(f"{left['BatchNormalization']} BatchNormalization node(s) could not be folded")
    return report


def _short_tensor_names(graph: _Graph) -> None:
    """Rename internal tensors ``t0, t1, ...`` (node names are kept for debugging).

    The exporter's tensor names repeat NNCF's hook paths and take ~10 % of an INT8 ResNet's file.
    """
    keep = {i.name for i in graph.g.input} | graph.outputs
    mapping: dict[str, str] = {}

    def short(name: str) -> str:
        if not name or name in keep:
            return name
        return mapping.setdefault(name, f"t{len(mapping)}")

    for t in graph.g.initializer:
        t.name = short(t.name)
    for node in graph.g.node:
        node.input[:] = [short(i) for i in node.input]
        node.output[:] = [short(o) for o in node.output]
    for vi in list(graph.g.value_info):
        vi.name = short(vi.name)
    graph.inits = {i.name: i for i in graph.g.initializer}
    graph.refresh()


#: Ops between a DequantizeLinear and a Concat that move values without changing any, one input each.
_SINGLE_MOVES = ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose")


def _tables_read(graph: _Graph) -> bool:
    """Whether the graph reads rows of an embedding table (an axis-0 Gather of a 2-D initializer): a ranker's."""
    return any(n.op_type == "Gather" and _attr(n, "axis", 0) == 0 and n.input[0] in graph.inits
               and len(graph.inits[n.input[0]].dims) == 2 for n in graph.g.node)


def _reached(graph: _Graph, name: str) -> list:
    """The ops that read ``name`` through ``_SINGLE_MOVES``, and None for a graph output on the way."""
    found: list = [None] if name in graph.outputs else []
    for user in graph.consumers.get(name, []):
        found += _reached(graph, user.output[0]) if user.op_type in _SINGLE_MOVES else [user]
    return found


def drop_rounding_before_float_concats(graph: _Graph, report: PassReport) -> None:
    """cpu form, in a graph that reads embedding tables: an activation ``Q -> DQ`` whose values reach (through ops
    that only move them) nothing but ``Concat``s that no quantizer reads is dropped; the Concat reads the float tensor.

    NNCF quantizes every input of an op it can run in int8, a DLRM's pairwise-interaction MatMul included: each
    table row, bag sum and bottom-MLP output gets a per-tensor Q/DQ before it is stacked. onnxruntime fuses a Q/DQ
    into an integer kernel only when the kernel reads the DQ (or a QLinearConcat when a Q reads the Concat), so
    these pairs ran as two float ops each, rounding the rows to a coarser grid than their own per-row int8 one and
    the interaction then in float all the same (8 pairs, 16 ops, in the DLRM of recipes/dlrm-bags.yaml: 8 % of its
    INT8 time at batch 64 in onnxruntime, one thread, an AVX-512 EPYC). Without them the graph computes the values
    the quantized model rounds, more exactly. Other graphs (a DenseNet's concatenations) keep NNCF's placement: what
    it costs or saves there was not measured."""
    if not _tables_read(graph):
        return
    dead = []
    for q in [n for n in graph.g.node if n.op_type == "QuantizeLinear"]:
        if _activation_zero_point(graph, q) is None or q.output[0] in graph.outputs:
            continue
        dqs = graph.consumers.get(q.output[0], [])
        if not dqs or any(d.op_type != "DequantizeLinear" or d.input[1:3] != q.input[1:3] for d in dqs):
            continue
        ends = [e for d in dqs for e in _reached(graph, d.output[0])]
        if not ends or any(e is None or e.op_type != "Concat" or any(r is None or r.op_type == "QuantizeLinear"
                                                                      for r in _reached(graph, e.output[0])) for e in ends):
            continue
        for d in dqs:
            for user in graph.consumers.get(d.output[0], []):
                user.input[:] = [q.input[0] if i == d.output[0] else i for i in user.input]
        dead += [q, *dqs]
        report.float_concat_quantizers_dropped += 1
    if dead:
        graph.remove(dead)
        report.notes.append(f"{report.float_concat_quantizers_dropped} activation Q/DQ pair(s) before Concats that run in "
                            "float dropped (onnxruntime fuses none of them into an integer kernel): the values are not "
                            "rounded there")


def _remove_identities(graph: _Graph) -> None:
    """Reconnect the users of each internal Identity to its input, then drop the Identity."""
    identities = [n for n in graph.g.node if n.op_type == "Identity" and n.output[0] not in graph.outputs]
    for node in identities:
        for user in graph.consumers.get(node.output[0], []):
            user.input[:] = [node.input[0] if name == node.output[0] else name for name in user.input]
    graph.remove(identities)


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


def _quantizer_problems(graph: _Graph, node, form: Form) -> list[str]:
    """What is wrong with one Q/DQ node against the form's convention (empty when it conforms)."""
    zp = graph.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    scale = graph.const(node.input[1])
    if zp is None:
        return [f"{node.name}: no explicit zero point"]
    if scale is None:
        return [f"{node.name}: the scale is not a constant"]
    problems = []
    if node.input[0] in graph.inits and zp.dtype == np.int32:  # a bias on its input x weight scale (``quantize_gemm_biases``)
        return [] if node.op_type == "DequantizeLinear" and not np.any(zp) else [f"{node.name}: an int32 bias must be dequantized with zero point 0"]
    if node.input[0] in graph.inits:  # a weight
        if zp.dtype != np.int8 or np.any(zp != 0):
            problems.append(f"{node.name}: weight zero point must be int8 0")
        # the output-channel axis: 0 for Conv/Gemm weights, 1 for ConvTranspose's ([C_in, C_out/groups, kH, kW]),
        # where NNCF puts them and where TensorRT reads a deconvolution's per-channel scales
        readers = {n.op_type for o in node.output for n in graph.consumers.get(o, [])}
        axis = 1 if readers == {"ConvTranspose"} else 0
        if scale.size > 1 and _attr(node, "axis", 1) != axis:
            problems.append(f"{node.name}: per-channel weight scales must be on axis {axis} (output channels)")
        return problems
    if scale.size != 1 and (form == "tensorrt" or _attr(node, "axis", 1) != 1):
        problems.append(f"{node.name}: activation scale must be per-tensor" + ("" if form == "tensorrt" else " or per channel (axis 1)"))
    if form == "tensorrt" and (zp.dtype != np.int8 or np.any(zp != 0)):
        problems.append(f"{node.name}: activation must be int8 with zero point 0")
    return problems


#: Ops between a DequantizeLinear and a weighted op that keep its input on the int8 grid: a transposed
#: weight (a Linear on 3-D input exports as Transpose -> MatMul), a class token taken by Gather or Slice.
_GRID_READERS = PASS_THROUGH + ("Gather", "Slice", "Identity")


def _dequantized(graph: _Graph, name: str) -> bool:
    """Whether tensor ``name`` comes from a DequantizeLinear, through ops that keep the int8 grid."""
    src = graph.producer.get(name)
    # NNCF places an activation quantizer before ops that do not change the grid much (pooling, flatten);
    # runtimes propagate Q/DQ through them.
    while src is not None and src.op_type in _GRID_READERS:
        src = graph.producer.get(src.input[0])
    return src is not None and src.op_type == "DequantizeLinear"


def float_ops(model) -> list[str]:
    """The weighted ops (Conv/Gemm/MatMul) that run in float: not every input is dequantized from int8.

    NNCF leaves them so when the recipe's ``ignore`` names them, or by its own choice (a squeeze-excite
    gate's convolutions, attention score and context MatMuls of two activations); runtimes run them in
    float on dequantized inputs. They are listed in the artifact's notes.
    """
    graph = _Graph(model)
    return [f"{n.op_type} {n.name}" for n in graph.g.node if n.op_type in WEIGHTED_OPS
            and not all(_dequantized(graph, name) for name in n.input[:2])]


def check_convention(model, form: Form) -> list[str]:
    """Problems with ``model`` against the form's convention (empty when it conforms).

    A weighted op with an input that is not dequantized is not a problem: it runs in float (``float_ops``,
    e.g. a layer in `ignore`), which the export records in the artifact's notes.
    """
    from .embedding import is_row_dequantize

    graph = _Graph(model)
    problems = []
    for node in graph.g.node:
        if node.op_type in QUANT_OPS and not is_row_dequantize(node, graph.producer):  # a table read: no convention
            problems += _quantizer_problems(graph, node, form)
    if form == "tensorrt":
        problems += residual_problems(graph)
    return problems
