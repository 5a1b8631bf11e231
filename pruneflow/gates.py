"""Quality gates: checks on measured metrics that decide exit code 1."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from .artifacts import Artifact, Precision
from .config import StrictModel
from .formats import runs_elsewhere
from .recipe.models import GateSpec
from .stage import GateResult as GateResult  # a kernel record (StageResult carries it); found here as always

if TYPE_CHECKING:
    from .tasks import Task


def check_gates(specs: list[GateSpec], metrics: dict[str, float], task: "Task") -> list[GateResult]:
    """Evaluate recipe gates against the flat metric namespace (``evaluate.accuracy``, ``onnx.fp32.mse``). A
    ``max_drop`` is how much worse the metric is than its baseline in the metric's own direction (``task.metric``):
    ``baseline - metric`` where higher is better, ``metric - baseline`` where lower is (a loss, an error)."""
    results = []
    for spec in specs:
        value = metrics.get(spec.metric)
        name = spec.metric
        if not isinstance(value, (int, float)):
            known = ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))[:30])
            results.append(GateResult(name, False, f"metric {spec.metric!r} was not produced by this run; produced: {known}"))
            continue
        if not math.isfinite(value):
            results.append(GateResult(name, False, f"{value} is not a finite number", float(value)))
            continue
        problems = []
        if spec.min is not None and value < spec.min:
            problems.append(f"{value:.6g} < min {spec.min:g}")
        if spec.max is not None and value > spec.max:
            problems.append(f"{value:.6g} > max {spec.max:g}")
        if spec.baseline is not None:
            problems += _drop_problems(spec, value, metrics.get(spec.baseline), task)
        bounds = " ".join(
            s for s in (
                f">= {spec.min:g}" if spec.min is not None else "",
                f"<= {spec.max:g}" if spec.max is not None else "",
                f"worse than {spec.baseline} by <= {spec.max_drop:g}, {task.metric(spec.metric).direction}"
                if spec.max_drop is not None else "",
                f"worse than {spec.baseline} by <= {spec.max_drop_relative:.2%}, {task.metric(spec.metric).direction}"
                if spec.max_drop_relative is not None else "",
            ) if s
        )
        base = metrics.get(spec.baseline) if spec.baseline else None
        if not problems and isinstance(base, (int, float)):  # what was measured, beside what was allowed
            worse = task.metric(spec.metric).worsening(base, value)
            share = f" ({abs(worse) / abs(base):.2%})" if base else ""
            bounds += f"; measured: {'worse' if worse > 0 else 'better'} by {abs(worse):.4g}{share} than {base:.6g}"
        message = "; ".join(problems) if problems else f"{value:.6g} ({bounds})"
        results.append(GateResult(name, not problems, message, float(value)))
    return results


def _drop_problems(spec: GateSpec, value: float, base, task: "Task") -> list[str]:
    """What a gate's ``max_drop`` / ``max_drop_relative`` find wrong with ``value`` against its baseline ``base``."""
    if not isinstance(base, (int, float)):
        return [f"baseline {spec.baseline!r} was not produced by this run"]
    metric = task.metric(spec.metric)
    worse = metric.worsening(base, value)
    problems = []
    if spec.max_drop is not None and worse > spec.max_drop:
        problems.append(f"worse by {worse:.6g} than {spec.baseline} ({base:.6g}; {metric.direction}) > max_drop {spec.max_drop:g}")
    if spec.max_drop_relative is not None and worse > spec.max_drop_relative * abs(base):
        share = worse / abs(base) if base else math.inf
        problems.append(f"worse by {share:.2%} than {spec.baseline} ({base:.6g}; {metric.direction}) "
                        f"> max_drop_relative {spec.max_drop_relative:.2%}")
    return problems


class ArtifactGates(StrictModel):
    """An export stage's `gates:`: checks on each artifact it builds (speed against fp32, size on disk)."""

    min_speedup: float | None = Field(
        default=None, gt=0,
        description="Fail when an artifact's median latency is not at least this many times lower than that of the fp32 artifact "
        "of its target at the same batch size, both timed in the same interleaved loop (OpenVINO: each with the plugin's default "
        "inference precision, as a user runs it). Needs `fp32` in `precisions` and `latency`. Checked on every timed artifact but "
        "the fp32 ones, and not on forms written for another runtime (the TensorRT-form ONNX, which onnxruntime runs slowly).",
    )
    batch_sizes: list[int] | None = Field(default=None, min_length=1, description="Batch sizes `min_speedup` is checked at (default: every timed one).")
    max_size_mb: float | None = Field(default=None, gt=0, description="Fail when an artifact's size on disk (all its files; MB = 10^6 bytes) exceeds this.")
    precisions: list[Precision] | None = Field(
        default=None, min_length=1, description="Check only the artifacts of these precisions (default: all).")
    targets: list[str] | None = Field(default=None, min_length=1, description="Check only the artifacts of these targets (default: all).")

    def applies(self, artifact: Artifact) -> bool:
        """True when the gates look at ``artifact`` (by its precision and target)."""
        return ((self.precisions is None or artifact.precision in self.precisions)
                and (self.targets is None or artifact.target in self.targets))


