"""`qat` and `ptq` stages: quantization-aware training with a staged fp32 → fp16 → int8 schedule,
and post-training quantization (the cheap path QAT must match or beat)."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Callable, Literal

from pydantic import Field, field_validator
from torch import nn

from pruneflow import distributed
from pruneflow.distill import DistillSpec, Distiller, frozen_copy
from pruneflow.evaluate import evaluate_model
from pruneflow.export.embedding import snap_embedding_tables
from pruneflow.handle import ModelHandle
from pruneflow.stage import Stage, StageConfig, StageResult, StrictModel
from pruneflow.train import FinetuneSettings, fit

from .nncf_quant import SequentialRoot, is_ranker, quantize, quantizer_parameters, resolve_ranges, smoothed_inputs
from .precision import fp16_rounding
from .sensitivity import Sensitivity, sensitivity_control
from .settings import NncfSettings


class Phase(StrictModel):
    precision: Literal["fp32", "fp16", "int8"] = Field(description="Numeric precision the phase trains in.")
    epochs: int = Field(default=1, ge=0, le=10_000, description="Epochs of the phase (0: int8 only inserts and calibrates).")
    lr: float | None = Field(default=None, gt=0, description="Peak LR of the phase (default: finetune.lr).")


class QuantizeSettings(NncfSettings):
    """The qat and ptq stages' quantization settings: how NNCF quantizes (``NncfSettings``) and what is checked after."""

    sensitivity: Sensitivity | None = Field(
        default=None, description="Per-layer sensitivity report (the report's `quantization sensitivity` table) and "
        "`max_drop` fallback to float, NNCF's accuracy control done on the torch model: `{max_drop: 0.01, max_fallback: 10}`.")


class PtqConfig(StageConfig, QuantizeSettings):
    type: Literal["ptq"] = Field(default="ptq", description="INT8 post-training quantization (NNCF), no training.")


class QatConfig(StageConfig, QuantizeSettings):
    type: Literal["qat"] = Field(default="qat", description="Quantization-aware training: a staged fp32 → fp16 → int8 schedule.")
    backend: Literal["nncf"] = Field(default="nncf", description="FakeQuantize insertion backend.")
    schedule: list[Phase] = Field(
        default_factory=lambda: [Phase(precision="int8", epochs=2)],
        min_length=1, description="Phases in order; int8 must come last (FakeQuantize is inserted once).",
    )
    finetune: FinetuneSettings = Field(
        default_factory=lambda: FinetuneSettings(lr=1e-3, weight_decay=0.0),
        description="Training settings shared by the phases (each phase sets its own epochs and may set lr).",
    )
    distill: DistillSpec | None = Field(
        default_factory=lambda: DistillSpec(alpha=0.5), description="KD from the FP32 model entering the stage, in every phase."
    )
    freeze_bn_after: int | None = Field(
        default=None, ge=0, description="Epochs into the int8 phase after which BatchNorm statistics and quantizer ranges stop changing."
    )

    @field_validator("schedule")
    @classmethod
    def _int8_last(cls, value: list[Phase]) -> list[Phase]:
        names = [p.precision for p in value]
        if "int8" in names and names.index("int8") != len(names) - 1:
            raise ValueError("int8 must be the last phase (FakeQuantize is inserted once, at the start of int8)")
        return value


def _calibration(stage: Stage, state, ctx):
    """The run's calibration set, or a random one from the training split (with a note)."""
    if state.calibration is not None:
        return state.calibration
    from pruneflow.calibrate.build import build_calibration_set

    split = state.data.train if state.data.train is not None else state.data.eval
    tails = (" (this task's ranges are the extremes seen, so a calibrate stage of more samples reaches more of the "
             "tails)" if resolve_ranges(stage.config.ranges, state.task) == "minmax" else "")
    ctx.reporter.warning(f"{stage.id}: no calibrate stage ran; initialising ranges from {stage.config.calibration_size} "
                         f"random training samples{tails}")
    return build_calibration_set(split, size=stage.config.calibration_size, strategy="random", seed=ctx.seed)


def _calibration_of_run(stage: Stage, state, ctx) -> Callable:
    """``_calibration`` made once for this run of the stage, when first asked (a local of ``run``: nothing is kept
    on the stage between runs)."""
    return functools.cache(functools.partial(_calibration, stage, state, ctx))


