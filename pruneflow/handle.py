"""ModelHandle: the module plus what later stages must know about it.

Stages pass a handle, never a bare ``nn.Module`` with private attributes. What travels on it:

- ``kind``: a registered :class:`ModelKind` (``float``, or a plugin's, e.g. ``nncf`` from ``qat/``)
  that knows how to checkpoint the module, restore it, and give the float and the INT8-exportable
  views of it. The core asks the kind and never imports a quantization backend.
- ``float_base``: for quantized kinds, the floating-point model that entered quantization (what fp32/fp16
  artifacts are made from).
- ``meta``: plain, kind-specific values (saved in checkpoints).

A stage that replaces the model returns the new handle in ``StageResult.handle``::

    quantized = quantize(state.handle.module, calib)
    return StageResult(metrics=..., handle=ModelHandle(quantized, kind="nncf", float_base=base))

Checkpoints always record the module's structure (per module: class and plain attributes), so a
stage that reshapes a model (pruning, or a third-party stage) needs no flag for it to reload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from .errors import ExportError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ModelHandle:
    module: "nn.Module"
    kind: str = "float"
    float_base: "nn.Module | None" = None
    meta: dict[str, Any] = field(default_factory=dict)
    #: Wraps each module the exports take (``float_module``/``int8_module``) so that it returns what the task reads
    #: of the model's output (``tasks.ReadOutput``): set by the export stage for a model returning a tuple, a dict
    #: or an HF-style output, so every artifact has the task's one output. Never checkpointed.
    reader: "Callable[[nn.Module], nn.Module] | None" = field(default=None, compare=False)

    def evolve(self, **changes: Any) -> "ModelHandle":
        """A copy with ``changes`` applied (the handle itself is immutable)."""
        return dataclasses.replace(self, **changes)

    @property
    def behaviour(self) -> "ModelKind":
        """The registered kind's implementation."""
        from . import registry

        return registry.model_kinds.get(self.kind)()

    @property
    def quantized(self) -> bool:
        return self.behaviour.quantized

    def float_module(self) -> "nn.Module":
        """The floating-point model fp32/fp16 artifacts and MAC counts are made from (for a quantized kind, the
        model that entered quantization)."""
        module = self.behaviour.float_module(self)
        return self.reader(module) if self.reader else module

    @property
    def precision(self) -> str:
        """The precision a checkpoint of this handle is labelled with (fp32 | fp16 | int8)."""
        return self.behaviour.precision

    @property
    def form(self) -> str | None:
        """How a quantized kind encodes its precision (e.g. ``fakequant``), None for a plain float model."""
        return self.behaviour.form

    def int8_module(self, example: "torch.Tensor") -> "nn.Module":
        """A plain torch module whose ONNX export holds QuantizeLinear/DequantizeLinear pairs."""
        module = self.behaviour.int8_module(self, example)
        return self.reader(module) if self.reader else module

    def to(self, device: str) -> "ModelHandle":
        """Move the module and its float base (in place, like ``nn.Module.to``), so both views run on ``device``."""
        self.module.to(device)
        if self.float_base is not None:
            self.float_base.to(device)
        return self


class ModelKind:
    """How one kind of model is checkpointed, restored and exported. Registered by entry point
    (group ``pruneflow.model_kinds``) like stages and targets."""

    name: ClassVar[str] = "float"
    #: True when the module carries INT8 quantizers (what an int8 export needs).
    quantized: ClassVar[bool] = False
    #: The label of this kind's checkpoints, in the one vocabulary (fp32 | fp16 | int8), and the form that
    #: says how (a quantized torch model: ``fakequant``, float weights with quantizer ranges).
    precision: ClassVar[str] = "fp32"
    form: ClassVar[str | None] = None
    #: Classes (``"package.module.Class"``) that this kind's checkpoint payload holds besides plain values
    #: and tensors, e.g. a backend's enums. Weights-only loading allows exactly these by name, importing
    #: them only when a file needs them, so the core never imports the backend to read a checkpoint.
    safe_globals: ClassVar[tuple[str, ...]] = ()

    def checkpoint_payload(self, handle: ModelHandle) -> dict[str, Any]:
        """Extra checkpoint entries: plain values and tensors only (loaded with weights_only=True)."""
        return {}

    def restore(self, base: "nn.Module", payload: dict[str, Any]) -> ModelHandle:
        """The handle a checkpoint describes. ``base`` is the float model with structure and weights restored."""
        return ModelHandle(base, kind=self.name)

    def float_module(self, handle: ModelHandle) -> "nn.Module":
        """The float view: a float model is its own (a quantized kind copies its trained weights into its base)."""
        return handle.module

    def int8_module(self, handle: ModelHandle, example: "torch.Tensor") -> "nn.Module":
        """Only a quantized kind has an INT8 form; asked of a float model this is the user's recipe error."""
        raise ExportError("int8 export needs a quantized model, and the model reaching the export stage is floating point",
                          hint="add a `ptq` stage, or a `qat` stage ending in an int8 phase, before `export`")


class FloatKind(ModelKind):
    """A plain floating-point torch module (what factories build, training and pruning keep)."""
