"""What Ascend's ATC accepts: the ONNX operators it converts, and the SoC names ``--soc_version`` takes.

Checked before ATC is called, so that an unsupported operator is named with its node instead of
surfacing as one of ATC's opaque error codes (E19999, EZ3002) after minutes of compilation.

Operator list: CANN 8.0.0 (commercial edition) operator list, "支持ONNX算子清单" (supported ONNX
operators), https://www.hiascend.com/doc_center/source/zh/canncommercial/800/apiref/aolapi/operatorlist_00176.html
(overview page: operatorlist_0004, "the ONNX operator list currently applies to Atlas inference products
only", ONNX 1.12, each operator with its own opset range). The CANN 5.0.4 list
(.../canncommercial/5046/reference/fwoperatorlist/operatorlist_0071.html) is the same set less the
operators 8.0 added (Bitwise*, Einsum, GridSample, GRU, IsInf, IsNaN, LayerNormalization, Tan, Trilu,
SoftmaxCrossEntropyLoss, ...). The document spells a few operators unlike ONNX (``Argmax``,
``LogSoftMax``, ``hardmax``); they are written here as ONNX op types. ``QuantizeLinear`` and
``DequantizeLinear`` are not on it: ATC takes float ONNX, and INT8 on Ascend goes through AMCT.

SoC names: ATC's ``--soc_version`` takes ``Ascend`` followed by the chip name ``npu-smi info`` prints
(ATC instructions, "--soc_version"; the names are those of ``compiler/data/platform_config/*.ini`` in a
CANN 8.0 toolkit).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import onnx

#: The source of SUPPORTED_ONNX_OPS, quoted in errors and bundle READMEs.
OPS_SOURCE = ("CANN 8.0.0 operator list, supported ONNX operators "
              "(hiascend.com/doc_center/source/zh/canncommercial/800/apiref/aolapi/operatorlist_00176.html)")

#: SoC families the operator list is documented for ("Atlas inference products").
OPS_DOCUMENTED_FOR = frozenset({"Ascend310P"})

SUPPORTED_ONNX_OPS = frozenset({
    "Abs", "Acos", "Acosh", "AdaptiveAvgPool2D", "Add", "AffineGrid", "And", "ArgMax", "ArgMin",
    "AscendAntiQuant", "AscendQuant", "Asin", "Asinh", "Atan", "Atanh", "AveragePool",
    "BatchNormalization", "BatchMultiClassNMS", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr",
    "BitwiseXor", "Cast", "Ceil", "Celu", "Clip", "Compress", "Concat", "Constant", "ConstantOfShape",
    "Conv", "ConvTranspose", "Corr", "Cos", "Cosh", "CumSum", "DeformableConv2D", "DepthToSpace", "Det",
    "Div", "Dropout", "DynSeqOuter", "Einsum", "Elu", "EmbeddingBag", "Equal", "Erf", "Exp", "Expand",
    "EyeLike", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gemm", "GlobalAveragePool",
    "GlobalLpPool", "GlobalMaxPool", "Greater", "GreaterOrEqual", "GridSample", "GRU", "Hardmax",
    "HardSigmoid", "HardSwish", "Identity", "If", "InstanceNormalization", "IsInf", "IsNaN",
    "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax", "LpNormalization",
    "LpPool", "LRN", "LSTM", "LSTMP", "MatMul", "Max", "MaxPool", "MaxRoiPool", "MaxUnpool", "Mean",
    "MeanVarianceNormalization", "Min", "Mod", "MovingSumWithSigmoid", "Mul", "Multinomial", "Neg",
    "NonMaxSuppression", "NonZero", "Not", "OneHot", "Or", "Pad", "Pow", "RandomNormal",
    "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Range", "Reciprocal", "ReduceL1",
    "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
    "ReduceSum", "ReduceSumSquare", "Relu", "Reshape", "Resize", "ReverseSequence", "RoiAlign",
    "RoiExtractor", "Round", "PRelu", "Scatter", "ScatterElements", "ScatterND", "Selu", "Shape",
    "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Size", "Slice", "Softmax", "SoftmaxCrossEntropyLoss",
    "Softplus", "Softsign", "SpaceToDepth", "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tan", "Tanh",
    "TfIdfVectorizer", "ThresholdedRelu", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where", "Xor",
})

#: ``--soc_version`` values by family (the family names the hardware generation).
SOC_FAMILIES: dict[str, tuple[str, ...]] = {
    "Ascend310": ("Ascend310",),  # Atlas 200/300 (model 3000), Atlas 500
    "Ascend310P": ("Ascend310P1", "Ascend310P3"),  # Atlas 300I Pro, 300V Pro, 300I Duo
    "Ascend310B": ("Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4"),  # Atlas 200I/500 A2
    "Ascend910": ("Ascend910A", "Ascend910B", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA"),
    "Ascend910B": ("Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1"),
    "Ascend910_93": ("Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372",
                     "Ascend910_9362"),
}

SOC_VERSIONS: dict[str, str] = {soc: family for family, socs in SOC_FAMILIES.items() for soc in socs}


def soc_family(soc_version: str) -> str:
    """``Ascend310P3`` -> ``Ascend310P``; KeyError for a name not in SOC_VERSIONS."""
    return SOC_VERSIONS[soc_version]


def unsupported_nodes(model: "onnx.ModelProto", extra_ops: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(op type, node name) of every node ATC's documented list lacks, subgraphs (If branches) included.

    Nodes in a domain other than ONNX's own (``""``/``ai.onnx``) are always reported: ATC converts the
    standard operator set, not a runtime's contrib operators.
    """
    allowed = SUPPORTED_ONNX_OPS | set(extra_ops)
    found = []
    for node in _nodes(model.graph):
        standard = node.domain in ("", "ai.onnx")
        if not standard or node.op_type not in allowed:
            op = node.op_type if standard else f"{node.domain}::{node.op_type}"
            found.append((op, node.name or "<unnamed>"))
    return found


def _nodes(graph) -> Iterable:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g.node:
                yield from _nodes(attr.g)
            for sub in attr.graphs:
                yield from _nodes(sub)


#: How ATC and AMCT mark an error line: an E-code (E19999, EZ3002), ``[ERROR]``, ``ERROR`` or ``Error:``.
ERROR_CODE = re.compile(r"\bE[A-Z0-9]\d{4}\b|\[ERROR\]|\bERROR\b|Error:")


def first_errors(log: str, limit: int = 5) -> list[str]:
    """ATC's (or AMCT's) first error lines (E-codes such as E19999, EZ3002, or [ERROR]), quoted as they are."""
    return [line.strip() for line in log.splitlines() if ERROR_CODE.search(line)][:limit]


def onnx_inputs(model: "onnx.ModelProto") -> dict[str, dict[str, Any]]:
    """Every graph input's static shape and dtype (numpy's name), for status.json, the README and AMCT's command."""
    import onnx

    return {v.name: {"shape": [d.dim_value for d in v.type.tensor_type.shape.dim],
                     "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name}
            for v in model.graph.input}
