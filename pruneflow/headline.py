"""What a run changed against the model it started from: the headline report.md and ``--json`` open with.

The model a run starts from is the one entering its first compressing stage (``Stage.compresses``: prune, QAT,
PTQ); a train stage before it makes that model. The headline compares the run's result with it, as
before -> after and a ratio: MACs, parameters, bytes on disk, the task's headline metric, and latency per runtime
and batch size. The export stage times the starting model in each runtime, interleaved with the artifacts
(``stages/export.py``), so every latency ratio is measured side by side, and carries its spread.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .deployment import openvino_hint

if TYPE_CHECKING:
    from .context import RunContext, RunState
    from .handle import ModelHandle

RunResult = Any  # results.RunResult, which imports this module (a type here would close an import circle)

#: p90/p50 above this on either side of a latency ratio: the figure is flagged as noise.
NOISY_SPREAD = 1.5


@dataclass
class StartPoint:
    """The model a run started from: a frozen float copy, and what it measured before any compression."""

    stage: str  # the first compressing stage, which it entered
    handle: "ModelHandle"
    macs: int | None
    params: int | None
    metric: float | None  # the task's headline metric, from the last stage before that measured it
    bytes: int | None
    bytes_what: str
    latency: dict[str, Any] = field(default_factory=dict)
    metric_from: str | None = None  # where ``metric`` was read in the run's metrics (``train.accuracy``)

    def summary(self) -> dict[str, Any]:
        """What manifest.json, metrics.json and RunResult keep (the model itself stays in memory)."""
        return {"stage": self.stage, "macs": self.macs, "params": self.params, "metric": self.metric,
                "metric_from": self.metric_from, "bytes": self.bytes, "bytes_what": self.bytes_what}


def capture_start(stage_id: str, state: "RunState", ctx: "RunContext", headline: str) -> StartPoint:
    """The state's model as it enters ``stage_id``: counted, measured, and copied (float) for the export to time."""
    from .evaluate import count_macs_params
    from .handle import ModelHandle

    module = copy.deepcopy(state.handle.float_module()).eval()
    try:
        if state.example_input is None:
            raise ValueError("no example input")
        macs, params = count_macs_params(module, state.example_input)
    except Exception:  # noqa: BLE001 - a model the counter cannot trace: the headline goes without MACs
        macs, params = None, sum(p.numel() for p in module.parameters())
    measured = next((sid for sid, m in reversed(list(state.metrics.items())) if isinstance(m.get(headline), (int, float))),
                    None)
    metric = state.metrics[measured][headline] if measured else None
    size, what = _start_bytes(state, ctx, params)
    return StartPoint(stage_id, ModelHandle(module), macs, params, metric, size, what,
                      metric_from=f"{measured}.{headline}" if measured else None)


def _start_bytes(state: "RunState", ctx: "RunContext", params: int | None) -> tuple[int | None, str]:
    """Bytes of the starting model on disk: its checkpoint in the run, the recipe's checkpoint, else FP32 weights."""
    artifact = state.model_artifact
    if artifact is not None and artifact.size_bytes:
        return artifact.size_bytes, f"checkpoint {Path(artifact.path).parent.name}/{Path(artifact.path).name}"
    source = ctx.recipe.model.checkpoint
    if source and Path(source).is_file():
        return Path(source).stat().st_size, f"checkpoint {Path(source).name}"
    return (params * 4, "fp32 weights") if params else (None, "")


def result_artifact(result: RunResult, target: str | None = None, producer: str | None = None):
    """The run's result: the built exported artifact of the lowest precision (int8, bf16, fp16, fp32; of a target that
    delivers one artifact, ``export_choice.py``, only the one it chose), CPU
    form first; of ``target`` and made by stage ``producer`` when given. None without an exported artifact."""
    order = {"int8": 0, "bf16": 1, "fp16": 2, "fp32": 3}
    built = [a for a in result.artifacts if a.status == "built" and a.target and (target is None or a.target == target)
             and (producer is None or a.producer == producer) and a.metrics.get("precision_chosen") != 0.0]
    # a target that chose delivers its choice (a TensorRT-form file beside it is for another runtime, not the result)
    chose = {(a.producer, a.target) for a in built if a.metrics.get("precision_chosen") == 1.0}
    built = [a for a in built if (a.producer, a.target) not in chose or a.metrics.get("precision_chosen") == 1.0]
    built.sort(key=lambda a: (order.get(a.precision or "", 3), a.form not in (None, "cpu")))
    return built[0] if built else None


def headline_gate_of(result: RunResult, specs: list, task: Any) -> dict[str, Any]:
    """``gates.headline_gate`` for a finished run: the suggested gate reads the headline metric of the run's result
    (its exported artifact, else the last stage that measured it) against the model the run started from."""
    from .gates import headline_gate

    name = task.headline.name
    after = result_artifact(result)
    metric: str | None = f"{after.metric_prefix}.{name}" if after is not None and name in after.metrics else None
    if metric is None:
        metric = next((f"{s.id}.{name}" for s in reversed(result.stages) if name in s.metrics), None)
    return headline_gate(specs, task, metric, (result.start or {}).get("metric_from"))


