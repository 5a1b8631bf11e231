"""ONNX target: FP32, FP16 and INT8 (QDQ) with a dynamic batch dimension, checked by onnx and run by onnxruntime."""

from __future__ import annotations

import copy
import functools
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field

from ..artifacts import Artifact, atomic_path
from ..deployment import (INPUT_NAME, OUTPUT_NAME, deployment_record, int8_cpu_runtime, onnxruntime_fused_runtime,
                          record_outputs)
from ..formats.onnx import stamp_onnx
from ..deps import require
from ..errors import ExportError, InputError, MissingDependencyError, PruneflowError
from ..evaluate import no_attention_fastpath
from ..inputs import Inputs, bind, fresh, is_token, padded_text, take, to
from ..stage import BuildInputs, Target, TargetConfig
from .attention_mask import soften_mask_fill
from .bags import export_error_in, swap_bags
from .forms import record_choice
from .fused_int8 import AUTO_FUSED, FUSED_ENCODINGS
from .qdq.graph import convention
from .tied import quantize_float_ties, share_tied_tables

if TYPE_CHECKING:
    from .forms import Choice
    from .fusion import Fusion
    from .qdq.graph import Form, PassReport


class OnnxConfig(TargetConfig):
    type: Literal["onnx"] = Field(default="onnx", description="ONNX model run by onnxruntime.")
    opset: int = Field(default=17, ge=13, le=23, description="ONNX opset version (also of the ONNX the openvino and tensorrt "
                       "targets of this stage export for themselves, e.g. when this target's file is fused for onnxruntime).")
    dynamic_batch: bool = Field(default=True, description="Make the batch dimension dynamic.")
    exporter: Literal["legacy", "dynamo"] = Field(
        default="legacy",
        description="`legacy` (TorchScript tracing; fast, handles most CNNs) or `dynamo` (torch.export; needs onnxscript); "
        "the openvino and tensorrt targets of this stage export their own float ONNX with it too.",
    )
    int8_forms: list[Literal["cpu", "tensorrt"]] = Field(
        default=["cpu", "tensorrt"], min_length=1,
        description="INT8 files to write from the same quantization parameters: `cpu` (model.int8.onnx: uint8 activations, "
        "what onnxruntime and OpenVINO run fastest on x86) and `tensorrt` (model.int8.tensorrt.onnx: TensorRT's explicit "
        "quantization convention, int8 zero point 0 everywhere; precision int8, form tensorrt, named `onnx.int8_tensorrt` in metrics).",
    )
    fuse: Literal["auto", "off"] = Field(
        default="auto",
        description="`auto`: a BERT-like encoder is written in onnxruntime's fused ops (its transformer optimizer, each "
        "layer's own head count pinned first, so pruned layers fuse right): fp32 with Attention and BiasGelu (residual "
        "Add + LayerNormalization kept: faster in onnxruntime than its SkipLayerNormalization), kept only when it "
        "computes what the unfused graph does on real samples; int8 adds `fused` "
        "(QAttention and integer MatMuls on the trained scales) to the candidates of `form: auto` (`fused_dynamic`, with "
        "activation scales measured per call, only when pinned: a row's result then depends on its batch-mates). Such files hold com.microsoft ops: onnxruntime runs them, other runtimes "
        "do not (the openvino and tensorrt targets then export their own standard ONNX). `off`: standard ONNX ops only.",
    )
    form: Literal["auto", "u8s8", "u8s8_vnni", "s8s8", "fused", "fused_dynamic"] = Field(
        default="auto",
        description="How model.int8.onnx (the `cpu` file) encodes activations. `auto`: build every encoding this CPU's int8 "
        "kernels compute exactly, check each against the quantized torch model, time them interleaved in onnxruntime "
        "(the stage's `latency` batch sizes) and keep the first, in the order below, within 3 % of the fastest; the table "
        "is in the report, and a form that needs VNNI says so in the file's deployment record. Being measured, the choice "
        "can differ between hosts and runs. `u8s8`: uint8 activations with a Clip and weights fitted so x86 CPUs without "
        "VNNI cannot saturate (exact everywhere; the only candidate there). `u8s8_vnni`: the same without the Clips and "
        "the fit (one op fewer per activation; needs VNNI, AMX or ARM). `s8s8`: int8 activations as NNCF trained them. "
        "`fused`, `fused_dynamic`: a transformer in onnxruntime's fused ops (see `fuse`; needs VNNI, AMX or ARM). "
        "Pin one to build for another machine than this one, or for byte-identical rebuilds.",
    )

    def onnx_export(self) -> dict[str, Any]:
        return {"opset": self.opset, "exporter": self.exporter}

    def static_batch(self) -> bool:
        return not self.dynamic_batch

    def left_to_host(self) -> frozenset[str]:
        return frozenset({"form"} if self.form == "auto" else ())

    def pinned_cpu_form(self) -> str | None:
        return self.form if self.form != "auto" and "cpu" in self.int8_forms else None


