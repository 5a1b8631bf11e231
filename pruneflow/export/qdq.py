"""INT8 ONNX from a quantized torch model, in the form each runtime runs best.

One set of trained quantization parameters, two forms:

- ``tensorrt``: TensorRT's explicit-quantization convention. Every QuantizeLinear/DequantizeLinear is
  int8 with zero point 0 (symmetric); weights are stored as int8 initializers with per-channel scales on
  axis 0 (output channels); activations are per-tensor. Q/DQ sit on the inputs of Conv/Gemm/MatMul
  (and of residual Adds, which TensorRT fuses).
- ``cpu``: the same grid written with uint8 activations (u8s8), which x86 onnxruntime and OpenVINO run
  fastest: int8 with zero point 0 and scale s is exactly uint8 with zero point 128 and the same scale
  (both represent -128 s .. 127 s), so this rewrite changes no value. Weights stay int8 per channel.

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
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import ExportError

Form = Literal["tensorrt", "cpu"]
QUANT_OPS = ("QuantizeLinear", "DequantizeLinear")
WEIGHTED_OPS = ("Conv", "Gemm", "MatMul", "ConvTranspose")
PASS_THROUGH = ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "GlobalAveragePool", "AveragePool", "MaxPool")


@dataclass
class PassReport:
    weights_folded: int = 0
    batchnorms_folded: int = 0
    activations_rewritten: int = 0
    relus_in_integer_domain: int = 0
    notes: list[str] = field(default_factory=list)


class _Graph:
    """Just enough of a graph view to rewrite Q/DQ patterns on an onnx.ModelProto in place."""

    def __init__(self, model):
        from onnx import numpy_helper

        self.model = model
        self.g = model.graph
        self.nh = numpy_helper
        self.inits = {i.name: i for i in self.g.initializer}
        self.refresh()

    def refresh(self) -> None:
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

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
        if w is None or scale is None or zp is None or w.ndim < 2:
            continue
        axis = _attr(q, "axis", 1)
        axis = axis + w.ndim if axis < 0 else axis
        narrow = scale.ndim == 1 and scale.size > 1 and zp.dtype == np.int8  # NNCF weights: -127..127
        qw = _quantize(w, scale, zp, axis)
        if narrow:
            qw = np.clip(qw, -127, 127).astype(np.int8)
        name = graph.add_init(q.input[0] + "_int8", qw)
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
        gamma, beta, mean, var = (graph.const(n) for n in bn.input[1:5])
        if any(v is None for v in (gamma, beta, mean, var)):
            continue
        eps = _attr(bn, "epsilon", 1e-5)
        k = (gamma / np.sqrt(var + eps)).astype(np.float32)
        qw = graph.nh.to_array(graph.inits[dq.input[0]])
        scale = graph.const(dq.input[1])
        zp = graph.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros((), qw.dtype)
        axis = _attr(dq, "axis", 1)
        if scale.ndim != 1 or axis != 0 or np.any(zp != 0) or qw.dtype != np.int8 or qw.min() < -127:
            report.notes.append(f"BatchNorm {bn.name} kept: its conv's weights are not per-channel symmetric narrow-range")
            continue
        sign = np.where(k < 0, -1, 1).astype(np.int8)
        new_w = (qw * sign.reshape(-1, *([1] * (qw.ndim - 1)))).astype(np.int8)
        new_scale = (scale.astype(np.float32) * np.abs(k)).astype(np.float32)
        bias = graph.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros_like(mean)
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


def rewrite_activations(graph: _Graph, form: Form, report: PassReport) -> None:
    """Per-tensor activation Q/DQ pairs into the target form's dtype (see the module docstring)."""
    seen: dict[str, str] = {}
    for node in graph.g.node:
        if node.op_type not in QUANT_OPS or len(node.input) < 3 or node.input[0] in graph.inits:
            continue
        scale, zp = graph.const(node.input[1]), graph.const(node.input[2])
        if scale is None or zp is None or scale.size != 1:
            continue
        key = node.input[2]
        if form == "cpu" and zp.dtype == np.int8:
            if np.any(zp != 0):
                raise ExportError(f"{node.name}: an int8 activation zero point is not 0; expected symmetric activations")
            if key not in seen:
                seen[key] = graph.add_init(key + "_u8", np.full(zp.shape, 128, np.uint8))
                report.activations_rewritten += 1
            node.input[2] = seen[key]
        elif form == "tensorrt" and zp.dtype == np.uint8:
            raise ExportError(
                f"{node.name}: an unsigned (uint8) activation quantizer cannot be written in TensorRT's int8 convention "
                "without changing its scale",
                hint="quantize with the qat/ptq defaults `preset: performance` and `activations: signed`, "
                "or write `int8_forms: [cpu]` only")
    graph.refresh()