def headline_rows(result: RunResult) -> list[dict[str, Any]]:
    """``{"what", "start", "result", "change"}`` rows: MACs, parameters, bytes, the headline metric, latency."""
    start = result.start
    if not start:
        return []
    after = result_artifact(result)
    macs_after = next((s.metrics["macs"] for s in reversed(result.stages) if "macs" in s.metrics), None)
    params_after = next((s.metrics["params"] for s in reversed(result.stages) if "params" in s.metrics), None)
    rows = [_ratio_row("MACs", start.get("macs"), macs_after, "fewer"),
            _ratio_row("parameters", start.get("params"), params_after, "fewer")]
    if after is not None:
        rows.append(_ratio_row(f"bytes on disk ({start.get('bytes_what')} → {after.label})", start.get("bytes"),
                               after.size_bytes, "smaller", human=True))
        rows.append(_metric_row(result, start.get("metric"), after.metrics.get(result.headline), after.label,
                                start.get("metric_from")))
    rows += _latency_rows(result)
    return [r for r in rows if r is not None]


def _ratio_row(what: str, before: Any, after: Any, word: str, human: bool = False) -> dict[str, Any] | None:
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or not before or not after:
        return None
    from .units import human_bytes, human_int

    show = human_bytes if human else human_int
    ratio = before / after
    change = f"{ratio:.2f}x {word}" if ratio >= 1 else f"{1 / ratio:.2f}x {'larger' if word == 'smaller' else 'more'}"
    return {"what": what, "start": show(int(before)), "result": show(int(after)), "change": change,
            "ratio": round(ratio, 4)}


def _metric_row(result: RunResult, before: Any, after: Any, label: str, measured: str | None) -> dict[str, Any] | None:
    """The headline metric, start -> result; the row names where the start's figure was read (``train.accuracy``):
    a gate's ``baseline`` may be another one (``baseline_notes``)."""
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)):
        return None
    direction = (result.task.get("metrics") or {}).get(result.headline, "higher")
    delta = after - before
    worse = delta < 0 if direction == "higher" else delta > 0
    against = f" against {measured}" if measured else ""
    return {"what": f"{result.headline} ({label}{against})", "start": f"{before:.4f}", "result": f"{after:.4f}",
            "change": f"{delta:+.4f}" + (" (worse)" if worse and delta else ""), "delta": delta, "baseline": measured}


def baseline_notes(result: RunResult, specs: list, task: Any) -> list[str]:
    """One line per recipe gate on the headline metric whose ``baseline`` is not the figure the headline's change is
    counted from (the model entering the first compressing stage): the two changes answer different questions, and
    report.md, the terminal and ``--json`` say which is which (issue 42: they differed without saying so)."""
    from .gates import reads_headline

    start = result.start or {}
    measured, begin = start.get("metric_from"), start.get("metric")
    if not measured:
        return []
    notes = []
    for spec in specs:
        if spec.baseline and spec.baseline != measured and reads_headline(spec, task):
            base = result.metrics.get(spec.baseline)
            shown = f" ({base:.4f})" if isinstance(base, (int, float)) else ""
            notes.append(f"gate `{spec.metric}` counts its change from `{spec.baseline}`{shown}; the headline counts "
                         f"from `{measured}` ({begin:.4f}), the model entering `{start.get('stage')}`")
    return notes


def _latency_rows(result: RunResult) -> list[dict[str, Any]]:
    """Per runtime and batch size: the starting model's p50 (timed by the export stage beside the artifacts) against
    the result artifact's of that target, with both spreads; flagged when either p90/p50 says it is noise."""
    timed = [s for s in result.stages if s.tables.get("start_latency")]
    if not timed:
        return []
    stage = timed[-1]  # the last export stage that timed it: its artifacts ran in the same loop as the start
    rows = []
    for lane in stage.tables["start_latency"]:
        after = result_artifact(result, lane["target"], producer=stage.id)
        if after is None:
            continue
        suffix, label = as_deployed(after, lane.get("suffix", ""), lane["batch"])
        p50 = after.metrics.get(f"latency_b{lane['batch']}_median_ms{suffix}")
        p90 = after.metrics.get(f"latency_b{lane['batch']}_p90_ms{suffix}")
        if not p50 or not lane.get("p50_ms"):
            continue
        spread = max(lane["p90_ms"] / lane["p50_ms"], (p90 or p50) / p50)
        ratio = lane["p50_ms"] / p50
        noisy = spread > NOISY_SPREAD
        change = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x SLOWER"
        loses = bool(after.metrics.get(f"slower_than_fp32_b{lane['batch']}{suffix}")) and _fp32_faster_as_deployed(
            result, after, lane["batch"], p50)
        if loses:  # it lost to its own target's FP32 artifact, as that one is deployed, in the export's loop
            change += f"; the same model in FP32 ({after.target}.fp32) is faster at this batch"
        rows.append({"what": f"latency {lane['runtime']}, batch {lane['batch']} ({label})",
                     "start": f"{lane['p50_ms']:.3g} ms", "result": f"{p50:.3g} ms",
                     "change": change + f" (p90/p50 up to {spread:.2f}" + (": NOISY, time again with bench)" if noisy else ")"),
                     "ratio": round(ratio, 4), "spread": round(spread, 3), "noisy": noisy, "slower": ratio < 1,
                     "fp32_faster": loses})
    return rows


