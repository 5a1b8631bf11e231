"""OpenVINO IR target: FP32 or FP16-compressed weights converted from the torch model; INT8 converted from
the CPU-form INT8 ONNX (pruneflow/export/qdq.py), so it holds the same quantization parameters."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import Literal

from pydantic import Field

from ..artifacts import Artifact
from ..deps import require
from ..errors import ExportError
from ..stage import Target, TargetConfig


class OpenVinoConfig(TargetConfig):
    type: Literal["openvino"] = Field(default="openvino", description="OpenVINO IR (model.xml + model.bin) run by the OpenVINO CPU plugin.")
    dynamic_batch: bool = Field(default=True, description="Leave the batch dimension dynamic.")


class OpenVinoTarget(Target[OpenVinoConfig]):
    Config = OpenVinoConfig
    precisions = ("fp32", "fp16", "int8")

    def preflight(self) -> list[str]:
        require("openvino", "pip install openvino", "the openvino target")
        return []

    def build(self, state, ctx, out_dir: Path, precision: str) -> Artifact:
        ov = require("openvino", "pip install openvino", "the openvino target")
        example = state.example_input.cpu()
        shape = [-1 if self.config.dynamic_batch else 1, *example.shape[1:]]
        xml = out_dir / f"model.{precision}.xml"
        # Written beside the target, then renamed: .bin first, so a visible .xml always has its weights.
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if precision == "int8":
                        from .onnx import export_int8_onnx

                        source = Path(tmp) / "int8.onnx"
                        export_int8_onnx(state.handle.int8_module(example), example, source, form="cpu",
                                         dynamic_batch=self.config.dynamic_batch)
                        converted = ov.convert_model(str(source))
                    else:
                        model = copy.deepcopy(state.handle.float_module()).cpu().eval()  # never move the live model
                        converted = ov.convert_model(model, example_input=example.repeat((2,) + (1,) * (example.dim() - 1)),
                                                     input=[shape])
            except ExportError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise ExportError(f"OpenVINO could not convert the model: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                                  hint="export ONNX first and check that it runs; OpenVINO converts from the same graph") from exc
            ov.save_model(converted, str(Path(tmp) / "model.xml"), compress_to_fp16=precision == "fp16")
            os.replace(Path(tmp) / "model.bin", xml.with_suffix(".bin"))
            os.replace(Path(tmp) / "model.xml", xml)
        artifact = Artifact.from_file(ctx.run_dir, xml, kind="openvino", producer="export", target="openvino", precision=precision)
        artifact.add_file(ctx.run_dir, xml.with_suffix(".bin"))
        return artifact

    def runner(self, path: Path, threads: int | None = None):
        return openvino_runner(path, threads)


def openvino_runner(path: Path, threads: int | None = None):
    ov = require("openvino", "pip install openvino", "running OpenVINO models")
    config: dict[str, str | int] = {"INFERENCE_PRECISION_HINT": "f32"}  # measure the artifact, not a bf16 fallback of the CPU plugin
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    output = compiled.output(0)
    return lambda x: compiled(x)[output]
