"""Export targets, one module each; heavy imports happen inside the functions that need them."""

from __future__ import annotations

from ..deps import require as require  # re-exported until every caller imports it from pruneflow.deps
from ..errors import ExportError


def float_model(model):
    """The floating-point model to export at fp32/fp16 precision.

    A model quantized by the ptq/qat stages carries its float twin (``_pruneflow_float_base``, set
    there); its trained weights are copied in, so fp32/fp16 artifacts hold what QAT learned, without
    the fake-quantize operations.
    """
    import copy

    base = getattr(model, "_pruneflow_float_base", None)
    if base is None:
        return model
    view = copy.deepcopy(base)
    own = view.state_dict()
    view.load_state_dict({k: v for k, v in model.state_dict().items() if k in own})
    return view.eval()


def quantized_model(model):
    """The INT8 (fake-quantized) model an int8 artifact is written from; an error if there is none."""
    if getattr(model, "_pruneflow_float_base", None) is None:
        raise ExportError("int8 export needs a quantized model, and the model reaching the export stage is floating point",
                          hint="add a `ptq` stage, or a `qat` stage ending in an int8 phase, before `export`")
    return model
