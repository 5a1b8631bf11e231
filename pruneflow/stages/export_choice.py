"""``precision: auto`` on an export target: of the precisions it wrote, keep the fastest artifact that holds the gates.

The runtime's own float path is the baseline to beat: on a CPU with bf16 arithmetic OpenVINO runs an FP32 IR in
bf16 for free, and an INT8 IR is not always faster (ResNet-56 on an AMX Xeon: INT8 0.79x of the bf16 default). So
the choice is measured, on this host, from what the stage already did: every gate named for the artifact (parity
in each runtime lane, size, speed-up) and its latency as deployed (its record's precision hint, else the runtime's
default) at every batch size the stage timed, compared by their geometric mean. The winner is the target's result
(``precision_chosen`` 1 on it, 0 on the others); the others stay in the run folder, and a gate they failed is
moved into their notes, since the artifact the run delivers holds every gate. When none holds them, nothing is
chosen, their gates stand and the ``TARGET.precision_auto`` gate fails with what each missed.
"""

from __future__ import annotations

import math
from typing import Any

from ..artifacts import Artifact
from ..gates import GateResult
from ..headline import as_deployed


def choose_precisions(auto_targets: list[str], artifacts: list[Artifact], gates: list[GateResult],
                      batch_sizes: list[int]) -> tuple[list[GateResult], list[dict[str, Any]]]:
    """``(gates, table rows)``: the stage's gates with those of candidates not chosen moved into their notes and a
    ``TARGET.precision_auto`` gate per target; a row per candidate for the report's "precision chosen" table."""
    rows: list[dict[str, Any]] = []
    for target in auto_targets:
        built = [a for a in artifacts if a.target == target and a.status == "built"]
        if not built:
            continue
        scored = [(a, _score(a, batch_sizes), [g for g in gates if g.name.startswith(f"{a.label}.")]) for a in built]
        fit = [(a, score) for a, score, own in scored if score is not None and all(g.passed for g in own)]
        chosen, best = min(fit, key=lambda pair: pair[1]) if fit else (None, None)
        for a, score, own in scored:
            a.metrics["precision_chosen"] = 1.0 if a is chosen else 0.0
            rows.append(_row(target, a, score, own, batch_sizes, a is chosen))
        if chosen is None:
            why = "; ".join(f"{a.label}: " + (", ".join(g.name.removeprefix(f"{a.label}.") for g in own if not g.passed)
                                              or "not timed")
                            for a, _, own in scored)
            gates.append(GateResult(f"{target}.precision_auto", False, f"no precision of {target} holds the gates and was "
                                    f"timed ({why})"))
            continue
        gates = _set_aside(gates, [a for a in built if a is not chosen])
        chosen.notes.append(f"chosen by precision: auto: the fastest of {', '.join(a.label for a in built)} that holds "
                            f"every gate here ({_ms(best)} geometric-mean p50 as deployed)")
        gates.append(GateResult(f"{target}.precision_auto", True, f"{chosen.label} ({chosen.path}): the fastest of "
                                f"{len(built)} that holds the gates", best))
    return gates, rows


def _score(artifact: Artifact, batch_sizes: list[int]) -> float | None:
    """Geometric mean of the p50 latency as deployed over ``batch_sizes``; None unless timed at all of them."""
    found = []
    for batch in batch_sizes:
        suffix, _ = as_deployed(artifact, "", batch)
        value = artifact.metrics.get(f"latency_b{batch}_median_ms{suffix}")
        if not value:
            return None
        found.append(float(value))
    return math.exp(sum(math.log(v) for v in found) / len(found)) if found else None


def _row(target: str, a: Artifact, score: float | None, own: list[GateResult], batch_sizes: list[int],
         chosen: bool) -> dict[str, Any]:
    lanes = {f"b{b} p50 ms": _ms(a.metrics.get(f"latency_b{b}_median_ms{as_deployed(a, '', b)[0]}")) for b in batch_sizes}
    failed = [g.name.removeprefix(f"{a.label}.") for g in own if not g.passed]
    hint = as_deployed(a, "", batch_sizes[0])[0].removeprefix("_")
    computed = a.metrics.get("inference_precision")
    return {"target": target, "artifact": a.label, "precision": a.precision,
            "timed as deployed": f"{hint} hint" if hint else "runtime default" + (f" ({computed})" if computed else ""),
            **lanes, "geo-mean ms": _ms(score), "gates": "failed: " + ", ".join(failed) if failed else "pass",
            "choice": "chosen" if chosen else ""}


def _set_aside(gates: list[GateResult], others: list[Artifact]) -> list[GateResult]:
    """The gates without those of ``others`` that failed, which go into that artifact's notes instead."""
    kept = []
    for gate in gates:
        owner = next((a for a in others if gate.name.startswith(f"{a.label}.")), None)
        if owner is None or gate.passed:
            kept.append(gate)
        else:
            owner.notes[:] = [n for n in owner.notes if n != f"gate failed: {gate.name}: {gate.message}"]
            owner.notes.append(f"not chosen by precision: auto; gate failed: {gate.name}: {gate.message}")
    return kept


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"
