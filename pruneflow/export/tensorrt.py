"""TensorRT target: a strongly typed engine where TensorRT and a CUDA GPU exist, a bundle to build it elsewhere.

The source is the onnx target's file of the same precision (``model.int8.tensorrt.onnx``, TensorRT's
explicit-quantization form, for int8; ``model.fp16.onnx``; ``model.fp32.onnx``), or one exported here
when the recipe has no onnx target. Then:

- **built** (``tensorrt`` imports and ``torch.cuda.is_available()``): ``model.<precision>.engine`` and its
  sidecar ``model.<precision>.engine.json`` (TensorRT version, GPU, compute capability, profile, source
  sha256), made in-process by ``tensorrt_build.build_engine``;
- **prepared** otherwise: ``export/tensorrt/<precision>/`` holds the source ONNX, ``build_engine.py`` (a
  byte-identical copy of ``tensorrt_build.py``), ``build.sh`` (that script, or trtexec for 10.x and 11.x),
  a README and ``status.json``. Nothing is measured; the manifest says "prepared, not built" and why.

Every input of the model gets its shapes in one optimisation profile: axis 0 the batch range (``shapes``)
and, for a text model's (batch, sequence) inputs (``input_ids``, ``attention_mask``, ``token_type_ids``),
axis 1 the sequence range (``sequence``). They stay int64: TensorRT's ONNX parser keeps INT64 I/O since
9.0 (8.x cast it to INT32), so no cast or build flag is needed; the engine then takes int64 bindings.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..artifacts import Artifact, publish_dir, sha256_file, write_text_atomic
from ..errors import ExportError, InputError, MissingDependencyError
from ..inputs import to
from ..stage import BuildInputs, StrictModel, Target, TargetConfig
from . import tensorrt_build

SOURCE_NAMES = {"fp32": "model.fp32.onnx", "fp16": "model.fp16.onnx", "int8": "model.int8.tensorrt.onnx"}
UPSTREAM_LABELS = {"fp32": "onnx.fp32", "fp16": "onnx.fp16", "int8": "onnx.int8_tensorrt"}


class _ProfileRange(StrictModel):
    """One optimisation-profile axis: ``min <= opt <= max``, checked when the recipe loads."""

    what: ClassVar[str] = "the profile"
    min: int
    opt: int
    max: int

    @model_validator(mode="after")
    def _ordered(self) -> "_ProfileRange":
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"{self.what} needs min <= opt <= max, got min {self.min}, opt {self.opt}, max {self.max}")
        return self


class TensorRtShapes(_ProfileRange):
    min: int = Field(default=1, ge=1, description="Smallest batch size the engine accepts (optimisation profile `min`).")
    opt: int = Field(default=8, ge=1, description="Batch size TensorRT tunes its kernels for (profile `opt`).")
    max: int = Field(default=32, ge=1, description="Largest batch size the engine accepts (profile `max`).")


class TensorRtSequence(_ProfileRange):
    what: ClassVar[str] = "the sequence range"
    min: int = Field(default=1, ge=1, description="Shortest sequence (tokens) the engine accepts (profile `min`).")
    opt: int = Field(default=64, ge=1, description="Sequence length TensorRT tunes its kernels for (profile `opt`).")
    max: int = Field(default=128, ge=1, description="Longest sequence (tokens) the engine accepts (profile `max`).")


class TensorRtConfig(TargetConfig):
    type: Literal["tensorrt"] = Field(default="tensorrt", description="TensorRT engine (built where TensorRT and a CUDA GPU exist, prepared otherwise).")
    shapes: TensorRtShapes = Field(
        default_factory=TensorRtShapes,
        description="Batch sizes of the engine's optimisation profile (`{min, opt, max}`), for every input; the "
        "other dimensions come from the ONNX (and `sequence` for text). An ONNX with a static batch "
        "(`dynamic_batch: false`) allows only 1, 1, 1.",
    )
    sequence: TensorRtSequence | None = Field(
        default=None,
        description="Text models: sequence lengths of the profile for every (batch, sequence) input (input_ids, "
        "attention_mask, token_type_ids), `{min, opt, max}`. Default: min 1, max `data.max_length`, opt the 90th "
        "percentile of the eval split's token counts rounded up to a multiple of 8 (a dynamically padded batch is "
        "as long as its longest row). Ignored for models without such inputs.",
    )
    workspace_mb: int = Field(default=1024, ge=16, description="TensorRT's workspace memory pool limit, in MiB.")
    timing_cache: bool = Field(
        default=True,
        description="Keep TensorRT's timing cache (`export/tensorrt/timing.cache`, where engines are built): the "
        "precisions of a run and `--resume` reruns reuse the kernel timings instead of measuring them again. "
        "The prepared bundle's commands write `timing.cache` beside the engine.",
    )


def toolchain_status() -> tuple[bool, str]:
    """(True, "") when engines can be built here; else (False, why not)."""
    try:
        tensorrt_build.import_tensorrt()
    except tensorrt_build.TensorRtMissing as exc:
        cause = str(exc).rsplit("(", 1)[-1].rstrip(")")
        return False, f"tensorrt is not importable here ({cause})"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device here (TensorRT builds engines on an NVIDIA GPU only)"
    return True, ""


class TensorRtTarget(Target[TensorRtConfig]):
    Config = TensorRtConfig
    precisions = ("fp32", "fp16", "int8")
    #: The source ONNX is the onnx target's file of the same precision when the stage builds it.
    depends_on = ["onnx"]

    def preflight(self) -> list[str]:
        available, reason = toolchain_status()
        if available:
            return []
        if self.config.required:
            raise MissingDependencyError(
                f"the tensorrt target is marked `required: true`, and it cannot build engines here: {reason}",
                hint="run on a machine with an NVIDIA GPU and `pip install tensorrt`, or drop `required: true` to get "
                "a prepared bundle (the ONNX, build_engine.py and the trtexec commands) to build there")
        return [f"tensorrt: prepared, not built ({reason})"]

    def build(self, state, ctx, out_dir: Path, precision: str, given: BuildInputs) -> Artifact:
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            source, parent = self._source(state, ctx, Path(tmp), precision, given)
            shapes = self._check_profile(source, self.config.sequence or default_sequence(state, ctx))
            available, reason = toolchain_status()
            if available:
                return self._build_engine(ctx, out_dir, precision, source, parent, shapes)
            return self._prepare(ctx, out_dir, precision, source, parent, shapes, reason)

    def _source(self, state, ctx, tmp: Path, precision: str, given: BuildInputs) -> tuple[Path, Artifact | None]:
        """The ONNX to build from: the onnx target's (same precision and form) or one exported into ``tmp`` at the
        onnx target's ``opset`` and ``exporter`` (its int8: at its opset, QDQ being written by the legacy exporter)."""
        found = [a for a in given.upstream if a.label == UPSTREAM_LABELS[precision] and a.status == "built"
                 and not a.metrics.get("fused_ops")]  # onnxruntime's fused contrib ops: TensorRT reads standard ONNX
        if found:
            return ctx.run_dir / found[0].path, found[0]
        from .onnx import export_int8_onnx, export_onnx, to_fp16

        path = tmp / SOURCE_NAMES[precision]
        example = to(state.example_input, "cpu")
        if precision == "int8":
            report = export_int8_onnx(state.handle.int8_module(example), example, path, form="tensorrt",
                                      output_name=state.task.output_names, **given.onnx_opset())
            for note in report.notes:
                ctx.reporter.info(f"tensorrt int8: {note}")
        elif precision == "fp16":
            export_onnx(state.handle.float_module(), example, tmp / "fp32.onnx", output_name=state.task.output_names,
                        **given.onnx_export)
            to_fp16(tmp / "fp32.onnx", path)
        else:
            export_onnx(state.handle.float_module(), example, path, output_name=state.task.output_names, **given.onnx_export)
        return path, None

    def _check_profile(self, source: Path, sequence: TensorRtSequence) -> dict:
        """One profile for every input of ``source``: the batch range on axis 0 (a static batch allows only
        min = opt = max = that batch) and, on (batch, sequence) inputs, the sequence range on axis 1."""
        inputs = inputs_info(source)
        s = self.config.shapes
        static = next((i["shape"][0] for i in inputs if i["shape"][0] >= 0), None)
        if static is not None and "shapes" not in self.config.model_fields_set:
            s = TensorRtShapes(min=static, opt=static, max=static)  # the default fits
        has_sequence = any(len(i["shape"]) == 2 and i["shape"][1] < 0 for i in inputs)
        seq = (sequence.min, sequence.opt, sequence.max) if has_sequence else None
        profile = {}
        for info in inputs:
            try:
                shapes = tensorrt_build.profile_shapes(tuple(info["shape"]), info["name"], (s.min, s.opt, s.max), seq)
            except tensorrt_build.BuildError as exc:
                raise InputError(f"the tensorrt target's profile does not fit {source.name}: {exc}",
                                 hint="the profile covers axis 0 (batch, `shapes`) of every input and axis 1 (`sequence`) of "
                                 "(batch, sequence) token inputs: for a static-batch ONNX set `shapes: {min: 1, opt: 1, max: 1}` "
                                 "(or `dynamic_batch: true` on the onnx target); other dimensions must be fixed in the model") from None
            profile[info["name"]] = {k: list(v) for k, v in shapes.items()}
        return {"inputs": inputs, "profile": profile, "batch": {"min": s.min, "opt": s.opt, "max": s.max},
                "sequence": None if seq is None else dict(zip(("min", "opt", "max"), seq))}

    def _build_engine(self, ctx, out_dir: Path, precision: str, source: Path, parent: Artifact | None, shapes: dict) -> Artifact:
        import torch

        engine = out_dir / f"model.{precision}.engine"
        gpu = {"name": torch.cuda.get_device_name(0), "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(0))}
        b, q = shapes["batch"], shapes["sequence"]
        try:
            tensorrt_build.build_engine(source, engine, min_batch=b["min"], opt_batch=b["opt"], max_batch=b["max"],
                                        sequence=None if q is None else (q["min"], q["opt"], q["max"]),
                                        workspace_mb=self.config.workspace_mb, gpu=gpu,
                                        timing_cache=out_dir / "timing.cache" if self.config.timing_cache else None)
        except tensorrt_build.BuildError as exc:
            raise ExportError(f"tensorrt {precision}: {exc}", hint="check the ONNX with `polygraphy check lint`") from exc
        artifact = Artifact.from_file(ctx.run_dir, engine, kind="tensorrt", producer="export", target="tensorrt",
                                      precision=precision, parent=parent.path if parent else None)
        artifact.add_file(ctx.run_dir, engine.with_name(engine.name + ".json"))
        artifact.notes.append(f"built with TensorRT on {gpu['name']} (compute capability {gpu['compute_capability']}); "
                              "runs only with that TensorRT version on that GPU model")
        return artifact

    def _prepare(self, ctx, out_dir: Path, precision: str, source: Path, parent: Artifact | None, shapes: dict,
                 reason: str) -> Artifact:
        """Write ``out_dir/<precision>/`` (atomically, as one folder) and return its prepared artifact."""
        final = out_dir / precision
        tmp = Path(tempfile.mkdtemp(prefix=f".{precision}.", dir=out_dir))
        try:
            write_bundle(tmp, precision, source, shapes, self.config, reason)
            publish_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        artifact = Artifact.from_file(ctx.run_dir, final / source.name, kind="tensorrt", producer="export", target="tensorrt",
                                      precision=precision, status="prepared", parent=parent.path if parent else None)
        for name in BUNDLE_FILES:
            artifact.add_file(ctx.run_dir, final / name)
        artifact.notes.append(f"prepared, not built: {reason}")
        artifact.notes.append(f"build on the GPU machine: sh {artifact.path.rsplit('/', 1)[0]}/build.sh (see its README.md)")
        return artifact


def default_sequence(state, ctx) -> TensorRtSequence:
    """The sequence range when the recipe sets none: min 1, max ``data.max_length``, opt the eval split's 90th percentile
    token count rounded up to a multiple of 8 (within min..max)."""
    import numpy as np

    from ..inputs import lengths

    top = int(getattr(ctx.recipe.data, "max_length", 128) or 128)
    counts = lengths(state.data.eval.x) if state.data is not None else None
    if counts is None or not len(counts):
        return TensorRtSequence(min=1, opt=min(64, top), max=top)
    p90 = int(np.ceil(float(np.percentile(counts.numpy(), 90)) / 8) * 8)
    return TensorRtSequence(min=1, opt=max(1, min(p90, top)), max=top)


BUNDLE_FILES = ("build_engine.py", "build.sh", "README.md", "status.json")


def inputs_info(onnx_path: Path) -> list[dict]:
    """Name, shape (-1 for a symbolic dimension) and dtype of every input of the model, in the graph's order."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    out = []
    for value in model.graph.input:
        if value.name in init:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
        out.append({"name": value.name, "shape": dims, "dtype": dtype})
    return out


def trtexec_commands(source: str, engine: str, shapes: dict, workspace_mb: int, timing_cache: bool) -> dict[str, str]:
    """trtexec for TensorRT 10.x (``--stronglyTyped``) and 11.x (strongly typed always; no precision flags).
    Every input with a dynamic dimension is listed in each shape flag (``input_ids:1x8,attention_mask:1x8``)."""
    args = [f"--onnx={source}", f"--saveEngine={engine}"]
    dynamic = [i["name"] for i in shapes["inputs"] if any(d < 0 for d in i["shape"])]
    if dynamic:  # a fully static model takes no shape flags
        for flag, key in (("--minShapes", "min"), ("--optShapes", "opt"), ("--maxShapes", "max")):
            args.append(f"{flag}=" + ",".join(f"{n}:" + "x".join(map(str, shapes["profile"][n][key])) for n in dynamic))
    args.append(f"--memPoolSize=workspace:{workspace_mb}")
    if timing_cache:
        args.append("--timingCacheFile=timing.cache")
    return {"10": " ".join(["trtexec", args[0], "--stronglyTyped", *args[1:]]), "11": " ".join(["trtexec", *args])}


def python_command(source: str, engine: str, shapes: dict, config: TensorRtConfig) -> str:
    """build_engine.py's command line for ``shapes``'s profile (batch range, and sequence range for text)."""
    b, q = shapes["batch"], shapes["sequence"]
    cmd = f"python3 build_engine.py --onnx {source} --engine {engine} --min {b['min']} --opt {b['opt']} --max {b['max']}"
    if q is not None:
        cmd += f" --min-seq {q['min']} --opt-seq {q['opt']} --max-seq {q['max']}"
    return cmd + f" --workspace-mb {config.workspace_mb}" + (" --timing-cache timing.cache" if config.timing_cache else "")


def write_bundle(folder: Path, precision: str, source: Path, shapes: dict, config: TensorRtConfig, reason: str) -> None:
    """The prepared bundle: the ONNX, build_engine.py (this package's build code), build.sh, README.md, status.json."""
    shutil.copyfile(source, folder / source.name)
    shutil.copyfile(Path(tensorrt_build.__file__), folder / "build_engine.py")
    engine = f"model.{precision}.engine"
    python_cmd = python_command(source.name, engine, shapes, config)
    trtexec = trtexec_commands(source.name, engine, shapes, config.workspace_mb, config.timing_cache)
    (folder / "build.sh").write_text(_build_sh(python_cmd, trtexec))
    (folder / "build.sh").chmod(0o755)
    (folder / "README.md").write_text(_readme(precision, source.name, engine, shapes, python_cmd, trtexec))
    status = {"status": "prepared", "reason": reason, "target": "tensorrt", "precision": precision,
              "source_onnx": source.name, "source_onnx_sha256": sha256_file(source), "engine": engine,
              "inputs": shapes["inputs"], "profile": shapes["profile"], "batch": shapes["batch"],
              "sequence": shapes["sequence"], "workspace_mb": config.workspace_mb,
              "commands": {"python": python_cmd, "trtexec_10": trtexec["10"], "trtexec_11": trtexec["11"]}}
    write_text_atomic(folder / "status.json", json.dumps(status, indent=2) + "\n")


def _build_sh(python_cmd: str, trtexec: dict[str, str]) -> str:
    return f"""#!/bin/sh
# Build the TensorRT engine on the machine with the NVIDIA GPU it will run on.
#   sh build.sh            the same build code pruneflow runs (needs `pip install tensorrt`)
#   sh build.sh trtexec10  trtexec of TensorRT 10.x (strongly typed: the precision comes from the ONNX)
#   sh build.sh trtexec11  trtexec of TensorRT 11.x (strongly typed always; it has no precision flags)
set -eu
cd "$(dirname "$0")"
case "${{1:-python}}" in
  python) {python_cmd} ;;
  trtexec10) {trtexec["10"]} ;;
  trtexec11) {trtexec["11"]} ;;
  *) echo "usage: sh build.sh [python|trtexec10|trtexec11]" >&2; exit 2 ;;
esac
"""


def _readme(precision: str, source: str, engine: str, shapes: dict, python_cmd: str, trtexec: dict[str, str]) -> str:
    inputs = "\n".join(_input_line(i) for i in shapes["inputs"])
    b, q = shapes["batch"], shapes["sequence"]
    ranges = f"batch sizes min {b['min']}, opt {b['opt']}, max {b['max']}"
    if q is not None:
        ranges += (f"; sequence lengths (tokens) min {q['min']}, opt {q['opt']}, max {q['max']}, the same for every "
                   "(batch, sequence) input: feed each batch padded to its longest row, at most the max")
    what = {"int8": "INT8 in TensorRT's explicit-quantization form (Q/DQ, int8 with zero point 0, weights per channel)",
            "fp16": "FP16 weights and compute, FP32 input and output", "fp32": "FP32"}[precision]
    return f"""# TensorRT {precision} engine: prepared, not built

pruneflow could not build the engine where it ran (see `status.json` for why): this folder holds
everything needed to build it on the machine with the NVIDIA GPU.

- `{source}`: the model, {what}.
- `build_engine.py`: the build code pruneflow runs where TensorRT exists (strongly typed network, ONNX
  parser, one optimisation profile, timing cache, engine written with a JSON sidecar).
- `build.sh`: that script, or trtexec for TensorRT 10.x or 11.x.

## Build

```sh
pip install tensorrt        # on the GPU machine; TensorRT needs CUDA even to parse the ONNX
{python_cmd}
```

or with trtexec (TensorRT 10.x; 11.x takes the same command without `--stronglyTyped`):

```sh
{trtexec["10"]}
{trtexec["11"]}
```

The precision comes from the ONNX itself (strongly typed), so no `--int8`/`--fp16` flag is needed;
TensorRT 11 removed them.

## Inputs

{inputs}

One optimisation profile: {ranges}.
Integer inputs stay int64: since TensorRT 9.0 the ONNX parser keeps INT64 (it no longer casts to INT32),
so no flag or cast is needed, and an engine with int64 inputs needs int64 bindings (onnx-tensorrt changelog).

## Engines are not portable

An engine runs only with the TensorRT version and on the GPU model (compute capability) it was
built with, and two builds are not byte-identical. Build it where it will run; `{engine}.json`
records the TensorRT version, GPU and compute capability of each build.
"""


def _input_line(info: dict) -> str:
    shape = info["shape"]
    names = ["batch", "sequence"] if len(shape) == 2 else ["batch"]
    dims = "x".join(names[i] if d < 0 and i < len(names) else str(d) for i, d in enumerate(shape))
    layout = ", layout NCHW" if len(shape) == 4 else ""
    return f"- name `{info['name']}`, shape {dims}, dtype {info['dtype']}{layout}"
