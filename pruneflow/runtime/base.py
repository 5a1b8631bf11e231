"""The runtime layer's two kernel types, imported by every loader (onnxruntime, OpenVINO, TensorRT)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import MissingDependencyError


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
    run: Callable[[np.ndarray], np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.run(x)

    @property
    def label(self) -> str:
        """``onnxruntime/CPU``, ``openvino/CPU (default: bf16)``, ``openvino/CPU (f32)``: the runtime column of tables."""
        hint = self.info.get("precision_hint")
        if self.runtime != "openvino" or not self.info.get("inference_precision"):
            return f"{self.runtime}/{self.device}"
        shown = hint if hint else f"default: {self.info['inference_precision']}"
        return f"{self.runtime}/{self.device} ({shown})"
