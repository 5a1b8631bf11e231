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

The CPU plugin also miscomputes a padded convolution whose input channels carry different zero points (issue 41): a
U-Net's ``Concat`` of a ``ConvTranspose`` output (signed: uint8 zero point 128) and a ReLU skip (zero point 0) into
a 3x3 ``Conv``. The plugin passes such per-channel input zero points to its oneDNN fork's "legacy zero point" jit
kernels (``jit_avx512_I8``; ``jit_avx2_I8`` on AVX2), which, at padded positions, load the zero points of the first
four channels of an input-channel block (16 channels with AVX-512, 8 with AVX2) and use them for the whole block
(``compute_ker`` in ``jit_avx512_core_x8s8s32x_conv_kernel.cpp`` broadcasts ``input_zp`` only when ``ic == 0``).
Only the border pixels go wrong: on an AVX-512 VNNI + BF16 EPYC the U-Net's INT8 IR read cosine 0.77 to the INT8
ONNX at both precision hints; with each Conv's output added to the IR's outputs and compared with onnxruntime's, every
error sat in the first and last row and column of its 24x24 decoder conv (interior max diff 0.02, earlier layers
right). A two-branch ``Concat -> Conv`` reproduces it whenever the zero point changes inside a block (8 + 8 channels:
max diff 66 on values up to 81) and never when each block is uniform (16 + 16; zero points alternating 128, 0 but
alike in every group of four). ``ONEDNN_MAX_CPU_ISA=AVX2`` moves it to the 8-channel block (the width-8 U-Net's
8 + 8 halves are right there; 4 + 4 is not). An explicit ``Pad`` does not help (the plugin folds it into the
Conv). So such a Conv is written as one Conv per Concat input, each reading the weights of its channels, summed
(``_split_mixed_zero_point_convs``): each reads one zero point, which the kernels handle (the stock per-tensor zero
point, ``brgconv``), and the sum is the same function (int32 sums added in float). Measured (batch 32, 16x16, one
thread, f32 hint): as fast where the branches fill whole blocks (16 + 16 channels: 1.61 ms split, 1.64 ms as exported;
32 + 32: 1.51 and 1.89), slower where they do not (8 + 8: 0.40 ms against 0.29 ms that were wrong); the U-Net's INT8
IR ran 1.7-2.3 ms against its FP32 IR's 2.8-6.8 ms at batch 32.
"""

from __future__ import annotations

from pathlib import Path

#: Reductions that take their axes as a second input (opset 13+ for ReduceSum, 18+ for the others) or attribute.
REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")


def prepared_for_openvino(onnx_file: Path, folder: Path, int8_tables: bool = False) -> Path:
    """``onnx_file``, or a copy in ``folder`` where every ``keepdims=0`` reduction whose output a ``Mul`` reads
    reduces with ``keepdims=1`` and is followed by a ``Squeeze`` of its axes, every padded Conv of a Concat whose
    inputs have different zero points is one Conv per input, summed (see the module docstring), and, with
    ``int8_tables``, every float table on the int8 row grid is stored int8."""
    import onnx

    from .embedding import quantize_embeddings

    model = onnx.load(str(onnx_file))
    changed = _keepdims(model)
    changed = _split_mixed_zero_point_convs(model) or changed
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


def _split_mixed_zero_point_convs(model) -> bool:
    """Write each padded ``Conv`` (one group) that reads a channel ``Concat`` of DequantizeLinear outputs with
    different per-tensor zero points as one Conv per Concat input, over the weights of that input's channels, the
    bias on the first, summed by ``Add`` into the Conv's output (see the module docstring). Convs whose channel
    counts or weights are not constant here are left as they are."""
    from onnx import shape_inference

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    inits = {i.name: i for i in graph.initializer}
    shapes = None
    changed = False
    for conv in list(graph.node):
        if conv.op_type != "Conv" or _attr(conv, "group", 1) != 1 or not _reads_padding(conv):
            continue
        concat = producers.get(conv.input[0])
        if concat is None or concat.op_type != "Concat" or _attr(concat, "axis", 0) != 1:
            continue
        branches, concats = _branches(concat, producers)
        zero_points = [_zero_point(producers.get(name), inits) for name in branches]
        if any(z is None for z in zero_points) or len(set(zero_points)) < 2:
            continue
        if shapes is None:
            try:
                inferred = shape_inference.infer_shapes(model).graph
                shapes = {v.name: v.type.tensor_type.shape for v in list(inferred.value_info) + list(inferred.input)}
            except Exception:  # noqa: BLE001 - a model shape inference cannot read (over 2 GB): its Convs stay whole
                shapes = {}
        channels = [_channels(shapes.get(name)) for name in branches]
        weight = _weight(conv.input[1], producers, inits)
        if any(c is None for c in channels) or weight is None or weight[0].shape[1] != sum(channels):
            continue
        _split_conv(graph, conv, list(zip(branches, channels)), weight, inits)
        dq = weight[1]
        _drop_unread(graph, concats + ([dq] if dq is not None else []), [dq.input[0] if dq is not None else conv.input[1]], inits)
        changed = True
    return changed


def _split_conv(graph, conv, branches: list, weight: tuple, inits: dict) -> None:
    """Replace ``conv`` in ``graph`` by one Conv per ``(tensor, channels)`` of ``branches`` over those channels of
    ``weight`` (``(weights, their DequantizeLinear or None)``), the bias on the first, summed into its output."""
    import numpy as np
    from onnx import helper, numpy_helper

    w, dq = weight
    parts: list[str] = []
    start = 0
    for i, (name, count) in enumerate(branches):
        w_name = _unique(inits, f"{conv.input[1]}_part{i}")
        inits[w_name] = numpy_helper.from_array(np.ascontiguousarray(w[:, start : start + count]), w_name)
        graph.initializer.append(inits[w_name])
        start += count
        new: list = []
        if dq is not None:
            new.append(helper.make_node("DequantizeLinear", [w_name, *dq.input[1:]], [w_name + "_dq"],
                                        name=f"{dq.name}_part{i}", axis=_attr(dq, "axis", 1)))
            w_name += "_dq"
        out = f"{conv.output[0]}_part{i}"
        conv_i = helper.make_node("Conv", [name, w_name] + (list(conv.input[2:3]) if i == 0 else []), [out],
                                  name=f"{conv.name}_part{i}")
        conv_i.attribute.extend(conv.attribute)
        new.append(conv_i)
        if parts:
            total = conv.output[0] if i == len(branches) - 1 else f"{conv.output[0]}_sum{i}"
            new.append(helper.make_node("Add", [parts[-1], out], [total], name=f"{conv.name}_sum{i}"))
            out = total
        parts.append(out)
        index = list(graph.node).index(conv)
        for offset, node in enumerate(new):
            graph.node.insert(index + offset, node)
    graph.node.remove(conv)


def _branches(concat, producers) -> tuple[list[str], list]:
    """The tensors a channel Concat joins, those of the channel Concats among its inputs in their place (DenseNet-style
    nesting), and every Concat met, outermost first: each Conv of the split reads one of the tensors."""
    found: list[str] = []
    concats = [concat]
    for name in concat.input:
        inner = producers.get(name)
        if inner is not None and inner.op_type == "Concat" and _attr(inner, "axis", 0) == 1:
            names, nested = _branches(inner, producers)
            found += names
            concats += nested
        else:
            found.append(name)
    return found, concats


def _unique(taken, name: str) -> str:
    while name in taken:
        name += "_"
    return name


def _attr(node, name: str, default):
    from onnx import helper

    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def _reads_padding(conv) -> bool:
    auto_pad = _attr(conv, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    return auto_pad in ("SAME_UPPER", "SAME_LOWER") or any(int(p) for p in _attr(conv, "pads", []))


def _zero_point(dq, inits):
    """The per-tensor zero point of a DequantizeLinear (0 when it has none), None when not one constant."""
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    if len(dq.input) < 3 or not dq.input[2]:
        return 0
    found = inits.get(dq.input[2])
    if found is None:
        return None
    from onnx import numpy_helper

    value = numpy_helper.to_array(found)
    return int(value.reshape(-1)[0]) if value.size == 1 else None


def _channels(shape):
    """The channel (second) dimension of a tensor shape proto, or None where it is not a number."""
    if shape is None or len(shape.dim) < 2 or not shape.dim[1].HasField("dim_value"):
        return None
    return int(shape.dim[1].dim_value)


def _weight(name: str, producers, inits):
    """``(weights, DequantizeLinear or None)`` of a Conv's weight input: a constant, or the DequantizeLinear of one
    with its scale per tensor or per output channel (axis 0); None otherwise."""
    from onnx import numpy_helper

    if name in inits:
        return numpy_helper.to_array(inits[name]), None
    dq = producers.get(name)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return None
    scale = inits.get(dq.input[1])
    if scale is None or (numpy_helper.to_array(scale).size > 1 and _attr(dq, "axis", 1) != 0):
        return None
    return numpy_helper.to_array(inits[dq.input[0]]), dq


def _drop_unread(graph, nodes, constants: list[str], inits) -> None:
    """Remove each of ``nodes``, then each initializer named in ``constants``, that nothing reads any more."""
    for node in nodes:
        read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
        if node in graph.node and not any(out in read for out in node.output):
            graph.node.remove(node)
    read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name in constants and i.name not in read]:
        graph.initializer.remove(init)
        inits.pop(init.name, None)