class OnnxTarget(Target[OnnxConfig]):
    Config = OnnxConfig
    precisions = ("fp32", "fp16", "int8")
    times_start = True

    def start_file(self, onnx: Path, tmp: Path) -> Path:
        return onnx

    def preflight(self) -> list[str]:
        require("onnx", "pip install onnx", "the onnx target")
        require("onnxruntime", "pip install onnxruntime", "the onnx target")
        return []

    def build(self, state, ctx, out_dir: Path, precision: str, given: BuildInputs) -> Artifact | list[Artifact]:
        cfg = self.config
        path = out_dir / f"model.{precision}.onnx"
        record = deployment_record(state, ctx, dynamic_batch=cfg.dynamic_batch)
        if precision == "int8":
            stripped = state.handle.int8_module(state.example_input)  # once for every form
            return [self._int8_or_failed(stripped, state, ctx, out_dir, form, record, given.latency)
                    for form in dict.fromkeys(cfg.int8_forms)]
        # fp32/fp16: the float model that entered quantization, when a ptq/qat stage ran (handle.float_module).
        export = functools.partial(export_onnx, state.handle.float_module(), state.example_input, opset=cfg.opset,
                                   dynamic_batch=cfg.dynamic_batch, exporter=cfg.exporter, output_name=state.task.output_names)
        if precision == "fp16":
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                export(Path(tmp) / "fp32.onnx")
                to_fp16(Path(tmp) / "fp32.onnx", path, metadata=(record, "fp16"))
        else:
            export(path, metadata=(record, "fp32"))
        fusion, record = self._fuse(state, path, record) if precision == "fp32" else (None, record)
        artifact = Artifact.from_file(ctx.run_dir, path, kind="onnx", producer="export", target="onnx", precision=precision,
                                      deployment=record)
        _component_bytes(artifact, path)
        if fusion is not None:
            artifact.notes.append(fusion.note())
            artifact.metrics["fused_ops"] = fusion.contrib_ops
        if state.handle.quantized:
            artifact.notes.append("the float model that entered quantization (the float base of the quantized checkpoint), "
                                  "not the quantized model's float weights")
        return artifact

    def _fuse(self, state, path: Path, record: dict) -> "tuple[Fusion | None, dict]":
        """``path`` rewritten in onnxruntime's fused transformer ops when ``fuse: auto`` and the model is a BERT-like
        encoder the fusions hold for (``fusion.py``), its record then saying it needs onnxruntime; (None, record) for
        a model with no attention layer to fuse."""
        from .forms import parity_samples
        from .fusion import fuse_for_onnxruntime

        if self.config.fuse == "off" or not isinstance(state.example_input, dict):
            return None, record
        fused_record = {**record, "runtime": onnxruntime_fused_runtime(record.get("runtime"))}
        fusion = fuse_for_onnxruntime(path, path, parity_samples(state), stamp=lambda proto: stamp_onnx(proto, fused_record, "fp32"))
        return (fusion if fusion.heads else None), (fused_record if fusion.kept else record)

    def _int8_or_failed(self, stripped: torch.nn.Module, state, ctx, out_dir: Path, form: Form, record: dict,
                        latency: Any) -> Artifact:
        """One INT8 form, or its ``failed`` record: one form that cannot be written leaves the other (the export
        stage turns a failed artifact into a failed ``<label>.build`` gate, exit 1)."""
        try:
            return self._int8(stripped, state, ctx, out_dir, form, record, latency)
        except (InputError, MissingDependencyError):
            raise
        except PruneflowError as exc:
            ctx.reporter.warning(f"onnx int8 ({form} form) failed: {exc.message}")
            return Artifact(path=out_dir.resolve().relative_to(ctx.run_dir.resolve()).as_posix(), kind="onnx", producer="export",
                            status="failed", target="onnx", precision="int8", form=form,
                            notes=[exc.message + (f" (hint: {exc.hint})" if exc.hint else "")])

    def _int8(self, stripped: torch.nn.Module, state, ctx, out_dir: Path, form: Form, record: dict, latency: Any) -> Artifact:
        cfg = self.config
        path = out_dir / ("model.int8.onnx" if form == "cpu" else "model.int8.tensorrt.onnx")
        raw = export_raw_qdq(stripped, state.example_input, out_dir, opset=max(cfg.opset, 13), dynamic_batch=cfg.dynamic_batch,
                             output_name=record_outputs(record))
        choice = None
        if form == "cpu":
            record = dict(record)
            report, choice = self._cpu_form(raw, state, ctx, path, record, latency)
        else:
            report = write_int8_onnx(raw, path, form=form, metadata=record)
        artifact = Artifact.from_file(ctx.run_dir, path, kind="onnx", producer="export", target="onnx",
                                      precision="int8", form=form, deployment=record)
        if choice is not None:
            record_choice(artifact, choice, self, "onnxruntime")
        artifact.metrics.update(weights_int8=report.weights_folded, batchnorms_folded=report.batchnorms_folded,
                                ops_float=len(report.float_ops))
        _component_bytes(artifact, path)
        artifact.notes += report.notes
        if form == "cpu":
            artifact.metrics["u8s8_channels_fitted"] = report.u8s8_channels_fitted
            encoding = choice.form if choice is not None else cfg.form
            if encoding in FUSED_ENCODINGS:  # onnxruntime's contrib ops: the openvino target converts a QDQ form
                artifact.metrics["fused_ops"] = sum(n.domain == "com.microsoft" for n in _load(path).graph.node)
            else:
                _check_runs_in_openvino(path, state.example_input)
            _integer_ops_record(artifact, path)
            fp32 = out_dir / "model.fp32.onnx"  # written first when precisions list fp32 before int8
            if fp32.is_file():
                artifact.metrics["size_ratio_fp32"] = round(fp32.stat().st_size / path.stat().st_size, 3)
        if convention(form).foreign:
            artifact.notes.append("TensorRT explicit-quantization form (int8, zero point 0, per-channel weights on axis 0); "
                                  "checked and measured here in onnxruntime without Q/DQ fusion (DequantizeLinear, then float kernels: "
                                  "its arithmetic, not onnxruntime's integer kernels; its latency there says nothing of TensorRT's)")
        return artifact

    def _cpu_form(self, raw, state, ctx, path: Path, record: dict, latency: Any) -> "tuple[PassReport, Choice | None]":
        """Write model.int8.onnx in the recipe's `form`, or (``auto``) in the encoding this host runs fastest in
        onnxruntime, chosen by measuring the exact ones side by side (``forms.py``) as the export stage times
        (``latency``, its settings)."""
        from ..runtime import open_artifact
        from .forms import Candidate, decide, exact_encodings

        encodings, why = exact_encodings()
        if self.config.form != "auto" or len(encodings) == 1:
            encoding = encodings[0] if self.config.form == "auto" else self.config.form
            record["runtime"] = int8_cpu_runtime(encoding)
            if encoding in FUSED_ENCODINGS:
                record["runtime"] = onnxruntime_fused_runtime(record["runtime"])
            report = write_int8_onnx(raw, path, form="cpu", encoding=encoding, metadata=record)
            return report, None if self.config.form != "auto" else decide([], state, latency, why=why, only=encoding)
        if self.config.fuse == "auto" and isinstance(state.example_input, dict):
            encodings = encodings + list(AUTO_FUSED)  # tried; a model the fusions do not fit is no candidate
        ctx.reporter.info(f"onnx int8: timing the encodings {', '.join(encodings)} in onnxruntime to keep the fastest")
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            reports, candidates = {}, []
            for encoding in encodings:
                file = Path(tmp) / f"{encoding}.onnx"
                try:
                    reports[encoding] = write_int8_onnx(raw, file, form="cpu", encoding=encoding, metadata=None)
                    run = open_artifact(file, runtime="onnxruntime", threads=latency.threads if latency else 1)
                except Exception as exc:  # noqa: BLE001 - an optional fused form that fails is no candidate
                    if encoding not in FUSED_ENCODINGS:
                        raise
                    why = exc.message if isinstance(exc, PruneflowError) else f"{type(exc).__name__}: {exc}"
                    ctx.reporter.info(f"onnx int8: the {encoding} form is not a candidate: {why}")
                    continue
                candidates.append(Candidate(encoding, file, run))
            choice = decide(candidates, state, latency, static=not self.config.dynamic_batch)
            record["runtime"] = int8_cpu_runtime(choice.form)
            if choice.form in FUSED_ENCODINGS:
                record["runtime"] = onnxruntime_fused_runtime(record["runtime"])
            return write_int8_onnx(raw, path, form="cpu", encoding=choice.form, metadata=record), choice


