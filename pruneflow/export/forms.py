"""The INT8 form a runtime runs fastest on this host, chosen by measuring (issue 25, item 1).

One set of quantization parameters can be written several ways (``qdq.Encoding``: how the activations are
encoded; ``tensorrt``: TensorRT's placement), and which runs fastest depends on the runtime, its version and
the CPU: measured on an AVX-512 VNNI EPYC (ResNet-56, batch 32, one thread), onnxruntime ran u8s8 without its
Clips 7 % faster than with them and ran its own S8S8 QDQ at 0.77x of FP32, 3x slower than either; OpenVINO ran
an IR converted from the Clip-free form 7 % faster than one from the guarded form. Nobody's guidance holds on
every host, so ``form: auto`` builds the forms this CPU runs exactly, checks each against the quantized torch
model, times them interleaved, and keeps the fastest; the table that decided it goes into the artifact's
metrics (``form_candidates``), the manifest and the report.

Forms that can saturate on this CPU are never candidates: without VNNI (x86 before Cascade Lake / Zen 4),
u8s8 kernels add product pairs in int16, and only the guarded ``u8s8`` is exact. Nor on the CPUs the artifact will be
served on (``deploy_hosts.py``): the export stage pins ``form: u8s8`` unless every serving CPU named has VNNI, and
when none is named (built here, served anywhere), so ``auto`` times the forms only for a VNNI-only fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..deployment import X86_ARCHES
from ..errors import ExportError
from ..inputs import as_numpy, take, trim
from ..runtime import fresh_batch, host_info, time_interleaved
from ..recipe.cpus import VNNI_FLAGS as _VNNI
from .qdq.graph import CONVENTIONS, ENCODINGS

if TYPE_CHECKING:
    from ..tasks import Task

#: CPU flags with which the x86 int8 kernels multiply u8 by s8 straight into int32 (no int16 pair sums).
VNNI_FLAGS = _VNNI
#: Batch sizes and repetitions of the choice when the export stage times nothing (`latency: null`).
DEFAULT_BATCHES = (1, 32)
RUNS = 30
#: The portable form (``u8s8``, exact on every x86) is kept unless another is at least this much faster, and so on
#: down the candidates' order: a difference inside the noise of a shared machine is not worth an artifact that needs
#: VNNI, nor a choice that flips between two runs.
PORTABLE_MARGIN = 0.03
#: Samples of the eval split each candidate's outputs are compared on (against the quantized torch model).
PARITY_SAMPLES = 64


def exact_encodings(host: dict[str, Any] | None = None) -> tuple[list[str], str]:
    """The cpu-form encodings this host's int8 kernels compute exactly, the portable one first, and why."""
    cpu = (host or host_info())["cpu"]
    x86 = cpu.get("arch") in X86_ARCHES
    if x86 and not set(cpu.get("isa") or ()) & set(VNNI_FLAGS):
        return ["u8s8"], ("this x86 CPU has no VNNI: its u8s8 kernels add product pairs in int16, and only the guarded "
                          "u8s8 form is exact there")
    why = "VNNI/AMX multiply u8 by s8 into int32" if x86 else "no int16 pair sums on this CPU"
    return list(ENCODINGS), f"every encoding is exact here ({why})"


def needs_vnni(form: str) -> bool:
    """Whether an artifact of this form can saturate on an x86 CPU without VNNI (int8 activations too: the
    kernels there shift them to uint8 and add product pairs in int16 all the same)."""
    return form in ("u8s8_vnni", "s8s8", "fused", "fused_dynamic") or (form in CONVENTIONS and CONVENTIONS[form].symmetric_activations)


@dataclass
class Candidate:
    """One form of the same model, opened in the runtime that decides."""

    form: str
    path: Any
    run: Callable[[Any], Any]
    cosine: float = float("nan")
    passed: bool = False
    p50_ms: dict[int, float] = field(default_factory=dict)
    score: float = float("nan")
    #: another candidate's form whose agreement with the reference (the task's figure: top-1 for classification)
    #: this one must equal or beat to be kept (the same IR at another precision hint)
    at_least_as: str | None = None
    agreement: float = float("nan")


@dataclass
class Choice:
    form: str
    rows: list[dict[str, Any]]
    why: str

    def note(self, runtime: str) -> str:
        timed = ", ".join(f"{r['form']} {r['relative']:.2f}x" for r in self.rows if r["passed"])
        # FORM@HINT (an IR's candidates): the precision hint is part of what was chosen, and may be all of it when the
        # serving CPUs pinned the form (export_hosts' own note says so), so the note names both
        what = f"INT8 form and precision hint {self.form}" if "@" in self.form else f"INT8 form {self.form}"
        if not timed:
            return f"{what}: {self.why}"
        return f"{what}, chosen by measuring in {runtime} on this host ({timed} of the fastest's time): {self.why}"


def parity_samples(state) -> Any:
    """The first eval samples (trimmed to their longest text), as numpy: what each candidate is compared on."""
    return as_numpy(trim(take(state.data.eval.x, slice(0, PARITY_SAMPLES))))


