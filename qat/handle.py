"""The NNCF-quantized model kind: how a model the ptq/qat stages quantized is checkpointed, restored and exported.

Registered through the ``pruneflow.model_kinds`` entry point (``nncf``), so the core reaches NNCF only
through this class; nncf itself is imported inside the methods, when a quantized model is in hand.

    handle = ModelHandle(quantized, kind="nncf", float_base=base)
    handle.float_module()        # the float model that entered quantization, for fp32/fp16 artifacts
    handle.int8_module(example)  # nncf.strip'ped: torch's own fake-quant ops, which torch.onnx writes as Q/DQ
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, ClassVar

from pruneflow.errors import StageError
from pruneflow.handle import ModelHandle, ModelKind

if TYPE_CHECKING:
    import torch
    from torch import nn


class NncfKind(ModelKind):
    """A module NNCF inserted quantizers into, with the float model that entered quantization as its base."""

    name: ClassVar[str] = "nncf"
    quantized: ClassVar[bool] = True
    precision: ClassVar[str] = "int8"
    form: ClassVar[str | None] = "fakequant"
    # NNCF's config (nncf.torch.get_config) holds plain values and this enum, which weights-only loading
    # then rebuilds from its value.
    safe_globals: ClassVar[tuple[str, ...]] = ("nncf.common.quantization.structs.QuantizationScheme",)

    def checkpoint_payload(self, handle: ModelHandle) -> dict[str, Any]:
        """NNCF's own config and the quantized weights: NNCF's hooks do not pickle, and its config plus the
        float base (which the checkpoint records as structure + weights) rebuild them."""
        import nncf.torch

        from .nncf_quant import SequentialRoot

        return {"nncf_config": nncf.torch.get_config(handle.module), "state_dict": handle.module.state_dict(),
                "sequential_root": isinstance(handle.module, SequentialRoot)}

    def restore(self, base: "nn.Module", payload: dict[str, Any]) -> ModelHandle:
        """Re-insert the quantizers into a copy of ``base`` from the saved config, then load the trained weights."""
        from .nncf_setup import ensure_built

        from .nncf_quant import SequentialRoot, attention_fastpath_off

        ensure_built()
        attention_fastpath_off(base)
        import nncf.torch

        # A Sequential top module was quantized under a plain root (qat/nncf_quant.py, SequentialRoot).
        model = SequentialRoot(copy.deepcopy(base)) if payload.get("sequential_root") else copy.deepcopy(base)
        module = nncf.torch.load_from_config(model, payload["nncf_config"])
        module.load_state_dict(payload["state_dict"])
        return ModelHandle(module.eval(), kind=self.name, float_base=base)

    def float_module(self, handle: ModelHandle) -> "nn.Module":
        """The float model that entered quantization, unchanged: what fp32/fp16 artifacts are and what their
        parity is checked against.

        Not the quantized module's float weights: NNCF's post-training quantization corrects biases for
        the INT8 grid (17 of 20 biases of ResNet-20, 81.03 % -> 80.55 % in float), and QAT trains the weights
        under fake quantization (BatchNorm statistics included), so either would silently give the fp32
        artifact a model that was never validated in float. For QAT with an ``fp32``/``fp16`` phase before
        ``int8``, the model entering quantization is the one those phases trained.
        """
        return _float_base(handle)

    def int8_module(self, handle: ModelHandle, example: "torch.Tensor") -> "nn.Module":
        """A CPU copy with NNCF's quantizers stripped to torch's native fake-quant ops (the live model is untouched)."""
        from .nncf_quant import strip_quantizers

        return strip_quantizers(handle.module, example)


def _float_base(handle: ModelHandle) -> "nn.Module":
    if handle.float_base is None:
        raise StageError("an NNCF-quantized model handle has no float base",
                         hint="build it as ModelHandle(quantized, kind='nncf', float_base=the model that entered quantization)")
    return handle.float_base