class _Keyed(torch.nn.Module):
    """Positional inputs to keyword ones, so the exporter traces a model with several named inputs."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args: torch.Tensor):
        return self.model(**dict(zip(self.names, args)))


def _names(output: "str | list[str]") -> list[str]:
    """The graph's output names: the task's one, or one a head of a multi-head task."""
    return [output] if isinstance(output, str) else list(output)


def _traced(model: torch.nn.Module, example: Inputs, dynamic_batch: bool, output: "str | list[str]" = OUTPUT_NAME):
    """(module, args, input names, dynamic axes) to export: one tensor named ``input``, or forward's parameters
    in forward's order, their batch axis dynamic and, for int64 token inputs, their sequence axis too.
    A fresh batch of 2: a sliced example or batch 1 can fix the batch dimension in the graph; a static
    graph is exported for batch 1 (the measuring step then feeds it one sample at a time)."""
    x = bind(model, fresh(example, 2 if dynamic_batch else 1))
    text = padded_text(example)  # (before bind, which drops a mask forward does not take)
    if isinstance(x, torch.Tensor):
        axes = {INPUT_NAME: {0: "batch"}, **{o: {0: "batch"} for o in _names(output)}} if dynamic_batch else None
        return model, (x,), [INPUT_NAME], axes
    names = list(x)
    axes = {n: ({0: "batch"} if dynamic_batch else {}) | ({1: "sequence"} if text and is_token(x[n]) else {}) for n in names}
    axes = {n: a for n, a in axes.items() if a}
    if dynamic_batch:
        axes.update({o: {0: "batch"} for o in _names(output)})
    return _Keyed(model, names), tuple(x.values()), names, axes or None


def _load(path: Path):
    return require("onnx", "pip install onnx", "the onnx target").load(str(path), load_external_data=False)


def _component_bytes(artifact: Artifact, path: Path) -> None:
    """``table_bytes``/``other_bytes`` on a model with embedding tables (a ranker's are most of its bytes)."""
    from .embedding import component_bytes

    onnx = require("onnx", "pip install onnx", "ONNX export")
    parts = component_bytes(onnx.load(str(path)))
    if parts["table_bytes"]:
        artifact.metrics.update(parts)


def canonical_initializers(proto):
    """``proto`` with its initializers sorted by name. The exporter lists them in the order the module registered
    its parameters, and a pruned layer rebuilt from a checkpoint (``--resume``) registers ``weight`` before ``bias``
    where torch-pruning had left them the other way round: the same model, other bytes (issue 27, item 7)."""
    ordered = [type(t)() for t in proto.graph.initializer]
    for copy_, t in zip(ordered, proto.graph.initializer):
        copy_.CopyFrom(t)
    ordered.sort(key=lambda t: t.name)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(ordered)
    return proto


def export_onnx(model: torch.nn.Module, example: Inputs, path: Path, *, opset: int = 17,
                dynamic_batch: bool = True, exporter: str = "legacy", fold: bool = True,
                metadata: "tuple[dict, str] | None" = None, output_name: "str | list[str] | None" = None) -> None:
    """Export atomically (input ``input``, or forward's parameter names for several; output ``output_name``, default
    the name ``metadata``'s record gives it (the task's: ``Task.output_name``), else ``logits``), fold what is computed from constants
    (``fold``), write ``metadata`` (deployment record, precision) into the file, then validate with
    onnx.checker. A model that will not trace raises ExportError."""
    onnx = require("onnx", "pip install onnx", "ONNX export")
    model = copy.deepcopy(model).cpu().eval()  # the live model may be on a GPU and still in use
    # nn.EmbeddingBag in plain ops (export/bags.py): the legacy exporter refuses padding_idx, both write a Loop
    model, _ = swap_bags(model)
    output = output_name or (record_outputs(metadata[0]) if metadata is not None else OUTPUT_NAME)
    traced, args, names, axes = _traced(model, example, dynamic_batch, output)
    with atomic_path(path) as tmp:
        try:
            with warnings.catch_warnings(), no_attention_fastpath():
                warnings.simplefilter("ignore")
                if exporter == "dynamo":
                    require("onnxscript", "pip install onnxscript", "the dynamo ONNX exporter")
                    dims = {0: torch.export.Dim("batch")} if dynamic_batch else None
                    shapes = ({"x": dims} if traced is model else {"args": tuple(dims for _ in args)}) if dims else None
                    program = torch.onnx.export(traced, args, dynamo=True, opset_version=opset, dynamic_shapes=shapes,
                                                input_names=names, output_names=_names(output))
                    assert program is not None  # None only from the legacy exporter (dynamo=False)
                    program.save(str(tmp), external_data=False)
                else:
                    torch.onnx.export(traced, args, str(tmp), dynamo=False, opset_version=opset,
                                      input_names=names, output_names=_names(output), dynamic_axes=axes)
        except Exception as exc:  # noqa: BLE001 - torch raises many types when a model will not trace
            ours = export_error_in(exc)  # our own modules' refusal while tracing (bags.py), which dynamo wraps
            if ours is not None:
                raise ours from None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ExportError(
                f"the model could not be exported to ONNX ({exporter} exporter): {type(exc).__name__}: {first}",
                hint=("an operator the exporter does not know: try `exporter: dynamo` (or a higher `opset`) on the onnx target"
                      if "UnsupportedOperator" in type(exc).__name__ else
                      "data-dependent Python control flow does not trace; try `exporter: dynamo` on the onnx target, "
                      "or make the forward pass shape-static"),
            ) from exc
        proto = fold_constants(onnx.load(str(tmp))) if fold else onnx.load(str(tmp))
        if fold:  # (an INT8 export folds, and softens, after its Q/DQ conversion)
            soften_mask_fill(proto)
            # after folding, which wrote a tied output projection's transposed table as a second initializer (tied.py)
            share_tied_tables(proto)
        if metadata:
            stamp_onnx(proto, *metadata)
        onnx.save(canonical_initializers(proto), str(tmp))
        try:
            onnx.checker.check_model(str(tmp))
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"the exported ONNX model failed onnx.checker: {exc}") from exc