def choose(candidates: list[Candidate], state, ref: np.ndarray, min_cosine: float, batches: list[int],
           runs: int = RUNS) -> Choice:
    """Check every candidate against ``ref`` (the quantized torch model's outputs on ``parity_samples``), time
    those that hold ``min_cosine`` interleaved per batch size, and pick the fastest (``_pick``)."""
    x = parity_samples(state)
    for c in candidates:
        got = np.asarray(c.run(x), dtype=np.float32)
        figures = state.task.agree(ref, got) if np.isfinite(got).all() else {}
        c.cosine = float(figures.get("cosine", float("nan")))
        c.agreement = float(figures.get(state.task.agreement.name, c.cosine))
        c.passed = bool(c.cosine >= min_cosine)
    by_form, figure = {c.form: c for c in candidates}, state.task.agreement
    for c in candidates:  # in the figure's own direction (top-1: higher; a probability or relative error: lower)
        if c.at_least_as is not None and c.at_least_as in by_form:
            c.passed = c.passed and figure.at_least_as_good(c.agreement, by_form[c.at_least_as].agreement)
    kept = [c for c in candidates if c.passed]
    if not kept and len({c.form.partition("@")[0] for c in candidates}) == 1:
        # one form at two hints (a form pinned for the serving CPUs): nothing to choose between; the IR is written at
        # f32 and its parity gate judges it with its figures, as for a form and hint the recipe pins
        only = next((c for c in candidates if "@" not in c.form), candidates[0])
        rows = [{"form": c.form, "passed": False, "cosine": round(c.cosine, 6), "relative": None, "chosen": c is only}
                for c in candidates]
        return Choice(only.form, rows, "the only form tried, and it holds parity at no hint here: its parity gate says so")
    if not kept:
        raise ExportError("no INT8 form holds parity with the quantized torch model on this host: "
                          + ", ".join(f"{c.form} cosine {c.cosine:.4f}" for c in candidates),
                          hint="pin one with the target's `form`, or look for a layer to `ignore` in the qat/ptq stage")
    for bs in batches:
        stats = time_interleaved({c.form: c.run for c in kept}, fresh_batch(state.data.eval.x, bs), warmup=3, runs=runs)
        for c in kept:
            c.p50_ms[bs] = stats[c.form].p50_ms
    return _pick(candidates, batches)


def _pick(candidates: list[Candidate], batches: list[int]) -> Choice:
    """The first candidate, in the order given (the portable form first), whose time is within ``PORTABLE_MARGIN``
    of the fastest's: the geometric mean over batch sizes of its time over the best time there. Taking the first
    within the margin, not the fastest, keeps the choice from flipping between runs on forms that differ by noise."""
    kept = [c for c in candidates if c.passed]
    for c in kept:
        c.score = math.exp(sum(math.log(c.p50_ms[bs] / min(k.p50_ms[bs] for k in kept)) for bs in batches) / len(batches))
    fastest = min(kept, key=lambda c: c.score)
    chosen = next(c for c in kept if c.score <= fastest.score * (1 + PORTABLE_MARGIN))
    if len(kept) == 1:
        why = "the only form that held parity"
    elif chosen is fastest:
        why = "the fastest"
    else:
        why = (f"within {PORTABLE_MARGIN:.0%} of the fastest ({fastest.form}), and it comes first in the order of "
               "preference (a form more CPUs run exactly, an IR that needs no precision hint)")
    rows = [{"form": c.form, "passed": c.passed, "cosine": round(c.cosine, 6),
             **{f"p50_ms_b{bs}": round(c.p50_ms[bs], 4) for bs in batches if bs in c.p50_ms},
             "relative": round(c.score, 4) if c.passed else None, "chosen": c is chosen} for c in candidates]
    return Choice(chosen.form, rows, why)


def decide(candidates: list[Candidate], state, latency: Any, *, static: bool = False, why: str = "",
           only: str | None = None) -> Choice:
    """``choose`` with the export stage's timing (``latency``: its batch sizes and runs; None: ``DEFAULT_BATCHES``)
    and the quantized torch model as the reference; ``only``: the one exact form here, chosen without timing."""
    from ..stages.measure import batched, default_limits, reference_outputs

    if only is not None:
        return Choice(only, [], why)
    batches = [1] if static else list(latency.batch_sizes if latency else DEFAULT_BATCHES)
    runs = min(latency.runs, RUNS) if latency else RUNS
    for c in candidates:
        c.run = batched(c.run, static)
    ref = reference_outputs(state.model, trim(take(state.data.eval.x, slice(0, PARITY_SAMPLES))), state.task)
    return choose(candidates, state, ref, default_limits("int8", None, state.task).min_cosine, batches, runs)


def record_choice(artifact, choice: Choice, target, runtime: str) -> None:
    """The choice on the artifact (``int8_form``, a note) and its table on the target (the report's "int8 forms")."""
    form = choice.form.partition("@")[0]  # FORM@default: the openvino target's IR at OpenVINO's default precision
    artifact.metrics["int8_form"] = form
    artifact.notes.append(choice.note(runtime) if choice.rows else f"INT8 form {choice.form}: {choice.why}")
    if needs_vnni(form):
        artifact.notes.append(f"the {form} form needs an x86 CPU with VNNI or AMX (or a non-x86 one): without them "
                              "its int8 kernels can saturate; pin `form: u8s8` to build for such a host")
    target.tables.setdefault("int8 forms", []).extend({"artifact": artifact.label, "runtime": runtime, **row} for row in choice.rows)
