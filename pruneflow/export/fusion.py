"""onnxruntime's transformer fusions, made correct for pruned encoders and checked (issue 25, item 2).

onnxruntime runs a BERT fastest through its contrib ops: ``Attention`` (Q, K and V in one GEMM, scores, mask and
softmax in one kernel), ``EmbedLayerNormalization``, ``SkipLayerNormalization`` and ``BiasGelu``. Its transformer
optimizer (``onnxruntime.transformers.optimizer``) rewrites a float graph into them, but it reads each layer's
head count from the shape its Q projection is reshaped to, and torch's exporter writes that shape as
``Concat(batch, sequence, -1, head_size)``. The optimizer then falls back to the one ``num_heads`` its caller
gives: none, and it fuses nothing (a pruned MiniLM-L6 ran 0.8x of plain onnxruntime); one, and a model whose
layers keep different head counts ([8, 8, 4, 3, 8, 5]) is fused with the wrong count in some layers (2 of 32
predictions flipped). ``pin_head_counts`` writes each layer's own count into its shapes (the width of its
projection over the head size: exact, the graph computes the same), after which the optimizer detects it layer by
layer. The fused graph is then run beside the unfused one on real samples; a difference beyond float rounding
keeps the unfused graph and says why. What is written by hand here is only the pinning and the check: the fusions
are onnxruntime's.

The fused file holds com.microsoft ops that only onnxruntime runs: the openvino and tensorrt targets convert a
standard export of their own (the onnx artifact's ``fused_ops`` metric says it is fused), `pruneflow bench`
opens it in onnxruntime only (``is_portable``), and the ascend target uses it only as its onnxruntime reference.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..deps import require

#: A fused graph is kept when every output is within this of the unfused one's, relative to the largest output
#: (float rounding of the fused kernels: 5e-7 measured on a two-layer BERT).
TOLERANCE = 1e-3


@dataclass
class Fusion:
    """What the transformer optimizer fused, per op type, and each layer's head count."""

    heads: list[int] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    max_diff: float = float("nan")
    kept: bool = False
    #: com.microsoft nodes in the fused file (what only onnxruntime runs)
    contrib_ops: int = 0
    why: str = ""

    def note(self) -> str:
        fused = ", ".join(f"{n} {op}" for op, n in self.ops.items() if n)
        if not self.kept:
            return f"onnxruntime's transformer fusions not applied: {self.why}"
        return (f"fused for onnxruntime ({fused}; heads per layer {self.heads}); max |difference| to the unfused graph "
                f"{self.max_diff:.2e} on real samples; com.microsoft ops: onnxruntime only")


def _values(graph) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _projection_width(node, producer: dict, values: dict) -> tuple[int, str] | None:
    """(output width, input tensor) of the ``MatMul(x, W) [+ b]`` feeding ``node``'s first input, W a constant."""
    source = producer.get(node.input[0])
    if source is not None and source.op_type == "Add":
        source = next((producer[i] for i in source.input if i in producer and producer[i].op_type == "MatMul"), None)
    if source is None or source.op_type != "MatMul":
        return None
    w = values.get(source.input[1])
    return (int(w.shape[-1]), source.input[0]) if w is not None and w.ndim == 2 else None


def pin_head_counts(model) -> list[int]:
    """Write each attention layer's head count into the ``Concat(batch, sequence, -1, head_size)`` shapes its Q, K
    and V projections are reshaped with (in place), and return the counts, one per layer (the projections reading
    one tensor), in graph order. Returns [] (the graph is then not to be fused) when a shape shared by projections
    of different widths cannot hold one count, or the three projections of a layer disagree."""
    from onnx import numpy_helper

    graph = model.graph
    values = _values(graph)
    producer = {out: node for node in graph.node for out in node.output}
    per_concat: dict[str, int] = {}  # by the Concat's output
    layers: dict[str, set[int]] = {}
    for node in graph.node:
        concat = producer.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        found = _head_count(node, concat, producer, values) if concat is not None else None
        if concat is None or found is None:
            continue
        n, root = found
        if per_concat.setdefault(concat.output[0], n) != n:
            return []
        layers.setdefault(root, set()).add(n)
    if any(len(counts) != 1 for counts in layers.values()):
        return []
    for node in graph.node:  # every shape read, then every shape written: a shared Concat is pinned once
        pinned = per_concat.get(node.output[0]) if node.op_type == "Concat" else None
        if pinned is not None:
            name = f"{node.output[0]}_heads{pinned}"
            graph.initializer.append(numpy_helper.from_array(np.array([pinned], dtype=np.int64), name))
            node.input[2] = name
    return [next(iter(counts)) for counts in layers.values()]


def _head_count(reshape, concat, producer: dict, values: dict) -> tuple[int, str] | None:
    """(head count, the tensor the projection reads) for ``Reshape(MatMul(x, W) [+ b], Concat(b, s, -1, size))``."""
    if concat.op_type != "Concat" or len(concat.input) != 4:
        return None
    count, size = values.get(concat.input[2]), values.get(concat.input[3])
    width = _projection_width(reshape, producer, values)
    if count is None or size is None or count.size != 1 or size.size != 1 or width is None:
        return None
    head_size = int(size.reshape(-1)[0])
    if int(count.reshape(-1)[0]) != -1 or head_size <= 0 or width[0] % head_size:
        return None
    return width[0] // head_size, width[1]


