"""Which artifact a target delivers: of the precisions it wrote, the fastest that holds the gates, never slower than
the runtime's own float.

The runtime's own float path is the baseline to beat: on a CPU with bf16 arithmetic OpenVINO runs an FP32 IR in
bf16 for free, and an INT8 artifact is not always faster (ResNet-56 on an AMX Xeon: INT8 0.79x of the bf16 default;
a multi-task ranker's INT8 ONNX 1.57x slower than FP32 at batch 1). So the choice is measured, on this host, from
what the stage already did: every gate named for the artifact (parity in each runtime lane, size, speed-up) and its
latency as deployed (its record's precision hint, else the runtime's default) at each batch size the recipe serves
(``choice.batch_sizes``, default: every timed one).

The rule (``decide``): the best float artifact (fp32, bf16, fp16; by geometric mean over the served batches) is the
baseline; an INT8 artifact is delivered only when it holds the gates and is at least ``choice.margin`` (2 %) faster
than that float at *every* served batch, else the float is. The winner is the target's result (``precision_chosen``
1 on it, 0 on the others); the others stay in the run folder, and a gate they failed is moved into their notes, since
the artifact the run delivers holds every gate. When none holds them, nothing is chosen, their gates stand and the
``TARGET.precision_auto`` gate fails with what each missed. A form written for another runtime (the TensorRT-form
ONNX, timed here only through onnxruntime's float kernels) is not a candidate and is left as it is.

Targets whose precisions the recipe names are not chosen for (all are delivered), but the same rule runs on them as
a check: where INT8 loses, the row says what the default would deliver and the INT8 artifact gets a note.

A choice made once is recorded (the manifest's ``choices``) and ``--resume`` reuses it (``recorded``), so a resumed
run delivers what the uninterrupted one did without timing again; ``--retime`` measures again.

    >>> from pruneflow.artifacts import Artifact
    >>> fp32 = Artifact(path="m.fp32.onnx", kind="onnx", producer="export", target="onnx", precision="fp32",
    ...                 metrics={"latency_b1_median_ms": 1.0})
    >>> int8 = Artifact(path="m.int8.onnx", kind="onnx", producer="export", target="onnx", precision="int8",
    ...                 metrics={"latency_b1_median_ms": 1.57})
    >>> decide([fp32, int8], {}, [1]).chosen.precision
    'fp32'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..artifacts import Artifact
from ..formats import runs_elsewhere
from ..gates import GateResult
from ..headline import as_deployed

#: An INT8 artifact is delivered only when it is at least this much faster than the best float one at every served
#: batch (the export stage's ``choice.margin``): inside it, the float artifact is as fast and computes as trained.
MARGIN = 0.02
#: Precisions computed in floating point (the baseline an INT8 artifact has to beat).
FLOATS = ("fp32", "bf16", "fp16")


@dataclass
class Decision:
    """One target's choice: the artifact delivered (None: none holds the gates), why, and the figures per candidate."""

    chosen: Artifact | None
    why: str
    float_best: Artifact | None = None
    #: artifact label -> {batch: p50 ms as deployed} (served batches only; absent: not timed there)
    p50: dict[str, dict[int, float]] = field(default_factory=dict)
    scores: dict[str, float | None] = field(default_factory=dict)
    fit: list[Artifact] = field(default_factory=list)
    recorded: bool = False


def candidates(artifacts: list[Artifact], target: str) -> list[Artifact]:
    """The built artifacts of ``target`` that compete (a form written for another runtime does not)."""
    return [a for a in artifacts if a.target == target and a.status == "built" and not runs_elsewhere(a)]


