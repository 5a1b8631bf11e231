"""Deployment metadata: what a program feeding an artifact must know, written into the artifact itself.

One record per artifact (``Artifact.deployment``, and the run's in the manifest's ``deployment``)::

    {"format": "pruneflow-deployment/1",
     "input": {"name": "input", "shape": ["batch", 3, 32, 32], "dtype": "float32", "layout": "NCHW"},
     "output": {"name": "logits", "shape": ["batch", 10], "dtype": "float32"},
     "preprocessing": {"scale": 0.00392156862745098, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                       "steps": "x * scale, then (x - mean[c]) / std[c] per channel"},
     "labels": ["airplane", "automobile", ...],
     "runtime": null,      # an OpenVINO INT8 IR: {"openvino": {"INFERENCE_PRECISION_HINT": "f32"}, "why": ...}
     "hosts": {"cpu": ["avx2", "avx512_vnni"], "why": ...}}   # only when the recipe or --for names them

The same values go into each file: ONNX ``metadata_props`` (keys ``pruneflow.input``, ``pruneflow.output``,
``pruneflow.preprocessing``, ``pruneflow.labels``, ``pruneflow.precision``, ``pruneflow.format``,
``pruneflow.runtime``, and ``pruneflow.hosts`` where CPUs were named; each value JSON) and OpenVINO IR ``rt_info`` (the same keys under ``pruneflow``),
written and read back by each file's format (``pruneflow/formats/``: ``onnx.stamp_onnx``/``read_onnx``,
``openvino.stamp_ir``/``read_ir``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import RunContext, RunState
    from .recipe.models import DataSpec

FORMAT = "pruneflow-deployment/1"
#: The names every artifact of a run gives its input and output (ONNX at any precision, OpenVINO IR).
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
#: The record's keys, written into files as ``pruneflow.<key>``.
KEYS = ("format", "input", "output", "preprocessing", "labels", "precision", "runtime", "hosts")
#: Keys written into a file only when the record has them (an artifact built for no named CPU has no ``hosts``).
OPTIONAL_KEYS = ("hosts",)


def hosts_record(cpus: list[str]) -> dict[str, Any]:
    """The record's ``hosts``: the CPUs the recipe (``deploy.cpu``) or ``optimize --for`` named for serving."""
    return {"cpu": list(cpus), "why": "the CPUs this run was built to serve on: its INT8 form and OpenVINO hint were "
            "chosen to compute alike on every one (export/deploy_hosts.py)"}


def outside_hosts(record: dict[str, Any] | None, host: dict[str, Any] | None = None) -> str | None:
    """Why this host is none of the CPUs a record names (``hosts.cpu``), or None (named, or none named): its INT8
    form is still exact where ``cpu_shortfall`` says so, but its timings and choices were made for others."""
    from .recipe.cpus import cpu_flags
    from .runtime.host import host_info

    named = ((record or {}).get("hosts") or {}).get("cpu") if isinstance(record, dict) else None
    if not named:
        return None
    here = set((host or host_info())["cpu"].get("isa") or [])
    key = ("avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16", "amx_bf16", "asimd")  # what the choices depend on
    if any({f for f in cpu_flags(c) if f in key} == here & set(key) for c in named):
        return None
    return f"built for {', '.join(named)}; this CPU ({', '.join(sorted(here & set(key))) or 'no VNNI, no bf16'}) is none of them"

# How an OpenVINO INT8 IR is to be compiled (the record's ``runtime``): its float parts (LayerNorm, softmax,
# GELU, residual adds) were trained and calibrated in f32, and OpenVINO's CPU default on a host with bf16
# (AVX512-BF16, AMX) computes them in bf16, which moves near-tie predictions of a quantized transformer:
# MiniLM-L6 QAT on SST-2 flipped 2.4 % of dev sentences against the same IR in f32 (an FP32 IR 0.2 %), for
# 2-4 % less latency at batch 32. An IR cannot carry the hint itself (OpenVINO 2026.4 ignores it in rt_info
# runtime_options), so it is written here for the program that compiles the IR; pruneflow measures both ways,
# and the openvino target's `int8_hint: auto` leaves the default (``openvino_int8_default_runtime``) to an IR that
# agrees with the quantized model as well there (a pruned MiniLM with SmoothQuant: 5 % faster, as accurate).
def openvino_int8_runtime() -> dict[str, Any]:
    """The ``runtime`` entry of an OpenVINO INT8 IR's record (a new dict each call: records are mutable)."""
    return {"openvino": {"INFERENCE_PRECISION_HINT": "f32"},
            "why": "the float parts of an INT8 graph were trained in f32; a bf16 default moves near-tie predictions"}


def openvino_int8_default_runtime() -> dict[str, Any]:
    """The ``runtime`` entry of an OpenVINO INT8 IR measured faster, and agreeing as well, at OpenVINO's default
    (bf16 float parts where the CPU has AVX-512 BF16 or AMX): no hint."""
    return {"openvino": {}, "why": "measured at OpenVINO's default precision: faster here and as close to the quantized "
            "model as at f32 (the openvino target's int8_hint: auto)"}