def _fp32_faster_as_deployed(result: RunResult, after: Any, batch: int, p50: float) -> bool:
    """Whether the FP32 artifact of ``after``'s target, timed as *it* is deployed (its record's hint, else the runtime's
    default), beats ``after``'s ``p50``: the comparison the delivery choice makes (``stages/export_choice.py``), so the
    report never says "serve the FP32 artifact" where that artifact, as deployed, is the slower one. (An FP32 IR at a
    hint its record does not name can be faster still; that is a lane of `pruneflow bench`, not a deployed artifact.)"""
    fp32 = next((a for a in result.artifacts if a.target == after.target and a.producer == after.producer
                 and a.precision == "fp32" and not a.form and a.status == "built"), None)
    if fp32 is None:
        return True
    suffix, _ = as_deployed(fp32, "", batch)
    theirs = fp32.metrics.get(f"latency_b{batch}_median_ms{suffix}")
    return theirs is None or theirs < p50


def as_deployed(after, suffix: str, batch: int) -> tuple[str, str]:
    """The metrics suffix and label to compare a start lane with: at the runtime's default (``suffix`` ""), an
    artifact whose deployment record names an OpenVINO precision hint is taken as deployed, with that hint (an
    INT8 IR: f32, which is also faster than bf16 for its float parts at batch 1), against the start's default."""
    hint = openvino_hint(after.deployment)
    if suffix or not hint or f"latency_b{batch}_median_ms_{hint}" not in after.metrics:
        return suffix, after.label
    return f"_{hint}", f"{after.label} as deployed, {hint} hint"


def delivered_lines(result: RunResult) -> tuple[list[str], list[str]]:
    """``(delivered, int8 loses)``: per target that chose its artifact, what it delivers and why; per target whose
    precisions the recipe names, where its INT8 artifact loses to float on this host (the rule it would be chosen by,
    ``stages/export_choice.py``) and what the default would deliver instead."""
    delivered, loses = [], []
    for stage in result.stages:
        for row in stage.tables.get("precision chosen", []):
            if row.get("choice", "").startswith("chosen"):
                delivered.append(f"{row['target']}: {row.get('why') or row['artifact']}")
            elif row.get("choice") == "the default would deliver this":
                losing = [a for a in result.artifacts if a.producer == stage.id and a.target == row["target"]
                          and a.metrics.get("int8_loses")]
                if losing:
                    loses.append(f"{row['target']}: {row.get('why') or row['artifact']}")
    return delivered, loses


def served_lines(result: RunResult) -> list[str]:
    """Which CPUs each delivered artifact is for (the export's ``served on`` table, ``export/deploy_hosts.py``),
    grouped, with the CPUs named and what was emulated; [] for a run without an export."""
    tables = [(s, s.tables["served on"]) for s in result.stages if s.tables.get("served on")]
    if not tables:
        return []
    out = []
    for stage, rows in tables:
        groups: dict[str, list[str]] = {}
        for row in rows:
            groups.setdefault(row["for"], []).append(row["artifact"])
        named = next((a.deployment["hosts"]["cpu"] for a in result.artifacts if a.producer == stage.id and a.deployment
                      and a.deployment.get("hosts")), None)
        lead = (f"built for the CPUs named ({', '.join(named)})" if named else
                "no serving CPU named (`deploy.cpu`, `--for`): built to compute alike on any CPU")
        emulated = [f"{r['artifact']} {r['emulated AVX2']}" for r in rows if r.get("emulated AVX2")]
        out.append(f"**Served on** ({stage.id}; table `served on`): {lead}; "
                   + "; ".join(f"{where}: {', '.join(labels)}" for where, labels in groups.items())
                   + (f". Checked under emulated AVX2 (OpenVINO, ONEDNN_MAX_CPU_ISA=AVX2): {'; '.join(emulated)}" if emulated else "")
                   + (". Precision and latency were measured on the build host (under Latency), not on those CPUs: time "
                      "them there with `pruneflow bench`" if named and _timed(result, stage.id) else "") + ".")
        out.append("")
    return out


def _timed(result: RunResult, stage_id: str) -> bool:
    return any(k.startswith("latency_b") for a in result.artifacts if a.producer == stage_id for k in a.metrics)

