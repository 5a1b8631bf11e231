"""`export`: write the model for each target and precision, then measure every artifact.

Each artifact is checked in its own runtime: parity against the torch model it came from (max abs
diff, cosine similarity, top-1 agreement), accuracy on the eval split, and latency.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from pydantic import Field, create_model, field_validator

from .. import registry
from ..artifacts import Artifact
from ..bench import fresh_batch, measure_latency
from ..errors import ConfigError, ExportError, PruneflowError
from ..evaluate import evaluate_runtime
from ..gates import GateResult
from ..recipe.models import list_of, normalise_target_list, target_union
from ..recipe.rules import quantized_before
from ..stage import Stage, StageConfig, StageResult, StrictModel, Target


class ParityLimits(NamedTuple):
    """One precision's parity limits (``max_abs_diff`` None: no limit on the largest difference)."""

    max_abs_diff: float | None
    min_cosine: float
    min_top1_agreement: float


# Per-precision parity limits; a recipe value overrides them for every precision.
PARITY_DEFAULTS = {
    "fp32": ParityLimits(max_abs_diff=1e-3, min_cosine=0.9999, min_top1_agreement=0.99),
    "fp16": ParityLimits(max_abs_diff=5e-2, min_cosine=0.999, min_top1_agreement=0.98),
    # INT8 runtimes round at different points than torch's fake quantization (integer accumulation,
    # requantization), and a flipped level early in a deep net moves logits: no max-diff limit by default.
    "int8": ParityLimits(max_abs_diff=None, min_cosine=0.99, min_top1_agreement=0.95),
}


class ParitySpec(StrictModel):
    samples: int = Field(default=256, ge=1, description="Eval samples compared between torch and the artifact.")
    max_abs_diff: float | None = Field(default=None, gt=0, description="Largest allowed absolute difference of any output (default: 1e-3 for fp32, 0.05 for fp16, none for int8).")
    min_cosine: float | None = Field(default=None, ge=0, le=1, description="Smallest allowed mean cosine similarity of outputs (default: 0.9999 fp32, 0.999 fp16, 0.99 int8).")
    min_top1_agreement: float | None = Field(default=None, ge=0, le=1, description="Smallest allowed share of equal top-1 predictions (default: 0.99 fp32, 0.98 fp16, 0.95 int8).")

    def limits(self, precision: str) -> ParityLimits:
        """Limits for an artifact's precision."""
        default = PARITY_DEFAULTS.get(precision, PARITY_DEFAULTS["fp32"])
        return default._replace(**self.model_dump(include=set(ParityLimits._fields), exclude_none=True))


class LatencySpec(StrictModel):
    batch_sizes: list[int] = Field(default=[1, 32], min_length=1, description="Batch sizes to time.")
    runs: int = Field(default=20, ge=1, le=10_000, description="Timed runs per batch size (after warm-up).")
    warmup: int = Field(default=3, ge=0, description="Untimed runs first.")
    threads: int | None = Field(default=1, ge=1, description="Runtime threads while timing (1 gives stable numbers).")


