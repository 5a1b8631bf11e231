"""report.md: what a person reads after a run. Every figure comes from metrics measured in the run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .artifacts import write_text_atomic

if TYPE_CHECKING:
    from .context import RunState
    from .data import DataBundle
    from .results import RunResult
    from .recipe import LoadedRecipe


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value).lower()
    if isinstance(value, int):
        return human_int(value) if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if 0 < abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def human_int(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def human_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def md_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "_none_\n"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(out) + "\n"


def artifact_rows(result: "RunResult") -> list[dict]:
    rows = []
    for a in result.artifacts:
        m = a.metrics
        rows.append({
            "artifact": a.path.replace("stages/", "").replace("export/", ""),
            "status": a.status + (" (parity failed)" if any(n.startswith("parity check failed") for n in a.notes) else ""),
            "size": human_bytes(a.size_bytes),
            "accuracy": m.get("accuracy"),
            "max abs diff": m.get("max_abs_diff"),
            "top-1 agree": m.get("top1_agreement"),
            "lat b1 ms": m.get("latency_b1_median_ms"),
            "lat b32 ms": m.get("latency_b32_median_ms"),
        })
    return rows


def stage_rows(result: "RunResult") -> list[dict]:
    return [{
        "stage": s.id + (" (resumed)" if s.resumed else ""),
        "type": s.type,
        "seconds": f"{s.seconds:.1f}",
        "accuracy": s.metrics.get("accuracy"),
        "MACs": s.metrics.get("macs"),
        "params": s.metrics.get("params"),
    } for s in result.stages]


def render_markdown(result: "RunResult", loaded: "LoadedRecipe", data: "DataBundle") -> str:
    recipe = loaded.recipe
    verdict = "PASSED" if result.exit_code == 0 else "GATE FAILED"
    lines = [
        f"# pruneflow run: {recipe.name}",
        "",
        f"**{verdict}**" + (f" — {recipe.description}" if recipe.description else ""),
        "",
        f"- recipe: `{loaded.file}`" + (f" (extends {', '.join(f'`{p}`' for p in loaded.chain[1:])})" if len(loaded.chain) > 1 else ""),
        f"- model: `{recipe.model.factory}`" + (f", checkpoint `{recipe.model.checkpoint}`" if recipe.model.checkpoint else ""),
        f"- data: {data.description}; {len(data.train) if data.train is not None else 0} train / {len(data.eval)} eval samples, "
        f"{data.num_classes} classes, input {list(data.input_shape)}",
        "",
        "## Stages",
        "",
        md_table(stage_rows(result)),
        "## Artifacts",
        "",
        "Accuracy is measured in each artifact's own runtime on the eval split; parity compares its outputs "
        "with the torch model it came from; latency is the median of timed runs (threads: "
        + (", ".join(sorted({str(a.metrics["latency_threads"] or "runtime default") for a in result.artifacts
                             if "latency_threads" in a.metrics})) or "not timed") + ").",
        "",
        md_table(artifact_rows(result)),
        "## Gates",
        "",
        md_table([{"gate": g.name, "result": "pass" if g.passed else "FAIL", "detail": g.message} for g in result.gates]),
    ]
    for s in result.stages:
        for name, rows in s.tables.items():
            lines += [f"## {s.id}: {name}", "", md_table(rows)]
    notes = [{"artifact": a.path, "note": n} for a in result.artifacts for n in a.notes]
    if notes:
        lines += ["## Notes", "", md_table(notes)]
    lines += ["## Lineage", "", md_table([{"artifact": a.path, "parent": a.parent, "sha256": (a.sha256 or "")[:16]} for a in result.artifacts])]
    return "\n".join(lines)


def write_reports(result: "RunResult", loaded: "LoadedRecipe", data: "DataBundle", state: "RunState") -> None:
    write_text_atomic(result.run_dir / "report.md", render_markdown(result, loaded, data))