def fuse_for_onnxruntime(src: Path, dst: Path, samples: Any, stamp: Callable[[Any], None] | None = None) -> Fusion:
    """Write ``src`` fused with onnxruntime's transformer optimizer to ``dst`` when it is a BERT-like encoder the
    optimizer fuses (``Fusion.kept``) and the fused graph computes what ``src`` does on ``samples`` (a dict of
    numpy token arrays); otherwise write nothing and say why (``Fusion.why``). ``stamp`` changes the fused
    ModelProto (its metadata) before it is written."""
    onnx = require("onnx", "pip install onnx", "the onnx target")
    model = onnx.load(str(src))
    fusion = Fusion(heads=pin_head_counts(model))
    if not fusion.heads:
        fusion.why = "no attention layer whose head count could be read from its projections"
        return fusion
    try:
        return _fuse_pinned(model, src, dst, samples, fusion, stamp)
    except Exception as exc:  # noqa: BLE001 - the optimizer or the check failing leaves the file as exported
        fusion.why = f"onnxruntime's transformer optimizer failed on it: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return fusion


def _fuse_pinned(model, src: Path, dst: Path, samples: Any, fusion: Fusion, stamp: Callable[[Any], None] | None) -> Fusion:
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        optimized = optimize_bert(model, Path(tmp))
        fusion.ops = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
        if fusion.ops.get("Attention", 0) != len(fusion.heads):
            fusion.why = (f"onnxruntime's optimizer fused {fusion.ops.get('Attention', 0)} of {len(fusion.heads)} attention "
                          "layers")
            return fusion
        fused = Path(tmp) / "fused.onnx"
        if stamp is not None:
            stamp(optimized.model)
        fusion.contrib_ops = sum(n.domain == "com.microsoft" for n in optimized.model.graph.node)
        optimized.save_model_to_file(str(fused))
        fusion.max_diff = _max_difference(src, fused, samples)
        if not fusion.max_diff <= TOLERANCE:
            fusion.why = (f"the fused graph differs from the unfused one by {fusion.max_diff:.3g} (relative) on real samples: "
                          "kept unfused")
            return fusion
        fused.replace(dst)
    fusion.kept = True
    return fusion


def optimize_bert(model, tmp: Path):
    """onnxruntime's transformer optimizer on a ModelProto whose head counts are pinned: its python fusions only
    (``opt_level=0``: no host-specific onnxruntime rewrites in the file), the attention mask kept as the model's
    own 0/1 mask. onnxruntime's default for BERT turns the mask into one length per row, which is right only for
    right-padded rows: a left-padded batch would attend to its padding and answer wrongly without a sign."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    onnx = require("onnx", "pip install onnx", "the onnx target")
    onnx.save(model, str(tmp / "pinned.onnx"))
    options = FusionOptions("bert")
    options.use_raw_attention_mask(True)
    # onnxruntime 1.32's CPU SkipLayerNormalization took 33 ms where the Add + LayerNormalization it replaces take 3.5
    # (pruned MiniLM-L6, batch 32, 44 tokens, one thread, AVX-512 EPYC): the residual Adds and LayerNorms stay
    options.enable_skip_layer_norm = False
    options.enable_embed_layer_norm = False
    logging.disable(logging.WARNING)  # its fusion modules log to top-level loggers of their own
    try:
        return optimize_model(str(tmp / "pinned.onnx"), model_type="bert", num_heads=0, hidden_size=0, opt_level=0,
                              optimization_options=options)
    finally:
        logging.disable(logging.NOTSET)


def _max_difference(a: Path, b: Path, samples: Any) -> float:
    """The largest |difference| between the outputs of two ONNX files on ``samples``, over the largest |output|."""
    ort = require("onnxruntime", "pip install onnxruntime", "the onnx target")
    outs = []
    for path in (a, b):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}
        feed = {k: v for k, v in samples.items() if k in names}
        static = isinstance(session.get_inputs()[0].shape[0], int)  # a graph exported for batch 1: a row at a time
        rows = [{k: v[i : i + 1] for k, v in feed.items()} for i in range(len(next(iter(feed.values()))))] if static else [feed]
        runs = [session.run(None, row) for row in rows]
        outs.append([np.concatenate([r[i] for r in runs]) for i in range(len(runs[0]))])
    diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(*outs))
    scale = max(1.0, max(float(np.max(np.abs(x))) for x in outs[0]))
    return diff / scale


def is_portable(path: Path) -> bool:
    """Whether an ONNX file holds only standard ops (no com.microsoft fusion that only onnxruntime runs)."""
    onnx = require("onnx", "pip install onnx", "the onnx target")
    graph = onnx.load(str(path), load_external_data=False).graph
    return not any(node.domain == "com.microsoft" for node in graph.node)