#: Never folded: weight quantizers stay Q/DQ pairs (the INT8 passes and runtimes read them), and the
#: dequantized float weights would take four times the space.
KEEP_UNFOLDED = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})


def fold_constants(model):
    """The ModelProto with every node whose inputs are all constants replaced by its value (onnxscript's
    constant folding, a dependency of the exporter), unused nodes removed and Constant nodes lifted to
    initializers; standard ONNX ops only, the batch dimension left as it was.

    The legacy exporter computes, e.g., the Pad amounts of a ResNet option-A shortcut at run time from
    constants (ConstantOfShape, Concat, Reshape, Slice, Transpose, Reshape, Cast: 8 nodes a shortcut),
    which some deployment parsers reject and all of them run needlessly. onnxscript keeps
    ConstantOfShape by default (to keep files small); here it folds when its output is small.
    """
    from onnxscript import ir, optimizer
    from onnxscript.ir.passes.common import LiftConstantsToInitializersPass

    def should_fold(node) -> bool | None:
        if node.op_type in KEEP_UNFOLDED:
            return False
        return True if node.op_type == "ConstantOfShape" else None  # None: onnxscript's own rules (size limits)

    ir_model = ir.from_proto(model)
    optimizer.fold_constants(ir_model, should_fold=should_fold)
    optimizer.remove_unused_nodes(ir_model)
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(ir_model)
    return ir.to_proto(ir_model)