def artifact_gates(spec: ArtifactGates, artifacts: list[Artifact], timed: list[int]) -> list[GateResult]:
    """``LABEL.min_speedup`` and ``LABEL.max_size_mb`` for each artifact ``spec`` applies to; a failed one is
    also written into the artifact's notes (``gate failed: ...``), so the manifest marks the file it kept.
    ``timed``: the batch sizes the stage timed."""
    checked: list[tuple[Artifact, GateResult]] = []
    for artifact in (a for a in artifacts if spec.applies(a)):
        if spec.max_size_mb is not None:
            size = artifact.metrics.get("size_mb", (artifact.size_bytes or 0) / 1e6)
            ok = size <= spec.max_size_mb
            checked.append((artifact, GateResult(f"{artifact.label}.max_size_mb", ok, f"{artifact.path} (all its files): "
                                                 f"{size:.4g} MB {'<=' if ok else '>'} max_size_mb {spec.max_size_mb:g}", size)))
        if spec.min_speedup is not None and artifact.precision != "fp32" and not runs_elsewhere(artifact):
            checked.append((artifact, _speedup_gate(spec.min_speedup, artifact, spec.batch_sizes or timed)))
    for artifact, gate in checked:
        if not gate.passed:
            artifact.notes.append(f"gate failed: {gate.name}: {gate.message}")
    return [gate for _, gate in checked]


def _speedup_gate(minimum: float, artifact: Artifact, batch_sizes: list[int]) -> GateResult:
    m = artifact.metrics
    found = {bs: m[f"speedup_b{bs}"] for bs in batch_sizes if f"speedup_b{bs}" in m}
    name = f"{artifact.label}.min_speedup"
    if not found:
        timed = any(f"latency_b{bs}_median_ms" in m for bs in batch_sizes)
        why = f"no fp32 {artifact.target} artifact was timed beside it" if timed else "it was not timed"
        return GateResult(name, False, f"{artifact.path}: no speed-up at batch {', '.join(map(str, batch_sizes))}: {why}")
    parts = [f"{v:.3g}x at batch {bs} ({m[f'latency_b{bs}_median_ms']:.3g} ms)" for bs, v in found.items()]
    slow = {bs: v for bs, v in found.items() if v < minimum}
    verdict = f"< min_speedup {minimum:g}" if slow else f">= min_speedup {minimum:g}"
    worst = min(found.values())
    return GateResult(name, not slow, f"{artifact.path} vs {artifact.target}.fp32: {', '.join(parts)} {verdict}", worst)


def reads_headline(spec: GateSpec, task: "Task") -> bool:
    """Whether a gate checks the task's headline metric: its value anywhere (``onnx.int8.accuracy``,
    ``evaluate.accuracy``) or how far it fell (``qat.accuracy_drop``)."""
    name = spec.metric.removesuffix("_drop")
    return task.metric(name).name == task.headline.name


def headline_gate(specs: list[GateSpec], task: "Task", metric: str | None = None,
                  baseline: str | None = None) -> dict[str, object]:
    """``{"gated": True}`` when a gate reads the headline metric; else ``{"gated": False, "message", "suggestion"}``:
    PASSED would say nothing about the model's quality, and a gate line to add (on ``metric``, the run's result,
    against ``baseline``, the model it started from, when there is one).

    A share (accuracy, AUC: perfect at 1) gets ``max_drop: 0.01``; an error (MSE) ``max_drop_relative: 0.05``."""
    if any(reads_headline(spec, task) for spec in specs):
        return {"gated": True}
    headline = task.headline
    target = metric or f"evaluate.{headline.name}"
    if baseline and baseline != target:
        bound = "max_drop: 0.01" if headline.perfect == 1.0 else "max_drop_relative: 0.05"
        line = f"- {{metric: {target}, baseline: {baseline}, {bound}}}"
    else:
        line = f"- {{metric: {target}, {headline.bound_word()}: VALUE}}"
    return {"gated": False, "suggestion": line,
            "message": f"no gate reads {headline.name}, the task's headline metric: the verdict says nothing about the "
                       f"model's {headline.shown} ({headline.direction}). Add under `gates:` in the recipe: {line}"}
