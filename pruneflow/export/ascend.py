"""Ascend target (skeleton: the ascend helper replaces this file)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from ..artifacts import Artifact
from ..errors import ExportError
from ..stage import Target, TargetConfig


class AscendConfig(TargetConfig):
    type: Literal["ascend"] = Field(default="ascend", description="Ascend OM model (built where CANN atc is on PATH, prepared otherwise).")


class AscendTarget(Target[AscendConfig]):
    Config = AscendConfig
    precisions = ("fp32", "fp16", "int8")
    depends_on = ["onnx"]

    def build(self, state, ctx, out_dir: Path, precision: str) -> Artifact:
        raise ExportError("the ascend target is not written yet")
