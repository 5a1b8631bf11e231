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

The fused file holds com.microsoft ops that only onnxruntime runs; the targets that convert an ONNX (OpenVINO,
TensorRT, Ascend) read a portable export instead (``is_portable``).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _projection_width(node, producer: dict, values: dict) -> int | None:
    """The output width of the ``MatMul(x, W) [+ b]`` feeding ``node``'s first input, when W is a constant."""
    source = producer.get(node.input[0])
    if source is not None and source.op_type == "Add":
        source = next((producer[i] for i in source.input if i in producer and producer[i].op_type == "MatMul"), None)
    if source is None or source.op_type != "MatMul":
        return None
    w = values.get(source.input[1])
    return int(w.shape[-1]) if w is not None and w.ndim == 2 else None


def pin_head_counts(model) -> list[int]:
    """Write each attention layer's head count into the ``Concat(batch, sequence, -1, head_size)`` shapes its Q, K
    and V projections are reshaped with (in place), and return the counts in graph order (Q's, one per layer)."""
    from onnx import numpy_helper

    graph = model.graph
    values = _values(graph)
    producer = {out: node for node in graph.node for out in node.output}
    pinned: dict[str, int] = {}
    heads = []
    for node in graph.node:
        concat = producer.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 4:
            continue
        count, size = values.get(concat.input[2]), values.get(concat.input[3])
        width = _projection_width(node, producer, values)
        if count is None or size is None or count.size != 1 or size.size != 1 or width is None:
            continue
        if int(count.reshape(-1)[0]) != -1 or int(size.reshape(-1)[0]) <= 0 or width % int(size.reshape(-1)[0]):
            continue
        n = width // int(size.reshape(-1)[0])
        name = f"{concat.input[2]}_heads{n}"
        if name not in pinned:
            graph.initializer.append(numpy_helper.from_array(np.array([n], dtype=count.dtype), name))
            pinned[name] = n
        concat.input[2] = name
        heads.append(n)
    return heads[::3] if len(heads) % 3 == 0 else heads


def fuse_for_onnxruntime(src: Path, dst: Path, samples: Any) -> Fusion:
    """Write ``src`` fused with onnxruntime's transformer optimizer to ``dst`` when it is a BERT-like encoder the
    optimizer fuses (``Fusion.kept``) and the fused graph computes what ``src`` does on ``samples`` (a dict of
    numpy token arrays); otherwise write nothing and say why (``Fusion.why``)."""
    onnx = require("onnx", "pip install onnx", "the onnx target")
    model = onnx.load(str(src))
    fusion = Fusion(heads=pin_head_counts(model))
    if not fusion.heads:
        fusion.why = "no attention layer whose head count could be read from its projections"
        return fusion
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        optimized = optimize_bert(model, Path(tmp))
        fusion.ops = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
        if fusion.ops.get("Attention", 0) != len(fusion.heads):
            fusion.why = (f"onnxruntime's optimizer fused {fusion.ops.get('Attention', 0)} of {len(fusion.heads)} attention "
                          "layers")
            return fusion
        fused = Path(tmp) / "fused.onnx"
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
        outs.append(session.run(None, {k: v for k, v in samples.items() if k in names}))
    diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(*outs))
    scale = max(1.0, max(float(np.max(np.abs(x))) for x in outs[0]))
    return diff / scale


def is_portable(path: Path) -> bool:
    """Whether an ONNX file holds only standard ops (no com.microsoft fusion that only onnxruntime runs)."""
    onnx = require("onnx", "pip install onnx", "the onnx target")
    graph = onnx.load(str(path), load_external_data=False).graph
    return not any(node.domain == "com.microsoft" for node in graph.node)