def openvino_bf16_runtime() -> dict[str, Any]:
    """The ``runtime`` entry of an OpenVINO bf16 IR's record: the hint pins what OpenVINO's default only picks on some
    CPUs, so the IR computes alike wherever it is deployed (f32 where the CPU has no bf16 arithmetic)."""
    return {"openvino": {"INFERENCE_PRECISION_HINT": "bf16"},
            "why": "a bf16 artifact: OpenVINO computes it in bf16 where the CPU has AVX-512 BF16 or AMX, in f32 elsewhere",
            "fast_with_any_of": ["avx512_bf16", "amx_bf16"]}


#: ``platform.machine()`` names of x86 CPUs, whose int8 kernels without VNNI add product pairs in int16.
X86_ARCHES = ("x86_64", "AMD64", "i386", "i686")


def int8_cpu_runtime(encoding: str) -> dict[str, Any] | None:
    """The ``runtime`` entry of a CPU-form INT8 ONNX (``qdq.Encoding``): None for ``u8s8`` (exact on every CPU),
    else the instruction sets it needs, for the program (or `pruneflow bench`) that runs it on another host."""
    if encoding == "u8s8":
        return None
    return {"cpu": {"int8_form": encoding, "needs_any_of": ["avx512_vnni", "avx_vnni", "amx_int8", "(not x86)"]},
            "why": "x86 CPUs without VNNI add u8 x s8 products in int16 pairs, which this form's ranges can saturate; "
                   "there, export with the onnx target's `form: u8s8`"}


def onnxruntime_fused_runtime(runtime: dict[str, Any] | None) -> dict[str, Any]:
    """``runtime`` (a record's entry, or None) for an ONNX written in onnxruntime's fused contrib ops."""
    return {**(runtime or {}), "onnxruntime": {"contrib_ops": "com.microsoft"},
            "why_onnxruntime": "fused transformer ops (Attention/QAttention, BiasGelu) that only onnxruntime runs; "
                               "the onnx target's `fuse: off` writes standard ops"}


def onnxruntime_only(record: dict[str, Any] | None) -> bool:
    """Whether a record says its file holds ops only onnxruntime runs (``onnxruntime_fused_runtime``)."""
    return bool(((record or {}).get("runtime") or {}).get("onnxruntime"))


def cpu_shortfall(record: dict[str, Any] | None, host: dict[str, Any] | None = None) -> str | None:
    """Why this host cannot run an artifact exactly, from its deployment record's ``runtime.cpu`` (an INT8 form
    that needs VNNI, on an x86 CPU without it), or None when it can (or the record asks nothing)."""
    from .runtime.host import host_info

    cpu_need = ((record or {}).get("runtime") or {}).get("cpu") if isinstance(record, dict) else None
    if not isinstance(cpu_need, dict):
        return None
    cpu = (host or host_info())["cpu"]
    wanted = [str(f) for f in cpu_need.get("needs_any_of") or []]
    if cpu.get("arch") not in X86_ARCHES or set(wanted) & set(cpu.get("isa") or ()):
        return None
    return (f"its INT8 form {cpu_need.get('int8_form')} needs one of {', '.join(f for f in wanted if not f.startswith('('))} "
            "and this CPU has none: its int8 kernels can saturate here and compute another model; rebuild it on this "
            "host, or with the target's `form: u8s8`")


def deployment_record(state: "RunState", ctx: "RunContext", *, dynamic_batch: bool = True) -> dict[str, Any]:
    """The record for an artifact of this run's current model (``dynamic_batch``: the file's batch dimension)."""
    import torch

    from .inputs import bind, call, describe, padded_text, take

    example = state.example_input
    assert example is not None and state.data is not None  # set by the pipeline before any stage runs
    batch: str | int = "batch" if dynamic_batch else 1
    model = state.handle.float_module()
    with torch.no_grad():
        was = model.training
        model.eval()
        raw = call(model, take(example, slice(0, 1)))
        model.train(was)
    spec = ctx.recipe.data
    if isinstance(example, dict):  # several inputs: each by name (token axes named "sequence")
        described = describe(bind(model, example), text=padded_text(example))
        inputs = {k: {"shape": [batch, *v["shape"]], "dtype": v["dtype"]} for k, v in described.items()}
        record_in: dict[str, Any] = {"names": list(inputs), "inputs": inputs, "layout": "NL" if spec.tokenizer else "named"}
    else:
        record_in = {"name": INPUT_NAME, "shape": [batch, *map(int, example.shape[1:])],
                     "dtype": str(example.dtype).removeprefix("torch."), "layout": _layout(example.dim(), spec)}
    record = {
        "format": FORMAT,
        "input": record_in,
        "output": _output_record(state.task, raw, batch),
        "preprocessing": state.data.tabular.record() if state.data.tabular is not None else preprocessing(spec),
        "labels": list(state.data.class_names) if state.data.class_names else None,
    }
    cpus = getattr(getattr(ctx.recipe, "deploy", None), "cpu", None)
    if cpus:
        record["hosts"] = hosts_record(cpus)
    return record


