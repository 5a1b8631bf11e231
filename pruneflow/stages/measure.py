"""What the export stage measures on each artifact, through the runtime layer (``pruneflow.runtime``).

Checks (parity against torch, the task's metrics) run per artifact right after it is built; latency runs once
every artifact of the stage exists, all of them interleaved per batch size, so load on a shared machine
hits them alike and the ratios between them hold.

An OpenVINO artifact runs twice: with the plugin's default inference precision (what a user gets: bf16
on CPUs with AVX-512 BF16 or AMX) and with f32 forced (the file's own arithmetic). Metrics of the default
carry the plain names (the task's metrics, ``latency_b1_median_ms``), those of forced f32 the suffix ``_f32``;
where the default already is f32 only the plain ones exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple

import numpy as np
import torch

from ..formats import runs_elsewhere, runtime_named
from ..gates import GateResult
from ..inputs import Inputs, call, to
from ..tasks import Classification, Metric, Task
from ..runtime import Executor, LatencyStats, RuntimeUnavailable, fresh_batch, open_artifact, runtimes_for, time_interleaved

if TYPE_CHECKING:
    from pathlib import Path

    from ..artifacts import Artifact
    from ..stage import Target

#: Suffix of the metrics measured with OpenVINO's f32 forced, when the plugin's default is not f32.
F32 = "_f32"


class ParityLimits(NamedTuple):
    """One precision's parity limits: on the largest difference (None: no limit), the cosine, and the task's
    agreement figure (``Task.agreement``: a minimum where higher is better, a maximum where lower is; None: none)."""

    max_abs_diff: float | None
    min_cosine: float
    agreement: float | None = None
    metric: Metric = Metric("cosine", perfect=1.0)

    def looser(self, other: "ParityLimits") -> "ParityLimits":
        """Each limit the looser of the two (an artifact computed in a lower precision than it stores)."""
        diff = None if self.max_abs_diff is None or other.max_abs_diff is None else max(self.max_abs_diff, other.max_abs_diff)
        agree = None if self.agreement is None or other.agreement is None else self.metric.looser(self.agreement, other.agreement)
        return self._replace(max_abs_diff=diff, min_cosine=min(self.min_cosine, other.min_cosine), agreement=agree)

    def compounded(self, other: "ParityLimits") -> "ParityLimits":
        """The limits of two approximations applied together (an INT8 model whose float parts a runtime
        computes in bf16): their budgets add (cosine and agreement shortfalls, largest differences)."""
        diff = None if self.max_abs_diff is None or other.max_abs_diff is None else self.max_abs_diff + other.max_abs_diff
        agree = None if self.agreement is None or other.agreement is None else self.metric.compounded(self.agreement, other.agreement)
        return self._replace(max_abs_diff=diff, min_cosine=round(self.min_cosine + other.min_cosine - 1, 10), agreement=agree)


# Per-precision limits on the largest difference and the cosine; the task adds its agreement figure's
# (``Task.agreement_limits``, same keys); a recipe value overrides them for every precision.
PARITY_DEFAULTS = {
    "fp32": ParityLimits(max_abs_diff=1e-3, min_cosine=0.9999),
    "fp16": ParityLimits(max_abs_diff=5e-2, min_cosine=0.999),
    # INT8 runtimes round at different points than torch's fake quantization (integer accumulation,
    # requantization), and a flipped level early in a deep net moves outputs: no max-diff limit by default.
    "int8": ParityLimits(max_abs_diff=None, min_cosine=0.99),
    # What a runtime computing in bf16 (OpenVINO's CPU default with AVX-512 BF16/AMX) can hold to: 8 bits of
    # mantissa against fp16's 11, so no max-diff limit (logits of 10-20 move by ~0.1), fp16's cosine.
    "bf16": ParityLimits(max_abs_diff=None, min_cosine=0.999),
}

#: OpenVINO's inference precision names → the PARITY_DEFAULTS entry its arithmetic is held to.
COMPUTED_IN = {"bf16": "bf16", "f16": "fp16"}


def default_limits(precision: str, computed_in: str | None = None, task: Task | None = None) -> ParityLimits:
    """The default limits of an artifact of ``precision`` run with inference precision ``computed_in``
    (OpenVINO's ``bf16``/``f16``/``f32``; None: the runtime computes in the artifact's own precision), for
    ``task``'s outputs (default: classification)."""
    task = task or Classification()

    def of(name: str) -> ParityLimits:
        return PARITY_DEFAULTS.get(name, PARITY_DEFAULTS["fp32"])._replace(
            agreement=task.agreement_limits.get(name, task.agreement_limits.get("fp32")), metric=task.agreement)

    limits = of(precision)
    lower = COMPUTED_IN.get(computed_in or "")
    if not lower:
        return limits
    # An fp32/fp16 artifact computed in bf16 has bf16's error alone; an INT8 one has both its own and bf16's in
    # its float parts (LayerNorm, Softmax, GELU of a transformer): MiniLM-L6 QAT on SST-2 moved 5 % of near-tie
    # predictions in OpenVINO's bf16 default (1.9 % with f32 forced), its FP32 IR none.
    return limits.compounded(of(lower)) if precision == "int8" else limits.looser(of(lower))


