"""report.md: what a person reads after a run. Every figure comes from metrics measured in the run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .artifacts import write_text_atomic
from .headline import delivered_lines, served_lines
from .units import human_bytes as human_bytes, human_int as human_int  # re-exported: callers import them from here

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


def md_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "_none_\n"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(out) + "\n"


def artifact_rows(result: "RunResult") -> list[dict]:
    """One row per artifact: status, size, the task's headline metric in its runtime, parity (largest difference
    and the task's agreement figure with the torch model it came from; an INT8 one's with the float model too)
    and latency."""
    agreement = str(result.task.get("agreement", ""))
    agreement_column = str(result.task.get("agreement_label") or agreement.replace("_", " "))
    heads = result.task.get("heads") or {}  # a multi-head task: every head's headline, not the first head's only
    shown = [f"{h}.{t['headline']}" for h, t in heads.items()] or [result.headline]
    shown += [name for name in result.task.get("user_metrics") or {} if name not in shown]  # the recipe's own metrics
    timed = sorted({int(k[len("latency_b"):-len("_median_ms")]) for a in result.artifacts if a.kind != "checkpoint" for k in a.metrics
                    if k.startswith("latency_b") and k.endswith("_median_ms") and k[len("latency_b"):-len("_median_ms")].isdigit()})
    rows = []
    for a in result.artifacts:
        m = a.metrics
        rows.append({
            "artifact": a.path.replace("stages/", "").replace("export/", ""),
            "status": STATUS_WORDS.get(a.status, a.status) + status_marks(a),
            "size": human_bytes(a.size_bytes),
            **{name: m.get(name) for name in shown},
            "max abs diff": m.get("max_abs_diff"),
            agreement_column: m.get(agreement),
            f"{agreement_column} vs fp32": m.get(f"{agreement}_fp32"),
            # a checkpoint's figures are its stage's (prune times its ONNX export in its own settings): not a runtime's
            # latency to set beside the artifacts' (the stage's table has them)
            **{f"lat b{bs} ms": m.get(f"latency_b{bs}_median_ms") if a.kind != "checkpoint" else None for bs in timed[:3]},
        })
    return rows


#: How a status reads in tables: a prepared artifact is never mistaken for one that exists.
STATUS_WORDS = {"prepared": "prepared, not built", "failed": "FAILED"}


def not_built_rows(result: "RunResult") -> list[dict]:
    """Prepared and failed artifacts: where the bundle is and why it was not built here (the target's note)."""
    rows = []
    for a in result.artifacts:
        if a.status == "built":
            continue
        reason = next((n for n in a.notes if n.startswith(("prepared, not built", "failed"))), "; ".join(a.notes[:1]))
        reason = reason.removeprefix("prepared, not built").lstrip(": ")
        rows.append({"artifact": a.label if a.target else a.path, "status": STATUS_WORDS.get(a.status, a.status),
                     "folder": a.path.rsplit("/", 1)[0] + "/", "why": reason})
    return rows


def not_built_section(result: "RunResult") -> list[str]:
    rows = not_built_rows(result)
    if not rows:
        return []
    return ["## Not built here", "", "Each folder holds what the vendor's tool needs and the commands to run on a machine "
            "that has it (its README.md says how).", "", md_table(rows)]


def status_marks(artifact) -> str:
    """`` (parity failed)``, `` (gate failed: onnx.int8.max_size_mb)``: what a status cell adds for a kept artifact that failed a check."""
    marks = ["parity failed"] if any(n.startswith("parity check failed") for n in artifact.notes) else []
    failed = [n.split(":")[1].strip() for n in artifact.notes if n.startswith("gate failed:")]
    marks += [f"gate failed: {', '.join(failed)}"] if failed else []
    return f" ({'; '.join(marks)})" if marks else ""


def latency_rows(result: "RunResult") -> list[dict]:
    """One row per artifact, way of running it (OpenVINO: plugin default, f32 forced) and batch size, from
    the figures the export stage measured interleaved (``latency_b{bs}_median_ms[_f32]`` and friends)."""
    rows = []
    for a in result.artifacts:
        m = a.metrics
        sizes = sorted({int(k[len("latency_b"):].split("_")[0]) for k in m if k.startswith("latency_b") and "_median_ms" in k})
        for suffix in [s for s in ("", "_f32") if f"runtime{s}" in m]:
            for bs in sizes:
                if f"latency_b{bs}_median_ms{suffix}" not in m:
                    continue
                rows.append({
                    "artifact": a.label, "runtime": m[f"runtime{suffix}"], "batch": bs,
                    "p50 ms": m[f"latency_b{bs}_median_ms{suffix}"], "p90 ms": m.get(f"latency_b{bs}_p90_ms{suffix}"),
                    "p99 ms": m.get(f"latency_b{bs}_p99_ms{suffix}"), "samples/s": m.get(f"throughput_b{bs}{suffix}"),
                    "vs fp32": speedup(m.get(f"speedup_b{bs}{suffix}")),
                })
    return rows


def speedup(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def host_line(host: dict) -> str:
    """The host row an export stage records, as one sentence for the report."""
    gpus = f"; GPUs: {host['gpus']}" if host.get("gpus") else ""
    return (f"Measured on {host.get('cpu')} ({host.get('arch')}; {host.get('isa') or 'no listed ISA extensions'}), "
            f"{host.get('usable_cpus')} usable CPUs, runtime threads: {host.get('threads')}{gpus}; {host.get('versions')}.")


def latency_section(result: "RunResult") -> list[str]:
    """The interleaved latency table with the host it was measured on beside it (one per export stage's host)."""
    rows = latency_rows(result)
    if not rows:
        return []
    hosts = [host_line(row) for s in result.stages for row in s.tables.get("host", [])]
    runs = sorted({str(a.metrics["latency_runs"]) for a in result.artifacts if "latency_runs" in a.metrics})
    return [
        "## Latency",
        "",
        *hosts,
        "",
        f"All artifacts of a stage timed together, interleaved ({', '.join(runs)} runs each per batch size, fresh eval "
        "batches); `vs fp32`: the fp32 artifact's p50 of the same target and way of running it over this one's. OpenVINO "
        "runs each artifact as a user would (the plugin's default inference precision) and with f32 forced.",
        "",
        md_table(rows),
    ]


def headline_section(result: "RunResult") -> list[str]:
    """Before -> after against the model the run started from, first thing in the report (``headline.py``)."""
    rows = result.headline_rows()
    delivered, loses = delivered_lines(result)
    if not rows or not result.start:
        return _delivered_lines(delivered, loses) + served_lines(result)
    noisy = any(r.get("noisy") for r in rows)
    slower = [r["what"].removeprefix("latency ") for r in rows if r.get("slower")]
    fp32_faster = [r["what"].removeprefix("latency ") for r in rows if r.get("fp32_faster")]
    return [
        "## Against the model you started from",
        "",
        md_table([{"": r["what"], "start": r["start"], "result": r["result"], "change": r["change"]} for r in rows]),
        f"The start is the model entering stage `{result.start['stage']}`. Latency: both timed interleaved in one loop by "
        "the export stage, on the host under Latency; p50 ratio, with the larger p90/p50 of the two."
        + (" A ratio flagged NOISY moved more between runs than it claims: time it again with `pruneflow bench`." if noisy else ""),
        "",
        *([f"**Two baselines:** {'; '.join(result.baseline_notes)}.", ""] if result.baseline_notes else []),
        *([f"**Slower than the start:** {'; '.join(slower)}. The result is smaller but loses on speed at that batch on this "
           "host; time other batches with `pruneflow bench`.", ""] if slower else []),
        *([f"**The FP32 artifact of the same model is faster:** {'; '.join(fp32_faster)}. Quantization made it smaller, not "
           "faster, at that batch on this host: serve the FP32 artifact there (Notes give the factor).", ""] if fp32_faster else []),
        *_delivered_lines(delivered, loses),
        *served_lines(result),
    ]


def _delivered_lines(delivered: list[str], loses: list[str]) -> list[str]:
    """What each target delivers and why; where a recipe's named INT8 loses to float here (``headline.delivered_lines``)."""
    return [
        *([f"**Delivered** (per target, measured on this host; table `precision chosen`): {'; '.join(delivered)}.", ""]
          if delivered else []),
        *([f"**INT8 loses on this host:** {'; '.join(loses)}. The recipe names its precisions, so every artifact is "
           "delivered; leave `precisions` out to deliver the faster one.", ""] if loses else []),
    ]


def stage_rows(result: "RunResult") -> list[dict]:
    return [{
        "stage": s.id + (" (resumed)" if s.resumed else ""),
        "type": s.type,
        "seconds": f"{s.seconds:.1f}",
        result.headline: s.metrics.get(result.headline),
        "MACs": s.metrics.get("macs"),
        "params": s.metrics.get("params"),
    } for s in result.stages]


def failed_section(failure: dict | None) -> list[str]:
    """What stopped the run: the stage, the error and its fix, the exit code, and the files the stage left."""
    if not failure:
        return []
    error = failure["error"]
    where = f"stage `{failure['stage']}` ({failure['stage_type']})" if failure.get("stage") else "the run"
    lines = ["## Failed", "", f"{where} stopped the run with exit {error['exit_code']} ({error['type']}):", "",
             "```", error["message"], "```", ""]
    if error.get("hint"):
        lines += [f"**Fix:** {error['hint']}", ""]
    if failure.get("files"):
        lines += ["Files it left (listed under `failure` in manifest.json, not artifacts):", "",
                  *(f"- `{f}`" for f in failure["files"]), ""]
    lines += ["The stages above finished and are kept: after the fix, `pruneflow optimize --resume` continues from them.", ""]
    return lines


def render_markdown(result: "RunResult", loaded: "LoadedRecipe", data: "DataBundle", failure: dict | None = None) -> str:
    from .user_metrics import recipe_task

    recipe = loaded.recipe
    task = recipe_task(recipe)
    labels = task.data_summary(data)
    headline = task.headline
    verdict = "PASSED" if result.exit_code == 0 else "GATE FAILED"
    if failure:
        verdict = "INTERRUPTED" if failure["error"]["type"] in ("KeyboardInterrupt", "Terminated") else "FAILED"
    lines = [
        f"# pruneflow run: {recipe.name}",
        "",
        f"**{verdict}**" + (f" — {recipe.description}" if recipe.description else ""),
        "",
        *([f"> **Not gated on {headline.name}**: {result.headline_gate['message']}", ""]
          if not result.headline_gate.get("gated", True) and not failure else []),
        *headline_section(result),
        f"- recipe: `{loaded.file}`" + (f" (extends {', '.join(f'`{p}`' for p in loaded.chain[1:])})" if len(loaded.chain) > 1 else ""),
        f"- model: `{recipe.model.factory}`" + (f", checkpoint `{recipe.model.checkpoint}`" if recipe.model.checkpoint else ""),
        f"- data: {data.description}; {data.train_rows} train / {len(data.eval)} eval samples, "
        f"{labels + ', ' if labels else ''}input {list(data.input_shape)}",
        f"- task: `{task.name}`; headline metric `{headline.name}` ({headline.direction})"
        + "".join(f", `{m.name}` ({m.direction})" for m in task.metrics if m.name != headline.name),
        "",
        *failed_section(failure),
        "## Stages" + (" that finished" if failure else ""),
        "",
        md_table(stage_rows(result)),
        "## Artifacts",
        "",
        f"`{headline.name}` is measured in each artifact's own runtime on the eval split; parity compares its outputs "
        f"with the torch model it came from ({task.agreement.shown}, {task.agreement.direction}); latency is the median of timed runs (threads: "
        + (", ".join(sorted({str(a.metrics["latency_threads"] or "runtime default") for a in result.artifacts
                             if "latency_threads" in a.metrics})) or "not timed") + ").",
        "",
        md_table(artifact_rows(result)),
        *not_built_section(result),
        *latency_section(result),
        "## Gates",
        "",
        md_table([{"gate": g.name, "result": "pass" if g.passed else "FAIL", "detail": g.message} for g in result.gates]),
    ]
    for s in result.stages:
        for name, rows in s.tables.items():
            if name not in ("host", "start_latency"):  # printed beside the latency table; in the headline
                lines += [f"## {s.id}: {name}", "", md_table(rows)]
    notes = [{"artifact": a.path, "note": n} for a in result.artifacts for n in a.notes]
    if notes:
        lines += ["## Notes", "", md_table(notes)]
    lines += ["## Lineage", "", md_table([{"artifact": a.path, "parent": a.parent, "sha256": (a.sha256 or "")[:16]} for a in result.artifacts])]
    return "\n".join(lines)


def write_reports(result: "RunResult", loaded: "LoadedRecipe", data: "DataBundle", state: "RunState | None",
                  failure: dict | None = None) -> None:
    """report.md; after a failure (``failure``: the manifest's record of it) with what finished and a Failed section."""
    write_text_atomic(result.run_dir / "report.md", render_markdown(result, loaded, data, failure))
