"""Quality gates: checks on measured metrics that decide exit code 1."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .recipe.models import GateSpec


@dataclass
class GateResult:
    name: str
    passed: bool
    message: str
    value: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def check_gates(specs: list[GateSpec], metrics: dict[str, float]) -> list[GateResult]:
    """Evaluate recipe gates against the flat metric namespace (``evaluate.accuracy``, ``onnx.fp32.accuracy``)."""
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
        if spec.max_drop is not None:
            base = metrics.get(spec.baseline or "")
            if not isinstance(base, (int, float)):
                problems.append(f"baseline {spec.baseline!r} was not produced by this run")
            elif base - value > spec.max_drop:
                problems.append(f"drop {base - value:.6g} from {spec.baseline} ({base:.6g}) > max_drop {spec.max_drop:g}")
        bounds = " ".join(
            s for s in (
                f">= {spec.min:g}" if spec.min is not None else "",
                f"<= {spec.max:g}" if spec.max is not None else "",
                f"drop from {spec.baseline} <= {spec.max_drop:g}" if spec.max_drop is not None else "",
            ) if s
        )
        message = "; ".join(problems) if problems else f"{value:.6g} ({bounds})"
        results.append(GateResult(name, not problems, message, float(value)))
    return results
