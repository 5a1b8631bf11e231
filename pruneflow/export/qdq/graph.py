"""The graph view the INT8 rewrite passes share (``_Graph``), their report (``PassReport``), the form and
encoding names, and the small helpers every pass reads a node with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

import numpy as np

from ...errors import ExportError


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


@dataclass(frozen=True)
class Convention:
    """What an INT8 form (``Form``) asks of a Q/DQ graph, declared once: the passes, the checks and the targets read
    these, never the form's name (``convention(form)``)."""

    name: str
    #: Activations int8 with zero point 0, per tensor (TensorRT's explicit quantization); otherwise the cpu form's
    #: encodings (uint8 or int8 per ``Encoding``).
    symmetric_activations: bool
    #: At a residual Add after a convolution only the skip input is quantized (TensorRT fuses Conv(+BN)+Add in int8).
    residual_placement: bool
    #: Int8 constants are read through DequantizeLinear only (a tied table's lookup gathers from its output).
    dequantized_constants: bool
    #: Written for another runtime than the CPU ones that check it here: its latency here says nothing of that runtime's.
    foreign: bool


CONVENTIONS: dict[str, Convention] = {
    "tensorrt": Convention("tensorrt", symmetric_activations=True, residual_placement=True, dequantized_constants=True,
                           foreign=True),
    "cpu": Convention("cpu", symmetric_activations=False, residual_placement=False, dequantized_constants=False,
                      foreign=False),
}


def convention(form: str) -> Convention:
    """The convention of INT8 form ``form`` (``tensorrt`` or ``cpu``); ValueError naming them for another."""
    if form not in CONVENTIONS:
        raise ValueError(f"unknown INT8 form {form!r}: one of {', '.join(CONVENTIONS)}")
    return CONVENTIONS[form]


def form_and_encoding(name: str) -> tuple[Form, str]:
    """A candidate's name as (INT8 form, cpu encoding): a form's own name (``tensorrt``: encoded as it declares), or
    an encoding of the cpu form (``u8s8``, ``s8s8``, ...)."""
    return (cast(Form, name), "u8s8") if name in CONVENTIONS else ("cpu", name)


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


def _activation_zero_point(graph: _Graph, node, per_channel: bool = False) -> np.ndarray | None:
    """The zero point of a per-tensor activation Q/DQ node (also of a per-channel one with ``per_channel``,
    as NNCF places before depthwise convolutions); None for weights."""
    if node.op_type not in QUANT_OPS or len(node.input) < 3 or node.input[0] in graph.inits:
        return None
    scale, zp = graph.const(node.input[1]), graph.const(node.input[2])
    return zp if scale is not None and zp is not None and (scale.size == 1 or per_channel) else None


def _stored_out_axis(graph: _Graph, node, w: np.ndarray) -> int | None:
    """The stored weight's axis that becomes the op's output-channel axis, through a Transpose between the weight's
    DequantizeLinear and the op (a Linear exported as MatMul(x, Transpose(DQ(W)))); None for an op type we don't know."""
    axis = {"Conv": 0, "ConvTranspose": 1, "Gemm": 0 if _attr(node, "transB", 0) else 1, "MatMul": w.ndim - 1}.get(node.op_type)
    transpose = graph.producer.get(node.input[1])
    if axis is not None and transpose is not None and transpose.op_type == "Transpose":
        perm = _attr(transpose, "perm", None) or list(range(w.ndim))[::-1]
        axis = int(perm[axis])
    return axis


def _drop_unused_quantizers(graph: _Graph) -> None:
    """Remove Q/DQ nodes nothing reads any more (a DQ first, then the Q that fed only it)."""
    while True:
        dead = [n for n in graph.g.node if n.op_type in QUANT_OPS
                and not any(graph.consumers.get(o) or o in graph.outputs for o in n.output)]
        if not dead:
            return
        graph.remove(dead)


def _subgraph_reads(nodes) -> set[str]:
    """Every tensor name read by a node inside a subgraph (If/Loop/Scan branches) of ``nodes``, at any depth."""
    names: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                names |= {i for n in sub.node for i in n.input} | _subgraph_reads(sub.node)
    return names


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


def _remove_identities(graph: _Graph) -> None:
    """Reconnect the users of each internal Identity to its input, then drop the Identity."""
    identities = [n for n in graph.g.node if n.op_type == "Identity" and n.output[0] not in graph.outputs]
    for node in identities:
        for user in graph.consumers.get(node.output[0], []):
            user.input[:] = [node.input[0] if name == node.output[0] else name for name in user.input]
    graph.remove(identities)


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