class ExportConfig(StageConfig):
    type: Literal["export"] = Field(default="export", description="Export the model to deployable formats.")
    targets: list[Any] = Field(
        description="Targets to build: names (`onnx`) or mappings with options (`{type: onnx, opset: 17}`).", min_length=1
    )
    precisions: list[Literal["fp32", "fp16", "int8"]] = Field(
        default=["fp32"], min_length=1,
        description="Numeric precisions to write. `int8` needs a `ptq` stage, or a `qat` stage ending in int8, before export; "
        "its artifacts hold that stage's quantization parameters and are compared with the quantized torch model.",
    )
    evaluate: bool = Field(default=True, description="Measure each artifact's accuracy on the eval split in its own runtime.")
    parity: ParitySpec = Field(default_factory=ParitySpec, description="Torch-vs-artifact parity check and its limits.")
    latency: LatencySpec | None = Field(default_factory=LatencySpec, description="Latency timing (null = skip).")

    @field_validator("targets", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return normalise_target_list(value)

    @field_validator("targets", mode="after")
    @classmethod
    def _unique(cls, value: list) -> list:
        names = [getattr(t, "type", t.get("type") if isinstance(t, dict) else t) for t in value]
        twice = sorted({n for n in names if names.count(n) > 1}, key=str)  # a mapping without `type` gives None
        if twice:
            raise ValueError(f"target {', '.join(map(repr, twice))} is listed twice")
        return value

    @field_validator("precisions", mode="after")
    @classmethod
    def _unique_precisions(cls, value: list) -> list:
        if len(set(value)) != len(value):
            raise ValueError("a precision is listed twice")
        return value


class ExportStage(Stage[ExportConfig]):
    Config = ExportConfig

    @classmethod
    def config_model(cls) -> type[ExportConfig]:
        """The config with `targets` typed as the union of every registered target's config."""
        return create_model(
            "ExportConfig",
            __base__=ExportConfig,
            targets=(list_of(target_union()), Field(min_length=1, description=ExportConfig.model_fields["targets"].description)),
        )

    def _targets(self) -> list[tuple[str, Target]]:
        made = [(t.type, registry.targets.get(t.type)(t)) for t in self.config.targets]
        order = {n: i for i, (n, _) in enumerate(made)}
        # Targets that consume another target's artifact (e.g. OpenVINO from ONNX) come after it.
        made.sort(key=lambda nt: any(dep in order for dep in nt[1].depends_on))
        return made

    @classmethod
    def recipe_rules(cls, config, index, recipe):
        """Each target writes each precision asked for (``Target.precisions``), and int8 has a quantized
        model to write: a `ptq` stage, or a `qat` stage ending in int8, before this export."""
        for target in config.targets:
            writes = registry.targets.get(target.type).precisions
            for i, precision in enumerate(config.precisions):
                if precision not in writes:
                    yield ConfigError(("stages", index, "precisions", i), f"target {target.type!r} cannot write {precision}",
                                      value=precision, hint=f"{target.type} writes {', '.join(writes)}")
        if "int8" in config.precisions and not quantized_before(recipe, index):
            yield ConfigError(
                ("stages", index, "precisions", config.precisions.index("int8")),
                "int8 needs a quantized model, and no stage before this export quantizes it", value="int8",
                hint="add a `ptq` stage (no training) or a `qat` stage whose schedule ends in an int8 phase before `export`",
            )

    def preflight(self, ctx) -> list[str]:
        """Each target's toolchain (what it writes was checked with the recipe, see ``recipe_rules``)."""
        notes = []
        for _, target in self._targets():
            notes += target.preflight()
        return notes

    def run(self, state, ctx):
        cfg = self.config
        result = StageResult()
        for name, target in self._targets():
            # export/<target>/ for the usual single export stage; a second one gets export/<its id>/<target>/.
            out_dir = ctx.run_dir / "export" / (name if self.id == "export" else f"{self.id}/{name}")
            out_dir.mkdir(parents=True, exist_ok=True)
            for precision in cfg.precisions:
                ctx.reporter.info(f"{self.id}: building {name} {precision}")
                target.upstream = list(result.artifacts)
                try:
                    built = target.build(state, ctx, out_dir, precision)
                except PruneflowError:
                    raise
                except Exception as exc:  # noqa: BLE001 - reported as an export failure with the target named
                    raise ExportError(f"{name} {precision} export failed: {type(exc).__name__}: {exc}") from exc
                for artifact in built if isinstance(built, list) else [built]:
                    if artifact.parent is None:  # a target converting another's artifact names that one
                        artifact.parent = state.model_artifact.path if state.model_artifact else f"source:{state.model_key}"
                    run = target.runner(ctx.run_dir / artifact.path) if artifact.status == "built" else None
                    if run is not None:
                        result.gates += self._measure(artifact, _batched(run, target), target, state, ctx)
                    result.artifacts.append(artifact)
        return result

    def _measure(self, artifact: Artifact, run, target: Target, state, ctx) -> list[GateResult]:
        cfg = self.config
        label = artifact.label
        x = state.data.eval.x[: cfg.parity.samples]
        # fp32/fp16 artifacts come from the float view of the model, int8 ones from the quantized model itself.
        source = state.model if (artifact.precision or "").startswith("int8") else state.handle.float_module()
        device = next(source.parameters()).device
        with torch.no_grad():
            source.eval()
            ref = state.task.logits(source(x.to(device))).float().cpu().numpy()
        got = np.asarray(run(x.numpy()), dtype=np.float32)
        parity = parity_metrics(ref, got)
        artifact.metrics.update(parity)
        p = cfg.parity.limits(artifact.precision or "fp32")
        problems = [] if np.isfinite(got).all() else ["the artifact's outputs hold NaN or inf"]
        if p.max_abs_diff is not None and parity["max_abs_diff"] > p.max_abs_diff:
            problems.append(f"max abs diff {parity['max_abs_diff']:.3g} > {p.max_abs_diff:g}")
        if parity["cosine"] < p.min_cosine:
            problems.append(f"cosine {parity['cosine']:.6f} < {p.min_cosine:g}")
        if parity["top1_agreement"] < p.min_top1_agreement:
            problems.append(f"top-1 agreement {parity['top1_agreement']:.4f} < {p.min_top1_agreement:g}")
        gate = GateResult(
            f"{label}.parity",
            not problems,
            "; ".join(problems) if problems else
            f"max abs diff {parity['max_abs_diff']:.2e}, cosine {parity['cosine']:.6f}, top-1 agreement {parity['top1_agreement']:.4f}",
        )
        if problems:
            artifact.notes.append("parity check failed: " + "; ".join(problems))
        if cfg.evaluate:
            measured = evaluate_runtime(run, state.data.eval, state.task, ctx.recipe.data.eval_batch_size,
                                        ctx.reporter, description=f"{label} eval")
            artifact.metrics["accuracy"] = measured["accuracy"]
        if cfg.latency:
            timed = target.runner(ctx.run_dir / artifact.path, threads=cfg.latency.threads) or run
            static = not getattr(target.config, "dynamic_batch", True)
            if static and any(bs != 1 for bs in cfg.latency.batch_sizes):
                artifact.notes.append("static batch 1: latency timed at batch 1 only")
            for bs in [1] if static else cfg.latency.batch_sizes:
                example = fresh_batch(state.data.eval.x, bs).numpy()
                lat = measure_latency(timed, example, cfg.latency.warmup, cfg.latency.runs)
                for key in ("median_ms", "p99_ms", "max_ms"):
                    if key in lat:
                        artifact.metrics[f"latency_b{bs}_{key}"] = lat[key]
            artifact.metrics["latency_threads"] = cfg.latency.threads or 0
        return [gate]


def _batched(run, target: Target):
    """A static-batch artifact (dynamic_batch: false, batch 1) runs one sample at a time."""
    if getattr(target.config, "dynamic_batch", True):
        return run
    return lambda x: np.concatenate([np.asarray(run(x[i : i + 1])) for i in range(len(x))])


def parity_metrics(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Max abs diff, mean per-sample cosine similarity and top-1 agreement of two logit arrays."""
    if ref.shape != got.shape:
        raise ExportError(f"the artifact's output shape {got.shape} differs from torch's {ref.shape}")
    a = ref.reshape(len(ref), -1).astype(np.float64)
    b = got.reshape(len(got), -1).astype(np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return {
        "max_abs_diff": float(np.abs(a - b).max()),
        "cosine": float(cos.mean()),
        "top1_agreement": float((a.argmax(1) == b.argmax(1)).mean()),
        "parity_samples": int(len(a)),
    }