def to_fp16(src: Path, dst: Path, metadata: "tuple[dict, str] | None" = None) -> None:
    """FP16 weights and compute with FP32 inputs and outputs (onnxruntime's float16 converter).

    On a CPU this checks the task's metrics; FP16 speed belongs to GPUs (onnxruntime's CPU kernels upcast).
    """
    onnx = require("onnx", "pip install onnx", "FP16 ONNX")
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    OnnxModel.graph_topological_sort(model.graph)  # the converter appends its input casts after their users
    if metadata:
        stamp_onnx(model, *metadata)
    with atomic_path(dst) as tmp:
        onnx.save(canonical_initializers(model), str(tmp))
        onnx.checker.check_model(str(tmp))


def _check_runs_in_openvino(path: Path, example: Inputs) -> None:
    """The CPU INT8 form is meant for onnxruntime and OpenVINO: it counts only if both run it.

    onnxruntime runs it in the export stage's checks; OpenVINO (when installed) compiles and runs it
    here. OpenVINO once failed to compile onnxruntime's own QDQ output for ResNet-56 (STACK-NOTES).
    """
    try:
        import openvino as ov
    except ImportError:
        return
    import numpy as np

    try:
        from ..runtime.base import feed_for

        compiled = ov.Core().compile_model(ov.convert_model(str(path)), "CPU")
        one = take(example, slice(0, 1))  # batch 1 fits a static graph too
        out = compiled(feed_for(one, [i.get_any_name() for i in compiled.inputs]))[compiled.output(0)]
        if not np.isfinite(out).all():
            raise ValueError("the outputs hold NaN or inf")
    except Exception as exc:  # noqa: BLE001
        path.unlink(missing_ok=True)
        raise ExportError(f"{path.name} runs in onnxruntime but not in OpenVINO: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                          hint="export `int8_forms: [tensorrt]` only, or report the model to pruneflow") from exc


# What onnxruntime runs in integer arithmetic once it has fused the QDQ pattern (its optimized graph), and the
# weighted ops it runs in float (in the CPU form: ops NNCF left float, or patterns ORT does not fuse).
INTEGER_OPS = frozenset({"MatMulInteger", "MatMulIntegerToFloat", "QLinearMatMul", "QGemm", "QLinearConv", "ConvInteger",
                         "DynamicQuantizeMatMul", "QAttention", "DynamicQuantizeLinear", "QLinearAdd", "QLinearMul"})
FLOAT_WEIGHTED_OPS = frozenset({"MatMul", "FusedMatMul", "Gemm", "FusedGemm", "Conv", "FusedConv", "ConvTranspose"})


def ort_optimized_ops(path: Path) -> dict[str, list[str]]:
    """The op types of the graph onnxruntime runs for ``path`` on CPU (``ORT_ENABLE_EXTENDED``, the fusions that do
    not depend on the host's layout), as {op_type: [node names]}: onnxruntime writes its optimized graph to a file,
    which is read back (no onnxruntime API returns it otherwise)."""
    onnx = require("onnx", "pip install onnx", "INT8 ONNX export")
    ort = require("onnxruntime", "pip install onnxruntime", "the onnx target")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    ops: dict[str, list[str]] = {}
    for node in graph.node:
        ops.setdefault(node.op_type, []).append(node.name)
    return ops


def _integer_ops_record(artifact: Artifact, path: Path) -> None:
    """Record on ``artifact`` how many ops onnxruntime runs in integer arithmetic and which weighted ops in float."""
    ops = ort_optimized_ops(path)
    integer = {op: len(names) for op, names in ops.items() if op in INTEGER_OPS}
    floats = [f"{op} {name}" for op, names in ops.items() if op in FLOAT_WEIGHTED_OPS for name in names]
    artifact.metrics.update(ort_integer_ops=sum(integer.values()), ort_float_matmuls=len(floats))
    detail = ", ".join(f"{n} {op}" for op, n in sorted(integer.items())) or "none"
    artifact.notes.append(f"onnxruntime (CPU, optimized graph) runs {sum(integer.values())} integer op(s) ({detail}) and "
                          f"{len(floats)} MatMul/Gemm/Conv in float" + (f": {', '.join(floats[:6])}" if floats else "")
                          + (" ..." if len(floats) > 6 else ""))


def export_int8_onnx(stripped: torch.nn.Module, example: Inputs, path: Path, *, form: "Form", encoding: str = "u8s8",
                     opset: int = 17, dynamic_batch: bool = True, metadata: dict | None = None,
                     output_name: "str | list[str] | None" = None) -> "PassReport":
    """Export a model stripped to torch's fake-quant ops (``handle.int8_module(example)``), convert it to
    ``form`` (the cpu form in ``encoding``), fold what is computed from constants (Q/DQ kept) and write the
    deployment ``metadata``."""
    output = output_name or (record_outputs(metadata) if metadata is not None else None)
    raw = export_raw_qdq(stripped, example, path.parent, opset=opset, dynamic_batch=dynamic_batch, output_name=output)
    return write_int8_onnx(raw, path, form=form, encoding=encoding, metadata=metadata)


def export_raw_qdq(stripped: torch.nn.Module, example: Inputs, folder: Path, *, opset: int = 17, dynamic_batch: bool = True,
                   output_name: "str | list[str] | None" = None):
    """The stripped model as torch exports it (Q/DQ around float weights, BatchNorm unfolded), as an
    onnx.ModelProto: what ``write_int8_onnx`` converts, once per form."""
    onnx = require("onnx", "pip install onnx", "INT8 ONNX export")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        raw = Path(tmp) / "qdq.onnx"
        export_onnx(stripped, to(example, "cpu"), raw, opset=max(opset, 13), dynamic_batch=dynamic_batch, fold=False,
                    output_name=output_name)
        return onnx.load(str(raw))


def write_int8_onnx(raw, path: Path, *, form: "Form", encoding: str = "u8s8", metadata: dict | None = None) -> "PassReport":
    """Convert a copy of ``raw`` (``export_raw_qdq``) to ``form``/``encoding``, check it against the form's
    convention and write it atomically to ``path``."""
    from .embedding import quantize_embeddings
    from .qdq import convert
    from .qdq.checks import check_convention, float_ops
    from .stacked import notes as stacked_notes
    from .stacked import stack_field_reads

    onnx = require("onnx", "pip install onnx", "INT8 ONNX export")
    model_proto = type(raw)()
    model_proto.CopyFrom(raw)
    fused = encoding in FUSED_ENCODINGS
    if not fused:  # a tie written in forward (`h @ items.weight.T`) gets the int8 weight quantizer a Linear has (tied.py)
        quantize_float_ties(model_proto)
    report = convert(model_proto, form, "s8s8" if fused else encoding)
    model_proto = fold_constants(model_proto)
    soften_mask_fill(model_proto)  # finfo.min attention-mask fill -> -60: onnxruntime's exp is 6x slower on it
    if not fused:  # a table tied to the output's int8 weight read from that weight, before quantize_embeddings (tied.py)
        report.notes += share_tied_tables(model_proto, form).notes()
    if fused:  # onnxruntime's fused transformer ops on the trained parameters (fused_int8.py), tables int8 inside
        model_proto = _fused_int8(model_proto, encoding, report)
    elif form == "cpu":  # embedding tables the quantization stage snapped, in int8 (weight-only, per-row scales): export/embedding.py
        report.notes += quantize_embeddings(model_proto, on_grid=True).notes()
        report.notes += stacked_notes(stack_field_reads(model_proto))  # one read for a ranker's per-field tables
    if metadata is not None:
        stamp_onnx(model_proto, metadata, "int8")
    problems = [] if fused else check_convention(model_proto, form)
    if problems:
        raise ExportError(f"the INT8 ONNX ({form}) does not meet its convention: " + "; ".join(problems[:3])
                          + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""),
                          hint="report the model to pruneflow; meanwhile `ignore` the layer named in the qat/ptq stage "
                          "(it is then kept in float), or export the other form only (`int8_forms` of the onnx target)")
    floats = float_ops(model_proto)
    if floats:
        report.float_ops = floats
        report.notes.append(f"{len(floats)} weighted op(s) kept in float, as NNCF left them (a layer in `ignore`, or "
                            "NNCF's own choice, e.g. a squeeze-excite gate or attention MatMuls of two activations): "
                            + ", ".join(floats[:8]) + (" ..." if len(floats) > 8 else ""))
    with atomic_path(path) as tmp_path:
        onnx.save(canonical_initializers(model_proto), str(tmp_path))
        onnx.checker.check_model(str(tmp_path))
    return report