def recurrent_float_notes(model) -> list[dict]:
    """A row per recurrent layer (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``): NNCF quantizes the inputs of Linear,
    convolution and MatMul ops, not a recurrent cell's gates, so these stay float in every INT8 artifact; an owner
    reading "INT8" should know (issue 37's owner trial found a GRU4Rec's GRU float, and nothing said so)."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters()) or 1
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, nn.RNNBase):
            params = sum(p.numel() for p in module.parameters())
            rows.append({"layer": name, "type": type(module).__name__, "params": params,
                         "note": f"{name} ({type(module).__name__}, {params:,} parameters, {params / total:.0%} of the model's) "
                                 "stays float in every INT8 artifact: NNCF quantizes Linear, convolution and MatMul inputs, "
                                 "not a recurrent cell's gates"})
    return rows


def _controlled(stage: Stage, state, ctx, result: StageResult, fp32: dict, int8: dict | None,
                calibration: Callable) -> StageResult:
    """``sensitivity``: the sensitivity table and the max_drop fallback (qat/sensitivity.py) added to ``result``,
    after the quantized model's ``smooth_quant_inputs`` (both stages' results pass through here)."""
    if result.handle is not None:
        result.metrics["smooth_quant_inputs"] = smoothed_inputs(result.handle.module)
    floats = recurrent_float_notes(state.model)
    if floats:
        result.tables["float_layers"] = floats
        for row in floats:
            ctx.reporter.info(f"{stage.id}: {row['note']}")
    spec = stage.config.sensitivity
    if spec is None or result.handle is None:
        return result
    handle = result.handle
    metrics, tables, gates = sensitivity_control(spec, stage.id, stage.loc("sensitivity"), handle.module, handle.float_module(),
                                              calibration(), state, ctx, fp32=fp32, int8=int8)
    result.metrics.update(metrics)
    result.tables.update(tables)
    result.gates += gates
    return result


def _compared(task, fp32: dict, int8: dict, samples: int) -> dict:
    """The stage's headline figures: the task's headline metric of the quantized model, of the float model that
    entered the stage (``_fp32``), how much worse the first is in the metric's direction (``_drop``), and
    ``eval_samples``."""
    figures: dict = {}
    for name in task.recorded_names:  # the headline first, then every head's and the recipe's own metrics
        figures |= {name: int8[name], f"{name}_fp32": fp32[name], f"{name}_drop": task.metric(name).worsening(fp32[name], int8[name])}
    return figures | {"eval_samples": samples}


def _int8(stage: Stage, state, ctx, calibration: Callable) -> ModelHandle:
    """The quantized model as an ``nncf`` handle whose float base is the model that entered quantization
    (checkpoints rebuild the quantizers on it; fp32/fp16 exports copy the trained weights into it).

    Word-embedding tables the INT8 export stores in int8 are first put on that grid and frozen
    (``snap_embedding_tables``), so the quantized model measured here is the one the artifacts compute."""
    cfg = stage.config
    base = copy.deepcopy(state.model).eval()  # NNCF adds its hooks in place
    snapped = snap_embedding_tables(state.model, bits=cfg.table_bits, fields=is_ranker(state.model))
    if snapped:
        ctx.reporter.info(f"{stage.id}: embedding table(s) {', '.join(snapped)} put on the int{cfg.table_bits} grid the "
                          "export stores them in (weight-only, per-row scales) and frozen")
    quantized = quantize(state.model, calibration(), cfg, ignore_loc=stage.loc("ignore"), task=state.task)
    if cfg.ranges == "auto" and resolve_ranges("auto", state.task) == "minmax":
        ctx.reporter.info(f"{stage.id}: activation ranges from the extremes the calibration samples reach (ranges: auto, "
                          f"for a {state.task.name} task: a clipped tail moves that sample's prediction)")
    smoothed = smoothed_inputs(quantized)
    if smoothed:
        ctx.reporter.info(f"{stage.id}: SmoothQuant (alpha {cfg.smooth_quant:g}) rescaled {smoothed} quantized Linear input(s) "
                          "per channel, their weights the other way")
    return ModelHandle(quantized, kind="nncf", float_base=base)


def _check_model(stage: Stage, model: nn.Module, batch) -> list[str]:
    """``Stage.check_model``, before any stage of the run trains: NNCF can quantize ``model`` with this stage's
    settings (``qat/nncf_preflight.py``), else a ConfigError on the stage naming the module and the `ignore` fix."""
    if not stage.quantizes(stage.config):
        return []
    from .nncf_preflight import check_quantizable

    return check_quantizable(model, batch, stage.config, loc=stage.loc())


class PtqStage(Stage[PtqConfig]):
    Config = PtqConfig
    modifies_model = True
    compresses = True
    check_model = _check_model

    @classmethod
    def quantizes(cls, config) -> bool:
        """PTQ always leaves an INT8 model, whatever its settings."""
        return True

    @property
    def needs_train_split(self) -> bool:
        return True

    def doctor(self, state, ctx):
        """`pruneflow doctor`: NNCF on the entering model and one batch (qat/doctor.py)."""
        from .doctor import quantize_checks

        return quantize_checks(self, state, ctx)

    def run(self, state, ctx):
        # Both on the whole eval split (eval_samples says how many): these are the figures gates compare, and
        # <headline>_fp32 is the model the fp32/fp16 artifacts are made from (the float base, untouched by PTQ's
        # bias correction).
        before = evaluate_model(state.model, state.data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                ctx.reporter, f"{self.id} fp32")
        calibration = _calibration_of_run(self, state, ctx)
        handle = _int8(self, state, ctx, calibration)
        after = evaluate_model(handle.module, state.data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                               ctx.reporter, f"{self.id} int8")
        result = StageResult(metrics=_compared(state.task, before, after, len(state.data.eval)), handle=handle)
        return _controlled(self, state, ctx, result, before, after, calibration)


class QatStage(Stage[QatConfig]):
    """The fp32/fp16 artifacts of a QAT run are the float model that entered the int8 phase (after the
    schedule's fp32/fp16 phases), not the QAT-trained weights without their quantizers: those were trained
    for the INT8 grid (BatchNorm statistics too) and never validated in float. So the fp32 artifact is the
    baseline the INT8 one is compared with, and it does not change when only the int8 settings do."""

    Config = QatConfig
    modifies_model = True
    compresses = True
    needs_train_split = True
    runs_under_ddp = True
    check_model = _check_model

    @classmethod
    def quantizes(cls, config) -> bool:
        """Only a schedule with an int8 phase inserts quantizers (an fp16-ending one leaves a float model)."""
        return any(p.precision == "int8" for p in config.schedule)

    def doctor(self, state, ctx):
        """`pruneflow doctor`: NNCF on the entering model and one batch (qat/doctor.py)."""
        from .doctor import quantize_checks

        return quantize_checks(self, state, ctx)

    def run(self, state, ctx):
        cfg = self.config
        teacher = frozen_copy(state.model) if cfg.distill else None
        calibration = _calibration_of_run(self, state, ctx)
        rows = []
        entering = evaluate_model(state.model, state.data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                  ctx.reporter, f"{self.id} fp32")
        headline = state.task.headline_name
        rows.append({"phase": "entering", "precision": "fp32", "epochs": 0, headline: entering[headline]})
        quantized = None  # the int8 phase's handle: later phases train its module; the pipeline installs it
        for i, phase in enumerate(cfg.schedule, 1):
            if phase.precision == "int8":
                quantized = _int8(self, state, ctx, calibration)
                # Under torchrun every rank initialises the ranges from the same calibration set; rank 0's
                # quantizer parameters and buffers are then broadcast, so the ranks start QAT identical.
                distributed.sync_state(quantized.module)
            model = quantized.module if quantized is not None else state.model
            settings = cfg.finetune.model_copy(update={"epochs": phase.epochs, "lr": phase.lr or cfg.finetune.lr})
            rounding = fp16_rounding(model) if phase.precision == "fp16" else contextlib.nullcontext()
            with rounding:
                if phase.epochs:
                    value = self._train(model, state, ctx, teacher, settings, phase, f"{self.id} {phase.precision}")
                else:
                    value = evaluate_model(model, state.data.eval, state.task, ctx.recipe.data.eval_batch_size,
                                           ctx.device, ctx.reporter, f"{self.id} {phase.precision}")[headline]
            rows.append({"phase": i, "precision": phase.precision, "epochs": phase.epochs, headline: value})
        # Every phase's metric is measured on the whole eval split (fit evaluates its last epoch there).
        final = {headline: rows[-1][headline]}
        metrics = _compared(state.task, entering, final, len(state.data.eval))
        for row in rows[1:]:
            metrics[f"{headline}_{row['precision']}"] = row[headline]
        result = StageResult(metrics=metrics, tables={"phases": rows}, handle=quantized)
        return _controlled(self, state, ctx, result, entering, final, calibration)

    def _train(self, model: nn.Module, state, ctx, teacher, settings, phase, description) -> float:
        """Train ``model`` (the entering float module, or the int8 phase's quantized one) for one phase."""
        cfg = self.config
        freeze = cfg.freeze_bn_after if phase.precision == "int8" else None
        ranges = quantizer_parameters(model)

        def on_epoch_start(epoch: int, m: nn.Module) -> None:
            if freeze is not None and epoch > freeze:
                for mod in m.modules():
                    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                        mod.eval()  # running statistics stop updating
                for p in ranges:
                    p.requires_grad_(False)

        spec = cfg.distill  # set exactly when run made a teacher
        distiller = None
        if spec is not None and teacher is not None:
            # feature KD names the user's modules: those of a Sequential under NNCF's root (qat/nncf_quant.py) too
            student = model.model if isinstance(model, SequentialRoot) else model
            distiller = Distiller(student, teacher, spec, state.task, state.example_input, self.loc("distill"))
        try:
            history = fit(model, state.data, state.task, settings, ctx, description=description,
                          extra_loss=distiller.loss if distiller else None,
                          extra_modules=distiller.modules() if distiller else (), on_epoch_start=on_epoch_start)
        finally:
            if distiller:
                distiller.close()
            for p in ranges:
                p.requires_grad_(True)
        return history[-1][f"eval_{state.task.headline_name}"]