def decide(built: list[Artifact], own_gates: dict[str, list[GateResult]], batch_sizes: list[int],
           margin: float = MARGIN, recorded: str | None = None, recorded_why: str = "") -> Decision:
    """The artifact of ``built`` (one target's candidates) to deliver, by the rule in the module's docstring.

    ``own_gates``: label -> the gates named for that artifact (missing: none); ``recorded``: the label an earlier run
    chose (``recorded_why``: its reason), taken again when it still holds its gates and was built (no timing compared)."""
    p50 = {a.label: _p50(a, batch_sizes) for a in built}
    scores = {a.label: _geo(p50[a.label], batch_sizes) for a in built}
    holds = [a for a in built if all(g.passed for g in own_gates.get(a.label, []))]
    if recorded is not None:
        again = next((a for a in holds if a.label == recorded), None)
        if again is not None:
            return Decision(again, f"{again.label}, as the run this one resumed chose it (manifest.json `choices`; "
                            f"`--retime` measures again){': ' + recorded_why if recorded_why else ''}", p50=p50,
                            scores=scores, fit=holds, recorded=True)
    if recorded is not None:
        anew = decide(built, own_gates, batch_sizes, margin)
        anew.why = f"(the recorded {recorded} no longer holds its gates here: chosen again) {anew.why}"
        return anew
    fit = [a for a in holds if scores[a.label] is not None]
    floats = [a for a in fit if a.precision in FLOATS]
    best_float = min(floats, key=lambda a: scores[a.label]) if floats else None  # type: ignore[arg-type,return-value]
    quantized = sorted((a for a in fit if a.precision not in FLOATS), key=lambda a: scores[a.label])  # type: ignore[arg-type,return-value]
    if best_float is None:
        chosen = quantized[0] if quantized else None
        why = (f"{chosen.label}: the fastest that holds the gates; no float artifact here to compare with" if chosen
               else "none holds the gates and was timed")
        return Decision(chosen, why, None, p50, scores, fit)
    base = p50[best_float.label]
    losing: list[str] = []
    elsewhere: list[str] = []
    for a in quantized:
        short = [(b, base[b] / p50[a.label][b]) for b in batch_sizes if base[b] / p50[a.label][b] < 1 + margin]
        emulated = _emulated_short(a, best_float, batch_sizes, margin)
        if not short and emulated:  # faster here, but not on the AVX2 servers the recipe names
            elsewhere.append(f"{a.label} " + ", ".join(f"{_vs(s)} at batch {b}" for b, s in emulated)
                             + f" than {best_float.label} on the AVX2 CPUs named (deploy.cpu; emulated here: OpenVINO "
                             "with oneDNN capped at AVX2, f32)")
            continue
        if not short:
            gains = ", ".join(f"{base[b] / p50[a.label][b]:.2f}x at batch {b}" for b in batch_sizes)
            return Decision(a, f"{a.label}: faster than {best_float.label} by at least {margin:.0%} at every served batch "
                            f"({gains}, as deployed)", best_float, p50, scores, fit)
        losing.append(f"{a.label} " + ", ".join(f"{_vs(s)} at batch {b}" for b, s in short))
    unfit = [a.label for a in built if a.precision not in FLOATS and a not in fit]
    why = f"{best_float.label}: the fastest float artifact that holds the gates"
    if losing:
        why += (f"; {'; '.join(losing)} than {best_float.label} as deployed on this host (INT8 is delivered only where it "
                f"is at least {margin:.0%} faster at every served batch)")
    if elsewhere:
        why += f"; {'; '.join(elsewhere)}: INT8 must be at least {margin:.0%} faster there too"
    if unfit:
        why += f"; {', '.join(unfit)} failed a gate or was not timed"
    return Decision(best_float, why, best_float, p50, scores, fit)


def choose_precisions(auto_targets: list[str], artifacts: list[Artifact], gates: list[GateResult],
                      batch_sizes: list[int], margin: float = MARGIN, checked_targets: list[str] | None = None,
                      recorded: dict[str, tuple[str, str]] | None = None, explicit: list[str] | None = None,
                      ) -> tuple[list[GateResult], list[dict[str, Any]]]:
    """``(gates, table rows)``: the stage's gates with those of candidates not chosen moved into their notes and a
    ``TARGET.precision_auto`` gate per target choosing; a row per candidate for the report's "precision chosen" table.

    ``auto_targets`` deliver the one chosen; ``checked_targets`` deliver every precision and are only checked (a note
    on an INT8 artifact the rule would not deliver). ``recorded``: target -> (label, why) an earlier run chose.
    ``explicit``: the auto targets that asked for it in the recipe (`precision: auto`): when nothing holds the gates
    there, a failed ``TARGET.precision_auto`` gate says so (by default, the artifacts' own failed gates say it)."""
    rows: list[dict[str, Any]] = []
    explicit = auto_targets if explicit is None else explicit
    for target in [*auto_targets, *(t for t in checked_targets or [] if t not in auto_targets)]:
        built = candidates(artifacts, target)
        if not built:
            continue
        own = {a.label: [g for g in gates if g.name.startswith(f"{a.label}.")] for a in built}
        auto = target in auto_targets
        if not auto and (len(built) < 2 or not any(a.precision not in FLOATS for a in built)):
            continue  # named precisions with nothing to compare: no check to report
        label, why = (recorded or {}).get(target, (None, "")) if auto else (None, "")
        decision = decide(built, own, batch_sizes, margin, label, why)
        for a in built:
            rows.append(_row(target, a, decision, own[a.label], batch_sizes, auto))
        if not auto:
            _warn_if_int8_loses(target, built, decision)
            continue
        for a in built:
            a.metrics["precision_chosen"] = 1.0 if a is decision.chosen else 0.0
        chosen = decision.chosen
        if chosen is None:
            if target in explicit:
                why = "; ".join(f"{a.label}: " + (", ".join(g.name.removeprefix(f"{a.label}.") for g in own[a.label]
                                                             if not g.passed) or "not timed") for a in built)
                gates.append(GateResult(f"{target}.precision_auto", False, f"no precision of {target} holds the gates "
                                        f"and was timed ({why})"))
            continue
        gates = _set_aside(gates, [a for a in built if a is not chosen])
        chosen.notes.append(f"delivered for {target}: {decision.why}")
        gates.append(GateResult(f"{target}.precision_auto", True, f"{chosen.label} ({chosen.path}): {decision.why}",
                                decision.scores.get(chosen.label)))
    return gates, rows


