"""The runtime layer's two kernel types, imported by every loader (onnxruntime, OpenVINO, TensorRT)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import numpy as np

from ..errors import MissingDependencyError


#: What an executor takes: one array (a single-input model), or the artifact's input names mapped to arrays.
Feed = Union[np.ndarray, Mapping[str, np.ndarray]]


def feed_for(x: Any, names: list[str]) -> dict[str, np.ndarray]:
    """A runtime's feed for inputs ``names`` from one array or tensor (the first input), or a mapping of names
    to arrays or tensors (torch tensors are converted; names the artifact lacks are dropped: a text model
    without ``token_type_ids`` is fed the tokenizer's full output)."""
    if not isinstance(x, Mapping):
        x = {names[0]: x}
    elif len(names) == 1 and names[0] not in x:
        x = {names[0]: next(iter(x.values()))}
    out = {}
    for name in names:
        if name in x:
            v = x[name]
            v = v.detach().cpu().numpy() if hasattr(v, "detach") else v
            out[name] = np.ascontiguousarray(v)
    return out


class RuntimeUnavailable(MissingDependencyError):
    """The runtime or device asked for is absent on this machine (exit 3); never replaced by another."""

    title = "runtime unavailable"


@dataclass
class Executor:
    """An artifact loaded in one runtime on one device. ``info`` records what the runtime actually chose
    (execution providers, OpenVINO's inference precision, the runtime's version), so a report says what
    was measured."""

    path: Path
    runtime: str
    device: str
    run: Callable[[Any], np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)
    #: Every output as the artifact gives it (one a head of a multi-head task), in the order the deployment record
    #: names them; None where the loader has only ``run`` (then its one array is the only output).
    outputs: Callable[[Any], list[np.ndarray]] | None = None

    def __call__(self, x: Feed) -> np.ndarray:
        return self.run(x)

    def run_outputs(self, x: Feed) -> list[np.ndarray]:
        """Every output of one call, unjoined (``joined`` concatenates them for evaluation)."""
        return self.outputs(x) if self.outputs is not None else [self.run(x)]

    @property
    def label(self) -> str:
        """``onnxruntime/CPU``, ``openvino/CPU (default: bf16)``, ``openvino/CPU (f32)``: the runtime column of tables
        (what it computed in, where the runtime says: one that takes a precision hint)."""
        hint = self.info.get("precision_hint")
        if not self.info.get("inference_precision"):
            return f"{self.runtime}/{self.device}"
        shown = hint if hint else f"default: {self.info['inference_precision']}"
        return f"{self.runtime}/{self.device} ({shown})"


def joined(outputs: "list[Any]") -> Any:
    """An artifact's output as one array: its only output, or its outputs (a multi-head task's, one a head, in the
    order the deployment record names them) flattened per sample and concatenated, as ``Task.output`` reads them."""
    if len(outputs) == 1:
        return outputs[0]
    return np.concatenate([np.asarray(o).reshape(len(o), -1) for o in outputs], axis=1)