@dataclass
class Opened:
    """A built artifact and its executors: ``""`` the runtime's default, ``"_f32"`` OpenVINO with f32 forced."""

    artifact: "Artifact"
    executors: dict[str, Executor] = field(default_factory=dict)
    #: Static batch 1 (``dynamic_batch: false``): checked one sample at a time, timed at batch 1 only.
    static: bool = False


def open_for(artifact: "Artifact", target: "Target", path: "Path", threads: int | None) -> dict[str, Executor]:
    """The artifact's executors (see ``Opened``); {} with a note on the artifact when no runtime here runs it."""
    try:
        if not runtimes_for(path):  # a plugin target's own file type: its runner, if it has one
            run = target.runner(path, threads)
            if run is None:
                raise RuntimeUnavailable(f"no runtime here runs {path.suffix or path.name} files")
            return {"": Executor(path, artifact.target or "plugin", "default", run)}
        # TensorRT's form is checked in onnxruntime for its arithmetic: onnxruntime's u8s8 pair sums (x86
        # without VNNI) would saturate on its int8 activations, which TensorRT does not do
        default = open_artifact(path, threads=threads, exact_int8=runs_elsewhere(artifact))
        executors = {"": default}
        if runtime_named(default.runtime).takes_precision_hint and default.info.get("inference_precision") != "f32":
            executors[F32] = open_artifact(path, threads=threads, precision_hint="f32")
        return executors
    except RuntimeUnavailable as exc:
        note = f"not measured here: {exc.message}"
        if note not in artifact.notes:
            artifact.notes.append(note)
        return {}


def batched(run: Callable[[Any], np.ndarray], static: bool) -> Callable[[Any], np.ndarray]:
    """A static-batch artifact (batch 1) runs one sample at a time (an array, or a feed of several)."""
    if not static:
        return run

    def one_by_one(x: Any) -> np.ndarray:
        if isinstance(x, dict):
            rows = len(next(iter(x.values())))
            return np.concatenate([np.asarray(run({k: v[i : i + 1] for k, v in x.items()})) for i in range(rows)])
        return np.concatenate([np.asarray(run(x[i : i + 1])) for i in range(len(x))])

    return one_by_one


def reference_outputs(model: torch.nn.Module, x: "Inputs", task: Task) -> np.ndarray:
    """What the task reads of ``model``'s output on ``x`` (``Task.output``), as float32 numpy."""
    device = next(model.parameters()).device
    with torch.no_grad():
        model.eval()
        return task.output(call(model, to(x, device))).float().cpu().numpy()


def parity_metrics(ref: np.ndarray, got: np.ndarray, task: Task | None = None) -> dict[str, float]:
    """Max abs diff, cosine similarity and the task's agreement figure (``Task.agree``; default: classification's
    top-1 agreement) of two output arrays."""
    return (task or Classification()).agree(ref, got)


def parity_gate(artifact: "Artifact", suffix: str, executor: Executor, parity: dict[str, float], finite: bool,
                limits: ParityLimits) -> GateResult:
    """``LABEL.parity`` (as the runtime runs it by default) or ``LABEL.parity_f32`` (OpenVINO, f32 forced):
    the message names the artifact, how it ran and every figure against its limit."""
    problems = [] if finite else ["the artifact's outputs hold NaN or inf"]
    if limits.max_abs_diff is not None and parity["max_abs_diff"] > limits.max_abs_diff:
        problems.append(f"max abs diff {parity['max_abs_diff']:.3g} > {limits.max_abs_diff:.10g}")
    if parity["cosine"] < limits.min_cosine:
        problems.append(f"cosine {parity['cosine']:.6f} < min_cosine {limits.min_cosine:.10g}")
    metric = limits.metric
    shown = metric.shown
    if limits.agreement is not None and metric.name != "cosine" and not metric.at_least_as_good(parity[metric.name], limits.agreement):
        problems.append(f"{shown} {parity[metric.name]:.4f} {'<' if metric.higher_is_better else '>'} "
                        f"{metric.bound_word()} {limits.agreement:.10g}")
    ran = executor.label
    agreed = f", {shown} {parity[metric.name]:.4f}" if metric.name in parity and metric.name != "cosine" else ""
    detail = "; ".join(problems) if problems else (
        f"max abs diff {parity['max_abs_diff']:.2e}, cosine {parity['cosine']:.6f}{agreed}")
    gate = GateResult(f"{artifact.label}.parity{suffix}", not problems, f"{artifact.path} in {ran}: {detail}", parity["cosine"])
    if problems:
        artifact.notes.append(f"parity check failed ({ran}): " + "; ".join(problems))
    return gate


