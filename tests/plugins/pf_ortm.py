"""A third party's artifact format in one file: an ONNX graph kept under its own suffix (``.ortm``), run by the
built-in onnxruntime runtime. Registered through a ``pruneflow.formats`` entry point (tests/test_format_plugin.py
installs it as a distribution would); ``bench``, ``open_artifact`` and serving then load it with nothing else changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pruneflow.formats import Format, InputSpec, format_named


class OrtModel(Format):
    name = "ortm"
    title = "ONNX graph (.ortm)"
    suffixes = (".ortm",)
    runtimes = ("onnxruntime",)

    def read_record(self, path: Path) -> dict[str, Any]:
        return format_named("onnx").read_record(path)  # the same protobuf, the same metadata_props

    def input_spec(self, path: Path) -> InputSpec | None:
        return format_named("onnx").input_spec(path)
