"""TensorRT target (skeleton: the tensorrt helper replaces this file)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from ..artifacts import Artifact
from ..errors import ExportError
from ..stage import Target, TargetConfig


class TensorRtConfig(TargetConfig):
    type: Literal["tensorrt"] = Field(default="tensorrt", description="TensorRT engine (built where TensorRT and a CUDA GPU exist, prepared otherwise).")


class TensorRtTarget(Target[TensorRtConfig]):
    Config = TensorRtConfig
    precisions = ("fp32", "fp16", "int8")
    depends_on = ["onnx"]

    def build(self, state, ctx, out_dir: Path, precision: str) -> Artifact:
        raise ExportError("the tensorrt target is not written yet")
