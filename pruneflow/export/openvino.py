"""OpenVINO IR target, converted from the onnx target's files when the recipe builds them: FP32 and FP16
(compressed weights) from the fp32 ONNX, INT8 from the CPU-form INT8 ONNX (pruneflow/export/qdq.py), so
every artifact of a run has the same graph, input and output names (`input`, `logits`) and quantization
parameters. Without those files the same ONNX is exported here first."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Literal

from pydantic import Field

from ..artifacts import Artifact
from ..deployment import deployment_record, openvino_int8_runtime, stamp_ir
from ..deps import require
from ..errors import ExportError
from ..inputs import to
from ..stage import Target, TargetConfig


def canonical_names(model) -> None:
    """Rename the ops named from OpenVINO's process-wide counter (``Reshape_9768``, and the Const that constant
    folding made of it, which keeps that name) by their place in the graph, so an IR's bytes do not depend on what
    the process converted before (a resumed run, a test session; issue 27, item 7). Inputs and outputs keep theirs,
    as do names of another form (the ONNX graph's ``/features/Conv``)."""
    import re

    ops = model.get_ordered_ops()
    counted = re.compile(r"([A-Za-z][A-Za-z0-9]*)_(\d+)")
    kept = {op.get_friendly_name() for op in ops if not counted.fullmatch(op.get_friendly_name())}
    for i, op in enumerate(ops):
        found = counted.fullmatch(op.get_friendly_name())
        if found is None or op.get_type_name() in ("Parameter", "Result"):
            continue
        name = f"{found.group(1)}_{i}"
        while name in kept:
            name += "_"
        kept.add(name)
        op.set_friendly_name(name)


class OpenVinoConfig(TargetConfig):
    type: Literal["openvino"] = Field(default="openvino", description="OpenVINO IR (model.xml + model.bin) run by the OpenVINO CPU plugin.")
    dynamic_batch: bool = Field(default=True, description="Leave the batch dimension dynamic.")


class OpenVinoTarget(Target[OpenVinoConfig]):
    Config = OpenVinoConfig
    precisions = ("fp32", "fp16", "int8")
    #: Every IR is converted from the onnx target's ONNX of its precision when the recipe builds it (fp32 for
    #: the fp32 and fp16 IR, the CPU-form INT8 for int8: one graph, one set of names and quantization
    #: parameters, one lineage); without it, that ONNX is exported here.
    depends_on = ["onnx"]

    def preflight(self) -> list[str]:
        require("openvino", "pip install openvino", "the openvino target")
        return []

    def build(self, state, ctx, out_dir: Path, precision: str) -> Artifact:
        ov = require("openvino", "pip install openvino", "the openvino target")
        xml = out_dir / f"model.{precision}.xml"
        record = deployment_record(state, ctx, dynamic_batch=self.config.dynamic_batch)
        if precision == "int8":
            record["runtime"] = openvino_int8_runtime()
        source = self._onnx_artifact("onnx.int8" if precision == "int8" else "onnx.fp32", ctx.run_dir)
        # Written beside the target, then renamed: .bin first, so a visible .xml always has its weights.
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            onnx_file = ctx.run_dir / source.path if source else self._export_onnx(state, Path(tmp), precision)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    converted = ov.convert_model(str(onnx_file))
            except Exception as exc:  # noqa: BLE001
                raise ExportError(f"OpenVINO could not convert {onnx_file.name if source else 'the model'} (converted from "
                                  f"ONNX, never traced from torch): {type(exc).__name__}: {str(exc).splitlines()[0]}",
                                  hint="the onnx target's artifact of this precision is the graph OpenVINO reads: check that "
                                  "it builds and runs in onnxruntime; an operator OpenVINO lacks needs a newer openvino") from exc
            stamp_ir(converted, record, precision)
            canonical_names(converted)
            ov.save_model(converted, str(Path(tmp) / "model.xml"), compress_to_fp16=precision == "fp16")
            os.replace(Path(tmp) / "model.bin", xml.with_suffix(".bin"))
            os.replace(Path(tmp) / "model.xml", xml)
        artifact = Artifact.from_file(ctx.run_dir, xml, kind="openvino", producer="export", target="openvino",
                                      precision=precision, deployment=record)
        artifact.add_file(ctx.run_dir, xml.with_suffix(".bin"))
        if source is not None:
            artifact.parent = source.path
            artifact.notes.append(f"converted from {source.path}")
        return artifact

    def _onnx_artifact(self, label: str, run_dir: Path | None = None) -> Artifact | None:
        """The ONNX the onnx target built in this stage under ``label`` (``onnx.fp32``: the fp32 and fp16 IR
        come from it, fp16 by compressing its weights; ``onnx.int8``: the CPU-form INT8), if any and (given
        ``run_dir`` to read it) with the batch dimension this target asks for."""
        found = [a for a in self.upstream if a.label == label and a.status == "built"]
        if not found or (run_dir is not None and _dynamic_batch(run_dir / found[0].path) != self.config.dynamic_batch):
            return None
        return found[0]

    def _export_onnx(self, state, tmp: Path, precision: str) -> Path:
        """The ONNX to convert, exported into ``tmp`` when the onnx target did not build it in this stage: the
        same exporter, names and constant folding as the onnx target's, so every artifact reads alike."""
        from .onnx import export_int8_onnx, export_onnx

        path = tmp / f"{precision}.onnx"
        example = to(state.example_input, "cpu")
        if precision == "int8":
            export_int8_onnx(state.handle.int8_module(example), example, path, form="cpu", dynamic_batch=self.config.dynamic_batch,
                             output_name=state.task.output_name)
        else:
            export_onnx(state.handle.float_module(), example, path, dynamic_batch=self.config.dynamic_batch,
                        output_name=state.task.output_name)
        return path


def _dynamic_batch(onnx_path: Path) -> bool:
    """True when the ONNX model's first input has a symbolic (dynamic) batch dimension."""
    onnx = require("onnx", "pip install onnx", "reading an ONNX model")
    first = onnx.load(str(onnx_path), load_external_data=False).graph.input[0]
    return not first.type.tensor_type.shape.dim[0].HasField("dim_value")
