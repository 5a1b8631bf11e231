"""OpenVINO IR: ``.xml`` (the graph) with its ``.bin`` (the weights), run by OpenVINO, whose CPU plugin a recorded
precision hint steers and whose instruction set can be capped (AVX2 emulation); the deployment record in the IR's
``rt_info``."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ..deployment import KEYS, file_props
from .base import Format, InputSpec

#: IR element types -> numpy dtype names.
IR_DTYPES = {"f32": "float32", "f16": "float16", "i32": "int32", "i64": "int64", "u8": "uint8", "i8": "int8",
             "boolean": "bool"}


class IrFormat(Format):
    name = "openvino"
    title = "OpenVINO IR"
    suffixes = (".xml",)
    runtimes = ("openvino",)
    int8_forms = ("cpu",)
    serves_on_cpu = True
    native_runtime = "openvino"
    emulates_cpus = True

    def companions(self, path: Path) -> list[Path]:
        return [path.with_suffix(".bin")]

    def read_record(self, path: Path) -> dict[str, Any]:
        return read_ir(path)

    def stamp_record(self, model: Any, record: dict[str, Any], precision: str | None) -> None:
        stamp_ir(model, record, precision)

    def recorded_hint(self, runtime: str, record: dict[str, Any] | None) -> str | None:
        """An IR's record names the INFERENCE_PRECISION_HINT to compile it with (``deployment.openvino_int8_runtime``)."""
        from ..deployment import openvino_hint

        return openvino_hint(record) if runtime == self.native_runtime else None

    def inspect(self, path: Path) -> dict | None:
        """``pruneflow inspect`` of an IR: its ops counted, constants' elements, inputs and outputs, and the deployment
        record pruneflow wrote into it (as for an ONNX file, ``formats/onnx.py``)."""
        from collections import Counter

        from ..deps import require
        from ..errors import InputError

        ov = require("openvino", "pip install openvino", "inspecting OpenVINO IR")
        if not path.is_file() or not path.with_suffix(".bin").is_file():
            from ..inspect import SOURCES_HINT

            raise InputError(f"{path if not path.is_file() else path.with_suffix('.bin')} does not exist (an IR is the "
                             ".xml and the .bin beside it)", hint=SOURCES_HINT)
        try:
            model = ov.Core().read_model(str(path))
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError subclasses of its own
            raise InputError(f"{path} is not a readable OpenVINO IR: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                             hint="convert the model again, or point at the .xml a run wrote (OUT/NAME/export/openvino/)") from exc
        nodes = model.get_ordered_ops()
        ops = Counter(op.get_type_name() for op in nodes)
        constants = sum(math.prod(list(op.get_output_shape(0))) for op in nodes
                        if op.get_type_name() == "Constant")  # weights, and the few shape and axis constants
        deployment = read_ir(path)
        totals = {"params": constants, "nodes": len(nodes),
                  "inputs": ", ".join(f"{p.get_any_name()}{p.get_partial_shape()}" for p in model.inputs),
                  "outputs": ", ".join(p.get_any_name() for p in model.outputs)}
        if deployment:
            totals.update(precision=deployment.get("precision"), layout=(deployment.get("input") or {}).get("layout"),
                          preprocessing=(deployment.get("preprocessing") or {}).get("steps"))
        rows = [{"op": op, "count": n} for op, n in ops.most_common()]
        return {"source": str(path), "kind": "openvino", "layers": rows, "totals": totals, "deployment": deployment}

    def input_spec(self, path: Path) -> InputSpec | None:
        root = ET.parse(path).getroot()
        layer = next((la for la in root.iter("layer") if la.get("type") == "Parameter"), None)
        if layer is None:
            return None
        data = layer.find("data")
        attrs = data.attrib if data is not None else {}
        dims = [d.strip() for d in attrs.get("shape", "").split(",") if d.strip()]
        shape = tuple(int(d) if d.isdigit() else None for d in dims)
        return InputSpec(layer.get("name", "input"), shape, IR_DTYPES.get(attrs.get("element_type", "f32"), "float32"))


def stamp_ir(model: Any, record: dict[str, Any], precision: str | None) -> None:
    """Write the record into an OpenVINO model's rt_info (``<rt_info><pruneflow>`` in the .xml)."""
    for key, value in file_props(record, precision).items():
        model.set_rt_info(value, ["pruneflow", key.removeprefix("pruneflow.")])


def read_ir(path: str | Path) -> dict[str, Any]:
    """The record written into an OpenVINO IR's rt_info ({} for an IR pruneflow did not write)."""
    import openvino as ov

    model = ov.Core().read_model(str(path))
    out = {}
    for key in KEYS:
        if model.has_rt_info(["pruneflow", key]):
            out[key] = json.loads(model.get_rt_info(["pruneflow", key]).astype(str))
    return out
