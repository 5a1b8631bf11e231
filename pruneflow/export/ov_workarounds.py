"""ONNX rewrites, equivalent in every runtime, that keep OpenVINO from computing a graph wrongly.

OpenVINO 2026.4's CPU plugin miscomputes ``ReduceSum(keepdims=0) -> Mul(per-channel constant) -> FakeQuantize ->
MatMul``: a ``[B, E, H]`` tensor summed over E, scaled per channel (NNCF's SmoothQuant multiplier) and quantized
for a Linear gave outputs off by 3.2 where they reach 18.7 (onnxruntime and OpenVINO without the FakeQuantize
agree to 1e-6). An MMoE's gated sum of its experts is exactly that graph: its INT8 IR failed parity in every form
(cosine 0.929, issue 37) while the same ONNX is faithful in onnxruntime. The same reduction with ``keepdims=1``
followed by a ``Squeeze`` of the reduced axes computes the same tensor and OpenVINO then gets it right (max diff
4e-6, ``tests/test_multi_task.py``). No switch in OpenVINO turns the faulty fusion off, so the IR is converted
from a rewritten copy of the ONNX; the ONNX artifacts are left as they are.

    path = prepared_for_openvino(onnx_file, tmp_dir)   # the same file when nothing needs rewriting

``int8_tables`` does what the IR needs beside: the TensorRT form of the INT8 ONNX keeps the embedding tables float
(TensorRT reads them so), and an IR converted from it, the one OpenVINO often runs fastest, stored a ranker's tables
in float32 (an INT8 IR larger than the FP32 one, issue 37's DLRM); the tables the quantization stage put on the
int8 grid are stored int8 with their per-row scales there too (``embedding.quantize_embeddings``), which OpenVINO
keeps as i8 constants.
"""

from __future__ import annotations

from pathlib import Path

#: Reductions that take their axes as a second input (opset 13+ for ReduceSum, 18+ for the others) or attribute.
REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")


def prepared_for_openvino(onnx_file: Path, folder: Path, int8_tables: bool = False) -> Path:
    """``onnx_file``, or a copy in ``folder`` where every ``keepdims=0`` reduction whose output a ``Mul`` reads
    reduces with ``keepdims=1`` and is followed by a ``Squeeze`` of its axes (see the module docstring), and, with
    ``int8_tables``, every float table on the int8 row grid is stored int8."""
    import onnx

    from .embedding import quantize_embeddings

    model = onnx.load(str(onnx_file))
    changed = _keepdims(model)
    if int8_tables and quantize_embeddings(model, on_grid=True).tables:
        changed = True
    if not changed:
        return onnx_file
    out = folder / f"{onnx_file.stem}.openvino.onnx"
    onnx.save(model, str(out))
    return out


def _keepdims(model) -> bool:
    from onnx import numpy_helper

    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    changed = False
    for node in list(graph.node):
        keep = next((a for a in node.attribute if a.name == "keepdims"), None)
        if node.op_type not in REDUCTIONS or keep is None or keep.i != 0:
            continue
        if not any(r.op_type == "Mul" for r in readers.get(node.output[0], [])):
            continue
        axes = _axes(node, constants)
        if axes is None:
            continue
        changed = True
        keep.i = 1
        reduced, squeezed = node.output[0] + "_kept", node.output[0]
        node.output[0] = reduced
        axes_name = f"{node.name or reduced}_squeeze_axes"
        if opset >= 13:  # Squeeze takes its axes as an input from opset 13 on, as an attribute before
            graph.initializer.append(numpy_helper.from_array(axes, axes_name))
        index = list(graph.node).index(node)
        graph.node.insert(index + 1, _squeeze(reduced, squeezed, axes, axes_name, opset, f"{node.name}_squeeze"))
    return changed


def _squeeze(source: str, out: str, axes, axes_name: str, opset: int, name: str):
    from onnx import helper

    if opset >= 13:
        return helper.make_node("Squeeze", [source, axes_name], [out], name=name)
    return helper.make_node("Squeeze", [source], [out], name=name, axes=[int(a) for a in axes])


def _axes(node, constants):
    """The reduced axes as int64, from the axes input or the ``axes`` attribute; None where they are not constant."""
    import numpy as np

    if len(node.input) > 1 and node.input[1]:
        found = constants.get(node.input[1])
        return None if found is None else np.asarray(found, dtype=np.int64).reshape(-1)
    attribute = next((a for a in node.attribute if a.name == "axes"), None)
    return None if attribute is None else np.asarray(list(attribute.ints), dtype=np.int64)