def _output_record(task: Any, raw: Any, batch: Any) -> dict[str, Any]:
    """The output an artifact gives (``raw``: the model's own output on one sample): the task's one, or, for a
    multi-head task, one named output a head (``names``; under ``heads`` each shape as the model gives it, and so
    as the artifact does) that a runtime reads back flattened and concatenated in that order (``shape``)."""
    out = task.output(raw)
    record = {"name": task.output_name, "shape": [batch, *map(int, out.shape[1:])], "dtype": "float32"}
    names = task.output_names
    if len(names) > 1:
        parts = task.export_output(raw)
        record |= {"name": names[0], "names": names,
                   "heads": {n: {"shape": [batch, *map(int, p.shape[1:])], "dtype": "float32"} for n, p in zip(names, parts)}}
    return record


def record_outputs(record: dict) -> "str | list[str]":
    """The output name(s) a deployment record gives an artifact: one name, or one a head (``_output_record``)."""
    out = record["output"]
    return list(out["names"]) if "names" in out else str(out["name"])


def _layout(dims: int, spec: "DataSpec") -> str:
    """Images are always fed channels-first (the data loader transposes NHWC sources)."""
    if spec.tokenizer:
        return "NL"  # batch, token position
    return {4: "NCHW", 3: "NCL", 2: "NC"}.get(dims, "N" + "?" * (dims - 1))


def preprocessing(spec: "DataSpec") -> dict[str, Any]:
    """How raw samples become the model's input, from the recipe's data section (what data.py applies)."""
    if spec.tokenizer:
        return {"tokenizer": spec.tokenizer, "max_length": spec.max_length,
                "steps": "input_ids and attention_mask (and token_type_ids where the model takes them) of the text, "
                         "int64, truncated to max_length and padded with 0 to the batch's longest row"}
    out: dict[str, Any] = {"scale": resolved_scale(spec), "mean": spec.mean, "std": spec.std}
    out["steps"] = "x * scale" + (", then (x - mean[c]) / std[c] per channel" if spec.mean is not None else "")
    if out["scale"] is None:
        out["scale_rule"] = "1/255 when the raw samples are uint8, else 1"
    return out


def resolved_scale(spec: "DataSpec") -> float | None:
    """The factor raw samples are multiplied by: the recipe's number, or what ``scale: auto`` chose for its
    source (None where only reading the whole source could tell)."""
    if spec.scale != "auto":
        return float(spec.scale)
    if spec.format == "imagefolder":
        return 1 / 255  # decoded images are uint8
    if spec.format == "digits":
        return 1.0  # the loader already gives pixels in [0, 1]
    if spec.format == "npz":
        dtype = _npz_dtype(spec)
        return None if dtype is None else (1 / 255 if dtype == "uint8" else 1.0)
    return None


def _npz_dtype(spec: "DataSpec") -> str | None:
    """The stored dtype of the npz input array, from its header only (no array is read)."""
    import zipfile

    import numpy as np

    source = spec.eval or spec.path
    if not source or not Path(source).is_file():
        return None
    try:
        with zipfile.ZipFile(source) as archive:
            names = [n.removesuffix(".npy") for n in archive.namelist()]
            column = spec.input_column if isinstance(spec.input_column, str) else None
            candidates = [column] if column else ["image", "images", "pixel_values", "input", "inputs", "x", "features"]
            name = next((n for n in candidates if n in names), None)
            if name is None:
                return None
            with archive.open(name + ".npy") as fh:
                version = np.lib.format.read_magic(fh)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                _, _, dtype = read(fh)
            return str(dtype)
    except (OSError, ValueError, zipfile.BadZipFile):
        return None


def file_props(record: dict[str, Any], precision: str | None) -> dict[str, str]:
    """``pruneflow.<key>`` -> JSON text, for ONNX metadata_props and IR rt_info."""
    values = {**record, "precision": precision}
    return {f"pruneflow.{key}": json.dumps(values.get(key)) for key in KEYS if key not in OPTIONAL_KEYS or values.get(key)}


def openvino_hint(record: dict[str, Any] | None) -> str | None:
    """The INFERENCE_PRECISION_HINT a deployment record tells OpenVINO to compile with (None: its default)."""
    return (((record or {}).get("runtime") or {}).get("openvino") or {}).get("INFERENCE_PRECISION_HINT")


#: The record's readers and writers of each file type live with its format (``pruneflow/formats/``); the names stay
#: importable from here, where code written before the move (and the README of 0.1) found them.
_MOVED = {"read_onnx": "pruneflow.formats.onnx", "stamp_onnx": "pruneflow.formats.onnx",
          "read_ir": "pruneflow.formats.openvino", "stamp_ir": "pruneflow.formats.openvino"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib  # (at use: pruneflow.formats imports this module)

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