def relu_in_integer_domain(graph: _Graph, report: PassReport) -> None:
    """``Conv|Add -> Relu -> Q(s, z)`` becomes ``Conv|Add -> Q(s, z) -> Clip(min=z)`` (cpu form).

    onnxruntime fuses ``DQ -> Conv -> Q`` into an integer QLinearConv (and Add into QLinearAdd) only
    when Q follows directly; it drops a Relu only when the zero point is the type's minimum, which a
    symmetric grid's (uint8, zero point 128) is not, and otherwise runs DQ -> Relu -> Q in float.
    On a grid that contains 0, Q(relu(x)) == max(Q(x), z) exactly (round and clip are monotone and
    Q(0) == z), so the Relu becomes an integer Clip on the quantized tensor.
    """
    from onnx import helper

    added, dead = [], []
    for relu in list(graph.g.node):
        if relu.op_type != "Relu":
            continue
        q = graph.only_consumer(relu.output[0])
        src = graph.producer.get(relu.input[0])
        if q is None or q.op_type != "QuantizeLinear" or src is None or src.op_type not in ("Conv", "Add", "Gemm", "MatMul"):
            continue
        zp = graph.const(q.input[2]) if len(q.input) > 2 and q.input[2] else None
        if zp is None or zp.size != 1 or graph.only_consumer(src.output[0]) is not relu:
            continue
        pre = relu.input[0] + "_q"
        added.append(helper.make_node("QuantizeLinear", [relu.input[0], *q.input[1:]], [pre], name=relu.name + "_q"))
        low = graph.add_init(relu.name + "_zero", zp.reshape(()).astype(zp.dtype))
        added.append(helper.make_node("Clip", [pre, low], [q.output[0]], name=relu.name + "_int"))
        dead += [relu, q]
        report.relus_in_integer_domain += 1
    graph.remove(dead)
    graph.g.node.extend(added)
    _toposort(graph)


def _toposort(graph: _Graph) -> None:
    known = {i.name for i in graph.g.input} | set(graph.inits)
    pending, ordered = list(graph.g.node), []
    while pending:
        ready = [n for n in pending if all(not i or i in known for i in n.input)]
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


def convert(model, form: Form) -> PassReport:
    """Apply the passes to an onnx.ModelProto (exported from a stripped NNCF model) in place."""
    graph = _Graph(model)
    report = PassReport()
    fold_weight_quantizers(graph, report)
    fold_batchnorm(graph, report)
    rewrite_activations(graph, form, report)
    if form == "cpu":
        relu_in_integer_domain(graph, report)
    _remove_identities(graph)
    graph.prune_initializers()
    _short_tensor_names(graph)
    left = Counter(n.op_type for n in graph.g.node)
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


def _remove_identities(graph: _Graph) -> None:
    """Reconnect the users of each internal Identity to its input, then drop the Identity."""
    identities = [n for n in graph.g.node if n.op_type == "Identity" and n.output[0] not in graph.outputs]
    for node in identities:
        for user in graph.consumers.get(node.output[0], []):
            user.input[:] = [node.input[0] if name == node.output[0] else name for name in user.input]
    graph.remove(identities)


def check_convention(model, form: Form) -> list[str]:
    """Problems with ``model`` against the form's convention (empty when it conforms)."""
    graph = _Graph(model)
    problems = []
    for node in graph.g.node:
        if node.op_type not in QUANT_OPS:
            continue
        zp = graph.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        scale = graph.const(node.input[1])
        weight = node.input[0] in graph.inits
        if zp is None:
            problems.append(f"{node.name}: no explicit zero point")
            continue
        if weight:
            if zp.dtype != np.int8 or np.any(zp != 0):
                problems.append(f"{node.name}: weight zero point must be int8 0")
            if scale.size > 1 and _attr(node, "axis", 1) != 0:
                problems.append(f"{node.name}: per-channel weight scales must be on axis 0")
        else:
            if scale.size != 1:
                problems.append(f"{node.name}: activation scale must be per-tensor")
            if form == "tensorrt" and (zp.dtype != np.int8 or np.any(zp != 0)):
                problems.append(f"{node.name}: activation must be int8 with zero point 0")
    for node in graph.g.node:
        if node.op_type in WEIGHTED_OPS:
            for k, name in enumerate(node.input[:2]):
                src = graph.producer.get(name)
                # NNCF places an activation quantizer before ops that do not change the grid much
                # (pooling, flatten); runtimes propagate Q/DQ through them.
                while k == 0 and src is not None and src.op_type in PASS_THROUGH:
                    src = graph.producer.get(src.input[0])
                if src is None or src.op_type != "DequantizeLinear":
                    problems.append(f"{node.op_type} {node.name}: input {name!r} is not dequantized from int8")
    return problems


def export_int8_onnx(stripped, example, path: Path, *, form: Form, opset: int = 17, dynamic_batch: bool = True) -> PassReport:
    """Export a model stripped to torch's fake-quant ops (``handle.int8_module(example)``), then convert to ``form``."""
    import tempfile

    import onnx

    from ..artifacts import atomic_path
    from .onnx import export_onnx

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw = Path(tmp) / "qdq.onnx"
        export_onnx(stripped, example.cpu(), raw, opset=max(opset, 13), dynamic_batch=dynamic_batch)
        model_proto = onnx.load(str(raw))
    report = convert(model_proto, form)
    problems = check_convention(model_proto, form)
    if problems:
        raise ExportError(f"the INT8 ONNX ({form}) does not meet its convention: " + "; ".join(problems[:3])
                          + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    with atomic_path(path) as tmp_path:
        onnx.save(model_proto, str(tmp_path))
        onnx.checker.check_model(str(tmp_path))
    return report