def _fused_int8(model_proto, encoding: str, report: "PassReport"):
    """The s8s8 graph rebuilt in onnxruntime's fused ops (``fused_int8.build``), its summary in ``report``'s notes."""
    from .fused_int8 import build

    fused, summary = build(model_proto, "dynamic" if encoding == "fused_dynamic" else "static")
    report.notes += summary.notes
    report.notes.append(f"onnxruntime's fused transformer ops on the trained INT8 parameters: {summary.attention} QAttention "
                        f"(heads per layer {summary.heads}), {summary.matmuls} MatMulIntegerToFloat, activations quantized "
                        + ("per call (DynamicQuantizeLinear)" if encoding == "fused_dynamic" else "with the trained scales")
                        + f"; {summary.smooth_folded} SmoothQuant vector(s) folded into V projections")
    return fused


def onnx_latency(model: torch.nn.Module, example: Inputs, samples: Inputs, batch_sizes: list[int],
                 runs: int) -> dict[str, float]:
    """Median onnxruntime latency (CPU, one thread) of ``model`` exported to a throw-away ONNX file, per batch
    size, on fresh batches of ``samples``: ``{"latency_b32_median_ms": ...}``. What a stage reports for a
    model before and after it changes it (the prune stage does)."""
    from ..runtime import fresh_batch, open_artifact, time_interleaved

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_onnx(copy.deepcopy(model).cpu(), to(example, "cpu"), path)
        run = open_artifact(path, runtime="onnxruntime", device="cpu", threads=1)
        for bs in batch_sizes:
            stats = time_interleaved({"model": run}, fresh_batch(samples, bs), warmup=3, runs=runs)["model"]
            out[f"latency_b{bs}_median_ms"] = stats.p50_ms
    return out
