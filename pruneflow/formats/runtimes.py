"""The built-in runtimes: onnxruntime (execution providers by device), OpenVINO (devices, precision hints) and
TensorRT engines, each opening a file as an :class:`~pruneflow.runtime.Executor` (``pruneflow.runtime.open_artifact``
asks the file's format which of them load it)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

from ..deps import require
from ..runtime.base import Executor, RuntimeUnavailable, feed_for, joined
from .base import Runtime

#: onnxruntime's execution providers by device name, the best first when no device is asked for.
ORT_PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


class OnnxRuntime(Runtime):
    name = "onnxruntime"
    devices: ClassVar[dict[str, str]] = {"cpu": "cpu", "cuda": "cuda"}

    def open(self, path: Path, device: str | None, threads: int | None, precision_hint: str | None,
             exact_int8: bool = False) -> Executor:
        """``exact_int8`` keeps onnxruntime from fusing Q/DQ into its integer kernels (``open_artifact``)."""
        return _onnxruntime(path, device, threads, precision_hint, exact_int8)


class OpenVinoRuntime(Runtime):
    name = "openvino"
    devices: ClassVar[dict[str, str]] = {"cpu": "CPU", "gpu": "GPU", "npu": "NPU"}
    takes_precision_hint = True
    vendor_benchmark = True

    def open(self, path: Path, device: str | None, threads: int | None, precision_hint: str | None,
             exact_int8: bool = False) -> Executor:
        return _openvino(path, device, threads, precision_hint)

    def hint_for(self, record: dict[str, Any] | None) -> str | None:
        from ..deployment import openvino_hint

        return openvino_hint(record)


class TensorRtRuntime(Runtime):
    name = "tensorrt"
    devices: ClassVar[dict[str, str]] = {"cuda": "cuda"}

    def open(self, path: Path, device: str | None, threads: int | None, precision_hint: str | None,
             exact_int8: bool = False) -> Executor:
        from ..runtime.tensorrt import load_engine

        return load_engine(path, device)


def _ort_provider(available: list[str], device: str | None) -> str:
    if device is None:
        return next(p for p in (*ORT_PROVIDERS.values(),) if p in available)
    provider = ORT_PROVIDERS.get(device.lower())
    if provider is None or provider not in available:
        raise RuntimeUnavailable(f"onnxruntime has no {device!r} device here (providers: {', '.join(available)})",
                                 hint="devices: cpu, or cuda with onnxruntime-gpu on a machine with a CUDA GPU")
    return provider


def _onnxruntime(path: Path, device: str | None, threads: int | None, hint: str | None, exact_int8: bool = False) -> Executor:
    ort = require("onnxruntime", "pip install onnxruntime", "running ONNX models")
    provider = _ort_provider(ort.get_available_providers(), device)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if exact_int8:  # no QDQ fusion: DequantizeLinear then float kernels (the x64quantprecision switch crashed
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # on a DenseNet's QDQ)
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    # onnxruntime 1.32's NchwcTransformer (a CPU layout pass of ORT_ENABLE_ALL) segfaults loading an FP16 SASRec: the
    # process dies with no message (exit 139). It only re-lays convolutions for AVX-512 float32 kernels, so it is
    # turned off for float16 graphs alone.
    skip = ["NchwcTransformer"] if provider == "CPUExecutionProvider" and _float16(path) else []
    session = ort.InferenceSession(str(path), options, providers=[provider], disabled_optimizers=skip)
    names = [i.name for i in session.get_inputs()]
    used = session.get_providers()

    def outputs(x: Any) -> list:
        return session.run(None, feed_for(x, names))

    return Executor(path, "onnxruntime", "CUDA" if used[0].startswith("CUDA") else "CPU", lambda x: joined(outputs(x)),
                    {"providers": used, "version": ort.__version__, "threads": threads or 0, "exact_int8": exact_int8},
                    outputs)


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
    outputs = list(compiled.outputs)  # one a head for a multi-head task
    names = [i.get_any_name() for i in compiled.inputs]
    used = compiled.get_property("INFERENCE_PRECISION_HINT")
    used_name = used.to_string() if hasattr(used, "to_string") else str(used)  # an ov.Type: "bf16", "f32"
    request = compiled.create_infer_request()  # one per executor: an executor serves one thread at a time

    def run_all(x: Any) -> list:
        return _in_order(request.infer(feed_for(x, names)), outputs)

    return Executor(path, "openvino", device, lambda x: joined(run_all(x)),
                    {"precision_hint": hint, "inference_precision": used_name, "version": ov.get_version(),
                     "threads": threads or 0}, run_all)


def _float16(path: Path) -> bool:
    """Whether the ONNX file holds float16 weights or inputs (an fp16 artifact); parsed once per file version (the
    export stage and ``bench`` open an artifact several times)."""
    stat = path.stat()
    return _float16_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _float16_file(path: str, mtime_ns: int, size: int) -> bool:
    onnx = require("onnx", "pip install onnx", "reading ONNX models")
    model = onnx.load(path, load_external_data=False)
    half = onnx.TensorProto.FLOAT16
    return (any(t.data_type == half for t in model.graph.initializer)
            or any(v.type.tensor_type.elem_type == half for v in model.graph.input))


def _in_order(result: Any, outputs: list) -> list:
    return [result[o] for o in outputs]
