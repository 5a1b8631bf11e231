"""Quantizer placement: where Q/DQ sit for each form. TensorRT's residual Adds, one quantizer per tensor,
data-movement ops requantized so what reads them runs in int8, and rounding dropped before a float Concat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .graph import _activation_zero_point, _attr, _dequantized, _drop_unused_quantizers, _Graph, PassReport, _toposort, WEIGHTED_OPS


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