def runtime_advice(artifact: "Artifact", task: Task) -> str | None:
    """A note for an artifact whose deployment record says how to compile it (an OpenVINO INT8 IR: f32),
    with what was measured both ways here; None when it was not checked both ways."""
    m, hint = artifact.metrics, ((artifact.deployment or {}).get("runtime") or {}).get("openvino")
    agreement, headline = task.agreement.name, task.headline_name
    if not hint or f"{agreement}{F32}" not in m:
        return None
    agree = task.agreement.format
    ways = [f"{task.agreement.shown} with the quantized torch model {agree(m[f'{agreement}{F32}'])} vs {agree(m[agreement])}"]
    if m.get(f"{headline}{F32}") is not None and m.get(headline) is not None:
        fmt = task.headline.format
        ways.append(f"{headline} {fmt(m[f'{headline}{F32}'])} vs {fmt(m[headline])}")
    settings = ", ".join(f"{k}={v}" for k, v in hint.items())
    return (f"deploy with {settings} (its deployment record's runtime): here {'; '.join(ways)} "
            f"with the runtime's default ({m.get('inference_precision', 'default')})")


def time_all(opened: list[Opened], samples: "Inputs", batch_sizes: list[int], *, warmup: int, runs: int,
             progress: Callable[[str, int], ContextManager[Callable[..., None]]]) -> None:
    """Time every executor of every artifact together, interleaved, per batch size, on fresh real batches;
    write ``latency_b{bs}_{median,p90,p99}_ms``, ``throughput_b{bs}`` (samples/s) and, against the fp32
    artifact of the same target, ``speedup_b{bs}`` into each artifact's metrics (``_f32`` suffixed likewise).

    ``progress(description, total)`` is a reporter's progress context (yields ``advance``)."""
    for bs in batch_sizes:
        executors = {f"{i}{suffix}": ex for i, o in enumerate(opened) if bs == 1 or not o.static
                     for suffix, ex in o.executors.items()}
        if not executors:
            continue
        batch = fresh_batch(samples, bs)
        with progress(f"timing {len(executors)} runtimes interleaved, batch {bs}", runs) as advance:
            stats = time_interleaved(executors, batch, warmup=warmup, runs=runs, on_step=advance)
        # text: the tokens a row of the timed batch (real rows, cut to their longest), stated beside its latency
        widths = [v.shape[1] for v in batch.values() if v.ndim == 2 and v.dtype.kind == "i"] if isinstance(batch, dict) else []
        for key, s in stats.items():
            index, _, suffix = key.partition("_")
            _record(opened[int(index)].artifact, bs, f"_{suffix}" if suffix else "", s)
            if widths:
                opened[int(index)].artifact.metrics[f"latency_b{bs}_sequence"] = int(widths[0])
    _speedups(opened, batch_sizes)


def _record(artifact: "Artifact", bs: int, suffix: str, s: LatencyStats) -> None:
    m = artifact.metrics
    m[f"latency_b{bs}_median_ms{suffix}"] = s.p50_ms
    m[f"latency_b{bs}_p90_ms{suffix}"] = s.p90_ms
    m[f"latency_b{bs}_p99_ms{suffix}"] = s.p99_ms
    m[f"throughput_b{bs}{suffix}"] = s.throughput
    m["latency_runs"] = s.runs


def _speedups(opened: list[Opened], batch_sizes: list[int]) -> None:
    baselines = {o.artifact.target: o.artifact for o in opened if o.artifact.precision == "fp32" and not o.artifact.form}
    for o in opened:
        base = baselines.get(o.artifact.target)
        if base is None or base is o.artifact:
            continue
        for bs in batch_sizes:
            for suffix in o.executors:
                key = f"latency_b{bs}_median_ms{suffix}"
                mine, theirs = o.artifact.metrics.get(key), base.metrics.get(key)
                if mine and theirs:
                    o.artifact.metrics[f"speedup_b{bs}{suffix}"] = theirs / mine
                    _flag_slower(o, base, bs, suffix, theirs / mine)


#: A quantized artifact this much slower than its target's FP32 one, in the same interleaved loop, is flagged
#: (the INT8 forms' choice keeps a form within 3 % of the fastest as equal).
SLOWER_THAN_FP32 = 0.97


def _flag_slower(o: Opened, base: "Artifact", bs: int, suffix: str, speedup: float) -> None:
    """A note (report.md's Notes, ``--json``) and ``slower_than_fp32_b{bs}`` where a quantized artifact runs slower than
    the FP32 artifact of its target at a batch the recipe serves: smaller, but not faster there (issue 37 met an INT8
    ranker 1.57x slower at batch 1 in onnxruntime, unflagged)."""
    artifact = o.artifact
    if artifact.precision in ("fp32", None) or speedup >= SLOWER_THAN_FP32:
        return
    artifact.metrics[f"slower_than_fp32_b{bs}{suffix}"] = 1
    how = f" at the {suffix.lstrip('_')} hint" if suffix else ""
    artifact.notes.append(f"{artifact.precision.upper()} slower than FP32: {1 / speedup:.2f}x slower than {base.path} at batch "
                          f"{bs}{how} on this host, timed interleaved: at this batch the FP32 artifact serves faster")
