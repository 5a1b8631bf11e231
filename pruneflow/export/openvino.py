"""OpenVINO IR target, converted from the onnx target's files when the recipe builds them: FP32, FP16 (compressed
weights) and BF16 (compressed weights, bf16 inference precision pinned in its record) from the fp32 ONNX, INT8
from the INT8 ONNX of the form OpenVINO runs fastest on this host (pruneflow/export/qdq/, forms.py), so every
artifact of a run has the same graph, input and output names (`input`, `logits`) and quantization parameters.
Without those files the same ONNX is exported here first."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..artifacts import Artifact
from ..deployment import (deployment_record, int8_cpu_runtime, openvino_bf16_runtime, openvino_int8_default_runtime,
                          openvino_int8_runtime)
from ..formats.openvino import stamp_ir
from ..deps import require
from ..errors import ExportError
from ..inputs import to
from ..stage import BuildInputs, Target, TargetConfig
from .qdq.graph import convention, form_and_encoding


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


#: The name of a candidate INT8 IR timed at OpenVINO's default precision rather than f32 (``FORM@default``).
DEFAULT_HINT = "@default"


class OpenVinoConfig(TargetConfig):
    type: Literal["openvino"] = Field(default="openvino", description="OpenVINO IR (model.xml + model.bin) run by the OpenVINO CPU plugin.")
    dynamic_batch: bool = Field(default=True, description="Leave the batch dimension dynamic.")
    form: Literal["auto", "u8s8", "u8s8_vnni", "s8s8", "tensorrt"] = Field(
        default="auto",
        description="The INT8 ONNX form the INT8 IR is converted from (the onnx target's `form`, or `tensorrt`: int8 "
        "activations with TensorRT's residual placement). `auto`: convert every form this CPU runs exactly (on x86 without "
        "VNNI only `u8s8`), check each against the quantized torch model, time them interleaved in OpenVINO (f32 hint, "
        "the stage's `latency` batch sizes) and keep the first, in the order above, within 3 % of the fastest. A form the "
        "onnx target built is converted from its file; any other is written here first. Being measured, the choice can "
        "differ between hosts and runs: pin a form for byte-identical rebuilds.",
    )
    int8_hint: Literal["auto", "f32", "default"] = Field(
        default="auto",
        description="How the INT8 IR's float parts (LayerNorm, softmax, GELU, residual adds) are to be computed, written "
        "into its deployment record. `f32`: as they were trained (the record pins INFERENCE_PRECISION_HINT f32). "
        "`default`: OpenVINO's default (bf16 on CPUs with AVX-512 BF16 or AMX; the record pins nothing). `auto`: on a "
        "CPU whose default is bf16, each form is timed both ways; the default comes first (an IR that needs no hint is "
        "the simpler one to deploy) when it agrees with the quantized torch model as well as at f32 (the task's "
        "agreement figure on the parity samples), and f32 is kept when it is 3 % faster or the default moves "
        "predictions; elsewhere f32.",
    )

    def static_batch(self) -> bool:
        return not self.dynamic_batch

    def left_to_host(self) -> frozenset[str]:
        return frozenset(k for k, v in (("form", self.form), ("int8_hint", self.int8_hint)) if v == "auto")

    def pinned_cpu_form(self) -> str | None:
        return self.form if self.form != "auto" else None


class OpenVinoTarget(Target[OpenVinoConfig]):
    Config = OpenVinoConfig
    #: bf16: the fp32 graph with fp16-stored weights (exact for bf16 arithmetic's 8-bit mantissa, half the bytes) and
    #: a record pinning OpenVINO's bf16 inference precision.
    precisions = ("fp32", "fp16", "bf16", "int8")
    #: Every IR is converted from the onnx target's ONNX of its precision when the recipe builds it (fp32 for
    #: the fp32 and fp16 IR, the INT8 file of the chosen form for int8: one graph, one set of names and
    #: quantization parameters, one lineage); without it, that ONNX is exported here.
    depends_on = ["onnx"]
    times_start = True

    def start_file(self, onnx: Path, tmp: Path) -> Path:
        import openvino as ov

        ov.save_model(ov.convert_model(str(onnx)), str(tmp / "start.xml"))
        return tmp / "start.xml"

    def preflight(self) -> list[str]:
        require("openvino", "pip install openvino", "the openvino target")
        return []

    def build(self, state, ctx, out_dir: Path, precision: str, given: BuildInputs) -> Artifact:
        xml = out_dir / f"model.{precision}.xml"
        record = deployment_record(state, ctx, dynamic_batch=self.config.dynamic_batch)
        if precision == "int8":
            return self._int8(state, ctx, xml, record, given)
        if precision == "bf16":
            record["runtime"] = openvino_bf16_runtime()
        source = self._onnx_artifact(given.upstream, "onnx.fp32", ctx.run_dir)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            onnx_file = ctx.run_dir / source.path if source else self._export_onnx(state, Path(tmp), precision, given.onnx_export)
            self._save(self._convert(onnx_file, source is not None), xml, record, precision)
        return self._artifact(ctx, xml, record, precision, source)

    def _convert(self, onnx_file: Path, from_target: bool, int8: bool = False):
        from .ov_workarounds import prepared_for_openvino

        ov = require("openvino", "pip install openvino", "the openvino target")
        try:
            with warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=onnx_file.parent) as tmp:
                warnings.simplefilter("ignore")  # (a rewritten copy where OpenVINO would compute the graph wrongly)
                return _without_onnx_metadata(ov.convert_model(str(prepared_for_openvino(onnx_file, Path(tmp),
                                                                                         int8_tables=int8))))
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"OpenVINO could not convert {onnx_file.name if from_target else 'the model'} (converted from "
                              f"ONNX, never traced from torch): {type(exc).__name__}: {str(exc).splitlines()[0]}",
                              hint="the onnx target's artifact of this precision is the graph OpenVINO reads: check that "
                              "it builds and runs in onnxruntime; an operator OpenVINO lacks needs a newer openvino") from exc

    def _save(self, converted, xml: Path, record: dict, precision: str) -> None:
        """Stamp and write the IR beside the target, then rename: .bin first, so a visible .xml always has its weights."""
        ov = require("openvino", "pip install openvino", "the openvino target")
        stamp_ir(converted, record, precision)
        canonical_names(converted)
        with tempfile.TemporaryDirectory(dir=xml.parent) as tmp:
            ov.save_model(converted, str(Path(tmp) / "model.xml"), compress_to_fp16=precision in ("fp16", "bf16"))
            os.replace(Path(tmp) / "model.bin", xml.with_suffix(".bin"))
            os.replace(Path(tmp) / "model.xml", xml)

    def _artifact(self, ctx, xml: Path, record: dict, precision: str, source: Artifact | None) -> Artifact:
        artifact = Artifact.from_file(ctx.run_dir, xml, kind="openvino", producer="export", target="openvino",
                                      precision=precision, deployment=record)
        artifact.add_file(ctx.run_dir, xml.with_suffix(".bin"))
        if source is not None:
            artifact.parent = source.path
            artifact.notes.append(f"converted from {source.path}")
        return artifact

    def _int8(self, state, ctx, xml: Path, record: dict, given: BuildInputs) -> Artifact:
        """The INT8 IR, converted from the form the recipe names or (``auto``) the one OpenVINO runs fastest here."""
        from .forms import decide, exact_encodings, needs_vnni, record_choice

        exact, why = exact_encodings()
        forms: list[str] = [self.config.form] if self.config.form != "auto" else exact + (["tensorrt"] if len(exact) > 1 else [])
        record["runtime"] = openvino_int8_runtime()
        with tempfile.TemporaryDirectory(dir=xml.parent) as tmp:
            sources = self._int8_sources(forms, state, ctx, Path(tmp), given)
            models = {form: self._convert(path, upstream is not None, int8=True) for form, (path, upstream) in sources.items()}
            candidates = self._candidates(models, Path(tmp), given.latency)
            if len(candidates) == 1:
                choice = decide([], state, given.latency, why=why if self.config.form == "auto" else "set in the recipe",
                                only=next(iter(models)))
            else:
                ctx.reporter.info(f"openvino int8: timing {', '.join(c.form for c in candidates)} to keep the fastest")
                choice = decide(candidates, state, given.latency, static=not self.config.dynamic_batch)
            form, at_default = choice.form.removesuffix(DEFAULT_HINT), choice.form.endswith(DEFAULT_HINT)
            if at_default or self.config.int8_hint == "default":
                record["runtime"] = openvino_int8_default_runtime()
            cpu_need = int8_cpu_runtime(form) if needs_vnni(form) else None
            if cpu_need is not None:
                record["runtime"]["cpu"] = cpu_need["cpu"]
            self._save(models[form], xml, record, "int8")
            path, upstream = sources[form]
        artifact = self._artifact(ctx, xml, record, "int8", upstream)
        if upstream is None:
            artifact.notes.append(f"converted from the {form} INT8 ONNX, written for it from the quantized model")
        timed = {"f32": "openvino (f32 hint)", "default": "openvino (its default precision)"}
        record_choice(artifact, choice, self, timed.get(self.config.int8_hint, "openvino (f32 hint; FORM@default: its default)"))
        artifact.metrics["int8_hint"] = "default" if at_default or self.config.int8_hint == "default" else "f32"
        return artifact

    def _candidates(self, models: dict, tmp: Path, latency: Any) -> list:
        """Each form's IR opened at the f32 hint and, under ``int8_hint: auto`` on a CPU whose OpenVINO default is bf16,
        also at that default (``FORM@default``, before the same form at f32: ``forms._pick`` keeps the first within 3 %
        of the fastest, and a default one counts only when it agrees with the quantized model as well as at f32).
        Measured on a pruned MiniLM-L6 (AVX-512 BF16 EPYC, batch 32): the INT8 IR 5 % faster at the default,
        83.94 % of SST-2 dev right against 83.49 % at f32, as NNCF's own IR run at the default."""
        from ..runtime import host_info, open_artifact
        from .forms import Candidate

        ov = require("openvino", "pip install openvino", "the openvino target")
        threads = latency.threads if latency else 1
        isa = set(host_info()["cpu"].get("isa") or ())
        pinned: dict[str, list[str | None]] = {"f32": ["f32"], "default": [None]}
        hints = pinned.get(self.config.int8_hint) or ([None, "f32"] if isa & set(openvino_bf16_runtime()["fast_with_any_of"]) else ["f32"])
        if len(models) * len(hints) == 1:  # nothing to choose between: nothing opened or timed
            return [Candidate(next(iter(models)), None, lambda x: x)]
        candidates = []
        for form, model in models.items():  # per form: the default first, then f32 (the portable form's pair first)
            ov.save_model(model, str(tmp / f"{form}.xml"))
            for hint in hints:
                run = open_artifact(tmp / f"{form}.xml", runtime="openvino", precision_hint=hint, threads=threads)
                name = form if hint == "f32" or len(hints) == 1 else form + DEFAULT_HINT
                candidates.append(Candidate(name, tmp / f"{form}.xml", run, at_least_as=form if name != form else None))
        return candidates

    def _int8_sources(self, forms: list[str], state, ctx, tmp: Path, given: BuildInputs) -> dict[str, tuple[Path, Artifact | None]]:
        """``{form: (INT8 ONNX, the onnx target's artifact or None)}``: the onnx target's file of that form when it
        built one, else one written into ``tmp``. Under ``form: auto`` a form that cannot be written (TensorRT's needs
        signed activations) is left out; a pinned one raises."""
        from .onnx import export_raw_qdq, write_int8_onnx

        sources: dict[str, tuple[Path, Artifact | None]] = {}
        raw = None
        for form in forms:
            upstream = self._int8_artifact(given.upstream, form, ctx.run_dir)
            if upstream is not None:
                sources[form] = (ctx.run_dir / upstream.path, upstream)
                continue
            if raw is None:
                example = to(state.example_input, "cpu")
                raw = export_raw_qdq(state.handle.int8_module(example), example, tmp, dynamic_batch=self.config.dynamic_batch,
                                     output_name=state.task.output_names, **given.onnx_opset())
            try:
                qdq_form, encoding = form_and_encoding(form)
                write_int8_onnx(raw, tmp / f"{form}.onnx", form=qdq_form, encoding=encoding)
            except ExportError as exc:
                if self.config.form != "auto":
                    raise
                ctx.reporter.info(f"openvino int8: the {form} form is not a candidate: {exc.message}")
                continue
            sources[form] = (tmp / f"{form}.onnx", None)
        return sources

    def _int8_artifact(self, upstream: list[Artifact], form: str, run_dir: Path) -> Artifact | None:
        """The onnx target's INT8 artifact of ``form`` built in this stage, if any (a run before forms were chosen
        wrote its CPU file in ``u8s8``)."""
        if convention(form_and_encoding(form)[0]).foreign:  # the onnx target's file of that form (onnx.int8_tensorrt)
            return self._onnx_artifact(upstream, f"onnx.int8_{form}", run_dir)
        found = self._onnx_artifact(upstream, "onnx.int8", run_dir)
        return found if found is not None and found.metrics.get("int8_form", "u8s8") == form else None

    def _onnx_artifact(self, upstream: list[Artifact], label: str, run_dir: Path | None = None) -> Artifact | None:
        """The ONNX the onnx target built in this stage (among ``upstream``) under ``label`` (``onnx.fp32``: the fp32 and fp16 IR
        come from it, fp16 by compressing its weights; ``onnx.int8``: the CPU-form INT8), if any and (given
        ``run_dir`` to read it) with the batch dimension this target asks for; never a file fused for onnxruntime
        (``fused_ops``: com.microsoft ops OpenVINO does not read)."""
        found = [a for a in upstream if a.label == label and a.status == "built" and not a.metrics.get("fused_ops")]
        if not found or (run_dir is not None and _dynamic_batch(run_dir / found[0].path) != self.config.dynamic_batch):
            return None
        return found[0]

    def _export_onnx(self, state, tmp: Path, precision: str, onnx_export: dict[str, Any]) -> Path:
        """The ONNX to convert, exported into ``tmp`` when the onnx target did not build it in this stage: the
        same exporter (and the onnx target's ``opset`` and ``exporter``), names and constant folding as the onnx
        target's, so every artifact reads alike."""
        from .onnx import export_onnx

        path = tmp / f"{precision}.onnx"
        export_onnx(state.handle.float_module(), to(state.example_input, "cpu"), path, dynamic_batch=self.config.dynamic_batch,
                    output_name=state.task.output_names, **onnx_export)
        return path


def _dynamic_batch(onnx_path: Path) -> bool:
    """True when the ONNX model's first input has a symbolic (dynamic) batch dimension."""
    onnx = require("onnx", "pip install onnx", "reading an ONNX model")
    first = onnx.load(str(onnx_path), load_external_data=False).graph.input[0]
    return not first.type.tensor_type.shape.dim[0].HasField("dim_value")


def _without_onnx_metadata(model):
    """``model`` without the ONNX file's ``pruneflow.*`` metadata that OpenVINO's ONNX frontend copies into
    ``rt_info["framework"]``: ``stamp_ir`` writes the record under ``pruneflow`` anyway, and a ranker's vocabularies
    stored twice made its INT8 .xml 430 KB larger than the IR it describes (MMoE: 989 KB against 559 KB)."""
    info = model.get_rt_info()
    if "framework" not in info:
        return model
    kept = {k: v for k, v in dict(info["framework"]).items() if not str(k).startswith("pruneflow.")}
    del info["framework"]
    for key, value in kept.items():
        model.set_rt_info(value, ["framework", key])
    return model

