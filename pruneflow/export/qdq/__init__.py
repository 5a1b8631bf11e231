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

from .checks import check_convention, float_ops
from .encodings import fit_u8s8_pairs, relu_in_integer_domain, rewrite_activations, u8s8_overflow_risks
from .folding import fold_batchnorm, fold_smooth_quant_scales, fold_weight_quantizers, quantize_gemm_biases
from .graph import CONVENTIONS, ENCODINGS, Convention, Encoding, Form, PassReport, _Graph, _remove_identities, _short_tensor_names, convention
from .placement import drop_rounding_before_float_concats, place_residual_quantizers, requantize_moves, share_input_quantizers

#: What callers import from ``pruneflow.export.qdq``; the passes themselves live in the modules by concern:
#: ``graph`` (the view, the report, the form and encoding names), ``placement``, ``encodings`` (and their u8s8 fit),
#: ``folding`` and ``checks``.
__all__ = ["CONVENTIONS", "ENCODINGS", "Convention", "Encoding", "Form", "PassReport", "check_convention", "convention", "convert",
           "float_ops", "u8s8_overflow_risks"]


def convert(model, form: Form, encoding: str = "u8s8") -> PassReport:
    """Apply the passes to an onnx.ModelProto (exported from a stripped NNCF model) in place; ``encoding`` is
    the cpu form's activation encoding (``Encoding``)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown INT8 encoding {encoding!r}: one of {', '.join(ENCODINGS)}")
    conv = convention(form)
    encoded = not conv.symmetric_activations  # the cpu form: activations in one of its encodings
    graph = _Graph(model)
    report = PassReport()
    fold_weight_quantizers(graph, report)
    share_input_quantizers(graph, report)
    fold_batchnorm(graph, report)
    fold_smooth_quant_scales(graph, report)
    if encoded:
        drop_rounding_before_float_concats(graph, report)
    guarded = encoded and encoding == "u8s8"
    if conv.symmetric_activations or encoding != "s8s8":
        rewrite_activations(graph, form, report, guard=guarded)
    if encoded and encoding != "s8s8":
        relu_in_integer_domain(graph, report)
    if guarded:
        fit_u8s8_pairs(graph, report)
    if encoded and encoding == "u8s8_vnni" and report.activations_unsigned:
        report.notes.append(f"{report.activations_unsigned} non-negative activation(s) in the full uint8 range (no Clip at "
                            "NNCF's 127 steps): exact on CPUs with VNNI or AMX, may saturate on x86 CPUs without them")
    _remove_identities(graph)
    if encoded:
        requantize_moves(graph, report)
        quantize_gemm_biases(graph, report)
    if conv.residual_placement:
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