def _warn_if_int8_loses(target: str, built: list[Artifact], decision: Decision) -> None:
    """Named precisions: every artifact is delivered; an INT8 one the default rule would not deliver says so."""
    for a in built:
        if a.precision in FLOATS or a is decision.chosen or decision.chosen is None:
            continue
        a.metrics["int8_loses"] = 1
        a.notes.append(f"INT8 loses on this host: {decision.why}; the recipe names its precisions, so every one is "
                       f"delivered: serve {decision.chosen.label} here, or leave `precisions` out to deliver it")


#: The metrics suffix of latencies timed with OpenVINO capped at AVX2 (``deploy_hosts.time_avx2``), present when the
#: recipe names an AVX2 CPU and this host has more: INT8 must then also win there to be delivered.
EMULATED_AVX2 = "_emulated_avx2"


def _emulated_short(a: Artifact, best_float: Artifact, batch_sizes: list[int], margin: float) -> list[tuple[int, float]]:
    """The served batches where ``a``, timed under AVX2 emulation, is not ``margin`` faster than ``best_float`` timed the
    same way; [] when either was not timed so (an ONNX artifact: onnxruntime has no such cap)."""
    key = "latency_b{}_median_ms" + EMULATED_AVX2
    mine = [float(a.metrics.get(key.format(b)) or 0) for b in batch_sizes]
    theirs = [float(best_float.metrics.get(key.format(b)) or 0) for b in batch_sizes]
    if not all(mine) or not all(theirs):
        return []
    return [(b, t / m) for b, m, t in zip(batch_sizes, mine, theirs) if t / m < 1 + margin]


def _p50(artifact: Artifact, batch_sizes: list[int]) -> dict[int, float]:
    """The p50 latency as deployed per served batch size (absent where not timed)."""
    found = {}
    for batch in batch_sizes:
        suffix, _ = as_deployed(artifact, "", batch)
        value = artifact.metrics.get(f"latency_b{batch}_median_ms{suffix}")
        if value:
            found[batch] = float(value)
    return found


def _geo(p50: dict[int, float], batch_sizes: list[int]) -> float | None:
    """Geometric mean over ``batch_sizes``; None unless timed at all of them."""
    if not batch_sizes or any(b not in p50 for b in batch_sizes):
        return None
    return math.exp(sum(math.log(p50[b]) for b in batch_sizes) / len(batch_sizes))


def _vs(speedup: float) -> str:
    return f"{1 / speedup:.2f}x slower" if speedup < 1 else f"only {speedup:.2f}x faster"


def _row(target: str, a: Artifact, decision: Decision, own: list[GateResult], batch_sizes: list[int],
         auto: bool) -> dict[str, Any]:
    p50 = decision.p50.get(a.label, {})
    lanes = {f"b{b} p50 ms": _ms(p50.get(b)) for b in batch_sizes}
    base = decision.p50.get(decision.float_best.label, {}) if decision.float_best is not None else {}
    versus = [f"{base[b] / p50[b]:.2f}x" for b in batch_sizes if b in base and b in p50]
    failed = [g.name.removeprefix(f"{a.label}.") for g in own if not g.passed]
    hint = as_deployed(a, "", batch_sizes[0])[0].removeprefix("_") if batch_sizes else ""
    computed = a.metrics.get("inference_precision")
    if a is decision.chosen:
        choice = ("chosen (recorded)" if decision.recorded else "chosen") if auto else "the default would deliver this"
    else:
        choice = ""
    return {"target": target, "artifact": a.label, "precision": a.precision,
            "timed as deployed": f"{hint} hint" if hint else "runtime default" + (f" ({computed})" if computed else ""),
            **lanes, "geo-mean ms": _ms(decision.scores.get(a.label)),
            "vs best float": " / ".join(versus) if versus and a is not decision.float_best else "–",
            "gates": "failed: " + ", ".join(failed) if failed else "pass", "choice": choice,
            "why": decision.why if a is decision.chosen else ""}


def _set_aside(gates: list[GateResult], others: list[Artifact]) -> list[GateResult]:
    """The gates without those of ``others`` that failed, which go into that artifact's notes instead."""
    kept = []
    for gate in gates:
        owner = next((a for a in others if gate.name.startswith(f"{a.label}.")), None)
        if owner is None or gate.passed:
            kept.append(gate)
        else:
            owner.notes[:] = [n for n in owner.notes if n != f"gate failed: {gate.name}: {gate.message}"]
            owner.notes.append(f"not delivered (precision chosen per target); gate failed: {gate.name}: {gate.message}")
    return kept


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"
