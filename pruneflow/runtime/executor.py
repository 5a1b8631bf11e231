"""Executors: one loaded artifact on one runtime and device, called like a function on a numpy batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..deps import require
from ..errors import MissingDependencyError

#: Runtimes that can load each file type, the first being the default.
RUNTIMES = {".onnx": ("onnxruntime", "openvino"), ".xml": ("openvino",), ".engine": ("tensorrt",), ".plan": ("tensorrt",)}


class RuntimeUnavailable(MissingDependencyError):
    """The runtime or device asked for is absent on this machine (exit 3); never replaced by another."""

    title = "runtime unavailable"


@dataclass
class Executor:
    """An artifact loaded in one runtime on one device. ``info`` records what the runtime actually chose
    (execution providers, OpenVINO's inference precision), so a report says what was measured."""

    path: Path
    runtime: str
    device: str
    run: Callable[[np.ndarray], np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.run(x)

    @property
    def label(self) -> str:
        """``onnxruntime/CPU``, ``openvino/CPU (f32)``: the runtime column of tables."""
        hint = self.info.get("precision_hint")
        return f"{self.runtime}/{self.device}" + (f" ({hint})" if hint else "")


def runtimes_for(path: str | Path) -> tuple[str, ...]:
    """The runtimes that can load ``path`` (by its suffix), the default first; () when none can."""
    return RUNTIMES.get(Path(path).suffix, ())


def open_artifact(path: str | Path, *, runtime: str | None = None, device: str | None = None,
                  threads: int | None = None, precision_hint: str | None = None) -> Executor:
    """Load ``path`` in ``runtime`` (default: the first of ``runtimes_for``) on ``device`` (default: the
    best the runtime has here). ``precision_hint`` is OpenVINO's INFERENCE_PRECISION_HINT: None leaves the
    plugin's default (bf16 on CPUs with AVX-512 BF16 or AMX), ``"f32"`` forces fp32."""
    path = Path(path)
    choices = runtimes_for(path)
    runtime = runtime or (choices[0] if choices else None)
    if runtime not in choices:
        raise RuntimeUnavailable(f"{path.name}: no runtime {runtime!r} loads {path.suffix or 'this'} files",
                                 hint=f"use one of: {', '.join(choices) or '(none)'}")
    loader = {"onnxruntime": _onnxruntime, "openvino": _openvino, "tensorrt": _tensorrt}[runtime]
    return loader(path, device, threads, precision_hint)


def _onnxruntime(path: Path, device: str | None, threads: int | None, hint: str | None) -> Executor:
    ort = require("onnxruntime", "pip install onnxruntime", "running ONNX models")
    available = ort.get_available_providers()
    wanted = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
    if device is None:
        provider = "CUDAExecutionProvider" if "CUDAExecutionProvider" in available else "CPUExecutionProvider"
    elif device.lower() in wanted and wanted[device.lower()] in available:
        provider = wanted[device.lower()]
    else:
        raise RuntimeUnavailable(f"onnxruntime has no {device!r} device here (providers: {', '.join(available)})",
                                 hint="install onnxruntime-gpu on a machine with a CUDA GPU for `cuda`")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=[provider])
    name = session.get_inputs()[0].name
    return Executor(path, "onnxruntime", "CUDA" if provider.startswith("CUDA") else "CPU",
                    lambda x: session.run(None, {name: x})[0], {"providers": session.get_providers()})


def _openvino(path: Path, device: str | None, threads: int | None, hint: str | None) -> Executor:
    ov = require("openvino", "pip install openvino", "running OpenVINO models")
    core = ov.Core()
    device = device or "CPU"
    if device not in core.available_devices:
        raise RuntimeUnavailable(f"OpenVINO has no {device!r} device here (devices: {', '.join(core.available_devices)})",
                                 hint="choose one of the listed devices")
    config: dict[str, str | int] = {}
    if hint:
        config["INFERENCE_PRECISION_HINT"] = hint
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = core.compile_model(str(path), device, config)
    output = compiled.output(0)
    used = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    return Executor(path, "openvino", device, lambda x: compiled(x)[output],
                    {"precision_hint": hint or f"default={used}", "inference_precision": used})


def _tensorrt(path: Path, device: str | None, threads: int | None, hint: str | None) -> Executor:
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise RuntimeUnavailable(f"{path.name} is a TensorRT engine and TensorRT is not installed here",
                                 hint="run it on the machine it was built for (same TensorRT version and GPU)") from exc
    raise RuntimeUnavailable(f"{path.name}: running TensorRT engines is not supported yet")
