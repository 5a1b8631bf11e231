"""ONNX: one ``.onnx`` file (and its external data, ``<file>.data``), run by onnxruntime or OpenVINO; the
deployment record in its ``metadata_props``; INT8 in two forms, ``cpu`` (what onnxruntime and OpenVINO run fastest)
and ``tensorrt`` (TensorRT's Q/DQ convention, only checked on a CPU: ``export/qdq/``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from ..deployment import KEYS, file_props
from ..errors import InputError
from .base import Format, InputSpec

#: ONNX TensorProto element types -> numpy dtype names.
ONNX_DTYPES = {1: "float32", 10: "float16", 6: "int32", 7: "int64", 2: "uint8", 3: "int8", 9: "bool"}


class OnnxFormat(Format):
    name = "onnx"
    title = "ONNX"
    suffixes = (".onnx",)
    runtimes = ("onnxruntime", "openvino")
    int8_forms = ("cpu", "tensorrt")
    foreign_int8_form = "tensorrt"
    foreign_int8_title = "TensorRT form"
    serves_on_cpu = True
    interchange = True
    no_emulation_note = ("not checked under AVX2 emulation: onnxruntime's MLAS picks its kernels from CPUID and has no "
                         "instruction-set cap; its INT8 form is exact on AVX2 by construction (u8s8)")

    def companions(self, path: Path) -> list[Path]:
        return [Path(f"{path}.data")]

    def read_record(self, path: Path) -> dict[str, Any]:
        return read_onnx(path)

    def stamp_record(self, model: Any, record: dict[str, Any], precision: str | None) -> None:
        stamp_onnx(model, record, precision)

    def refused(self, record: dict[str, Any] | None) -> dict[str, str]:
        """A file in onnxruntime's fused contrib ops (``deployment.onnxruntime_fused_runtime``) runs there only."""
        from ..deployment import onnxruntime_only

        if not onnxruntime_only(record):
            return {}
        return {r: "onnxruntime's fused contrib ops (com.microsoft): OpenVINO does not read this file"
                for r in self.runtimes if r != "onnxruntime"}

    def inspect(self, path: Path) -> dict | None:
        """``pruneflow inspect`` of an ONNX file: its ops counted, parameters, inputs and outputs, and the deployment
        record pruneflow wrote into it."""
        import numpy as np

        from ..deps import require

        onnx = require("onnx", "pip install onnx", "inspecting ONNX models")
        if not path.is_file():
            from ..inspect import SOURCES_HINT

            raise InputError(f"{path} does not exist", hint=SOURCES_HINT)
        try:
            model = onnx.load(str(path))
        except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError on a corrupt file
            raise InputError(f"{path} is not a readable ONNX model: {type(exc).__name__}: {exc}",
                             hint="export the model again, or point at the .onnx file a run wrote (OUT/NAME/export/onnx/)") from exc
        if not model.opset_import or not model.HasField("graph"):  # an empty file parses as an empty model
            raise InputError(f"{path} holds no ONNX graph ({path.stat().st_size:,} bytes: an empty or truncated file)",
                             hint="export the model again, or point at the .onnx file a run wrote (OUT/NAME/export/onnx/)")
        ops = Counter(n.op_type for n in model.graph.node)
        params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
        rows = [{"op": op, "count": n} for op, n in ops.most_common()]
        inputs = [f"{i.name}{[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]}" for i in model.graph.input]
        deployment = read_onnx(model)  # what pruneflow wrote into metadata_props ({} for another tool's file)
        totals = {"params": params, "nodes": len(model.graph.node), "opset": model.opset_import[0].version,
                  "inputs": ", ".join(inputs), "outputs": ", ".join(o.name for o in model.graph.output)}
        if deployment:
            totals.update(precision=deployment.get("precision"), layout=(deployment.get("input") or {}).get("layout"),
                          preprocessing=(deployment.get("preprocessing") or {}).get("steps"))
        return {"source": str(path), "kind": "onnx", "layers": rows, "totals": totals, "deployment": deployment}

    def input_spec(self, path: Path) -> InputSpec | None:
        import onnx

        graph = onnx.load(str(path), load_external_data=False).graph
        weights = {init.name for init in graph.initializer}
        first = next((i for i in graph.input if i.name not in weights), None)
        if first is None:
            return None
        tensor = first.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
        return InputSpec(first.name, shape, ONNX_DTYPES.get(tensor.elem_type, "float32"))


def stamp_onnx(model: Any, record: dict[str, Any], precision: str | None) -> None:
    """Write the record into an ONNX ModelProto's metadata_props (other entries are kept)."""
    import onnx

    props = {p.key: p.value for p in model.metadata_props}
    props.update(file_props(record, precision))
    onnx.helper.set_model_props(model, props)


def read_onnx(source: Any) -> dict[str, Any]:
    """The record written into an ONNX file or loaded ModelProto ({} for a model pruneflow did not write)."""
    import onnx

    model = source if hasattr(source, "metadata_props") else onnx.load(str(source), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    return {key: json.loads(props[f"pruneflow.{key}"]) for key in KEYS if f"pruneflow.{key}" in props}
