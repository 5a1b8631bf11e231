"""Checks of a converted INT8 graph: the form's convention (zero points, axes, placement) and the weighted ops left
in float."""

from __future__ import annotations

import numpy as np

from .graph import _attr, convention, _dequantized, Form, _Graph, QUANT_OPS, WEIGHTED_OPS
from .placement import residual_adds, _weighted_branch


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
    symmetric = convention(form).symmetric_activations
    if scale.size != 1 and (symmetric or _attr(node, "axis", 1) != 1):
        problems.append(f"{node.name}: activation scale must be per-tensor" + ("" if symmetric else " or per channel (axis 1)"))
    if symmetric and (zp.dtype != np.int8 or np.any(zp != 0)):
        problems.append(f"{node.name}: activation must be int8 with zero point 0")
    return problems


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
    from ..embedding import is_row_dequantize

    graph = _Graph(model)
    problems = []
    for node in graph.g.node:
        if node.op_type in QUANT_OPS and not is_row_dequantize(node, graph.producer):  # a table read: no convention
            problems += _quantizer_problems(graph, node, form)
    if convention(form).residual_placement:
        problems += residual_problems(graph)
    return problems
