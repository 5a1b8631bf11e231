"""OpenVINO IR target: FP32 or FP16-compressed weights converted from the torch model; INT8 converted from
the CPU-form INT8 ONNX (pruneflow/export/qdq.py), so it holds the same quantization parameters."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from ..artifacts import Artifact
from ..deps import require
from ..errors import ExportError
from ..stage import Target, TargetConfig

if TYPE_CHECKING:
    from ..runtime import Executor


class OpenVinoConfig(TargetConfig):
    type: Literal["openvino"] = Field(default="openvino", description="OpenVINO IR (model.xml + model.bin) run by the OpenVINO CPU plugin.")
    dynamic_batch: bool = Field(default=True, description="Leave the batch dimension dynamic.")


class OpenVinoTarget(Target[OpenVinoConfig]):
    Config = OpenVinoConfig
    precisions = ("fp32", "fp16", "int8")
    #: INT8 IR is converted from the onnx target's CPU-form INT8 ONNX when the recipe builds it (the same
    #: file, so one set of quantization parameters and one lineage); without it, that ONNX is exported here.
    depends_on = ["onnx"]

    def preflight(self) -> list[str]:
        require("openvino", "pip install openvino", "the openvino target")
        return []

    def build(self, state, ctx, out_dir: Path, precision: str) -> Artifact:
        ov = require("openvino", "pip install openvino", "the openvino target")
        example = state.example_input.cpu()
        shape = [-1 if self.config.dynamic_batch else 1, *example.shape[1:]]
        xml = out_dir / f"model.{precision}.xml"
        source = self._onnx_int8_artifact(ctx.run_dir) if precision == "int8" else None
        # Written beside the target, then renamed: .bin first, so a visible .xml always has its weights.
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if precision == "int8":
                        onnx_file = ctx.run_dir / source.path if source else self._export_int8_onnx(state, Path(tmp))
                        converted = ov.convert_model(str(onnx_file))
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
        if source is not None:
            artifact.parent = source.path
            artifact.notes.append(f"converted from {source.path}")
        return artifact

    def _onnx_int8_artifact(self, run_dir: Path | None = None) -> Artifact | None:
        """The CPU-form INT8 ONNX the onnx target built in this stage, if any and (given ``run_dir`` to read
        it) with the batch dimension this target asks for."""
        found = [a for a in self.upstream if a.label == "onnx.int8" and a.status == "built"]
        if not found or (run_dir is not None and _dynamic_batch(run_dir / found[0].path) != self.config.dynamic_batch):
            return None
        return found[0]

    def _export_int8_onnx(self, state, tmp: Path) -> Path:
        """The CPU-form INT8 ONNX exported into ``tmp``, when the onnx target did not build it in this stage."""
        from .onnx import export_int8_onnx

        path = tmp / "int8.onnx"
        example = state.example_input.cpu()
        export_int8_onnx(state.handle.int8_module(example), example, path, form="cpu", dynamic_batch=self.config.dynamic_batch)
        return path


def _dynamic_batch(onnx_path: Path) -> bool:
    """True when the ONNX model's first input has a symbolic (dynamic) batch dimension."""
    onnx = require("onnx", "pip install onnx", "reading an ONNX model")
    first = onnx.load(str(onnx_path), load_external_data=False).graph.input[0]
    return not first.type.tensor_type.shape.dim[0].HasField("dim_value")


def openvino_runner(path: Path, threads: int | None = None, precision_hint: str | None = "f32") -> "Executor":
    """``path`` in OpenVINO on the CPU, by default with f32 forced (the artifact's own arithmetic; the export
    stage times the plugin's default too, see ``pruneflow.runtime.open_artifact``)."""
    from ..runtime import open_artifact

    return open_artifact(path, runtime="openvino", device="CPU", threads=threads, precision_hint=precision_hint)
