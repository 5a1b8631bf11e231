"""`export`: write the model for each target and precision, then measure every artifact.

Each artifact is checked in its own runtime right after it is built: parity against the torch model it
came from (max abs diff, cosine similarity and the task's agreement figure: top-1 agreement for classes; an
INT8 artifact's agreement with the float model too, ``<agreement>_fp32``) and the task's metrics on the eval split. Once every
artifact of the stage exists, all of them are timed together, interleaved, per batch size
(``measure.py``), and the stage's gates (speed-up against fp32, size on disk) are checked.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, create_model, field_validator

from .. import registry
from ..artifacts import Artifact, Precision, disk_full_cause
from ..errors import ConfigError, ExportError, InputError, MissingDependencyError, PruneflowError
from ..evaluate import evaluate_runtime
from ..export import deploy_hosts
from ..export.forms import needs_vnni
from ..gates import ArtifactGates, GateResult, artifact_gates
from ..inputs import as_numpy, call, take, trim
from ..recipe.models import list_of, normalise_target_list, target_union
from ..recipe.rules import quantized_before
from ..runtime import host_info
from ..runtime.timing import DEFAULT_RUNS, DEFAULT_THREADS, DEFAULT_WARMUP
from ..stage import Stage, StageConfig, StageResult, StrictModel, Target
from ..tasks import ReadOutput, Task
from .export_choice import MARGIN, choose_precisions
from .measure import (Opened, ParityLimits, batched, default_limits, open_for, parity_gate, parity_metrics, reference_outputs,
                      runtime_advice, time_all)

__all__ = ["ExportConfig", "ExportStage", "failed_artifact", "parity_metrics"]

log = logging.getLogger("pruneflow")


def _disk_nearly_full(folder: Path, state) -> bool:
    """After a target failed: whether the disk it wrote to has less room left than the model's weights take
    (plus 1 MB), i.e. the failure was the disk's, whatever the writer said."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return False
    weights = sum(p.numel() * p.element_size() for p in state.model.parameters())
    return free < weights + 1_000_000


class ParitySpec(StrictModel):
    samples: int = Field(default=256, ge=1, description="Eval samples compared between torch and the artifact.")
    max_abs_diff: float | None = Field(default=None, gt=0, description="Largest allowed absolute difference of any output (default: 1e-3 for fp32, 0.05 for fp16, none for int8).")
    min_cosine: float | None = Field(default=None, ge=0, le=1, description="Smallest allowed mean per-sample cosine similarity of outputs (of the whole arrays for one or two outputs per "
                                      "sample; default: 0.9999 fp32, 0.999 fp16, 0.99 int8; an OpenVINO artifact run in the plugin's default "
                                      "bf16 is held to at most 0.999, an INT8 one to 0.989: both errors add).")
    agreement: float | None = Field(
        default=None, ge=0,
        description="Limit on the task's agreement figure between torch's outputs and the artifact's (its `agreement`: "
        "classification's is the share of equal top-1 predictions, a minimum; default: 0.99 fp32, 0.98 fp16, 0.95 int8, "
        "in OpenVINO's default bf16 at most 0.98, 0.93 for INT8). A minimum where the figure's higher is better, a maximum "
        "where lower is.")
    min_top1_agreement: float | None = Field(default=None, ge=0, le=1, description="Classification's name for `agreement`: "
                                             "the smallest allowed share of equal top-1 predictions.")

    def limits(self, precision: str, computed_in: str | None = None, task: Task | None = None) -> ParityLimits:
        """Limits for an artifact's precision, run with inference precision ``computed_in`` (OpenVINO's
        ``bf16`` default, say; see ``measure.default_limits``), on ``task``'s outputs; a value set in the recipe wins."""
        default = default_limits(precision, computed_in, task)
        set_here = self.model_dump(include={"max_abs_diff", "min_cosine"}, exclude_none=True)
        agreement = self.agreement if self.agreement is not None else self.min_top1_agreement
        if agreement is not None:
            set_here["agreement"] = agreement
        return default._replace(**set_here)


class LatencySpec(StrictModel):
    batch_sizes: list[int] = Field(default=[1, 32], min_length=1, description="Batch sizes to time (a static-batch artifact is timed at batch 1 only).")
    runs: int = Field(default=DEFAULT_RUNS, ge=1, le=10_000, description="Timed repetitions per batch size (after warm-up); each runs every artifact of the stage once, in turn. "
                      "Median, p90 and p99 come from them (with fewer than 100 runs p99 is close to the slowest run).")
    warmup: int = Field(default=DEFAULT_WARMUP, ge=0, description="Untimed runs of each artifact first.")
    threads: int | None = Field(default=DEFAULT_THREADS, ge=1, description="Runtime threads while timing (1 gives stable numbers; null: the runtime's default). `pruneflow bench` has the same defaults.")


class ChoiceSpec(StrictModel):
    """How a target that delivers one artifact chooses it (``export_choice.py``)."""

    margin: float = Field(
        default=MARGIN, ge=0, lt=1,
        description="An INT8 artifact is delivered only when it is at least this much faster (0.02: 2 %) than the best float "
        "artifact of its target at every served batch size, both timed interleaved as deployed; otherwise the float one "
        "(fp32, which OpenVINO runs in bf16 by default where the CPU has it, or a bf16 IR) is delivered. 0: the fastest.")
    batch_sizes: list[int] | None = Field(
        default=None, min_length=1,
        description="The batch sizes the artifacts are served at, where the choice compares them (default: every batch size "
        "`latency` times). Each must be timed by `latency.batch_sizes`.")


class ExportConfig(StageConfig):
    type: Literal["export"] = Field(default="export", description="Export the model to deployable formats.")
    targets: list[Any] = Field(
        description="Targets to build: names (`onnx`) or mappings with options (`{type: onnx, opset: 17}`).", min_length=1
    )
    precisions: list[Precision] | None = Field(
        default=None, min_length=1,
        description="Numeric precisions to write. Left out (the default): `fp32`, and `int8` where a `ptq` stage, or a `qat` "
        "stage ending in int8, comes before and `latency` times the artifacts; each target then delivers one artifact, the "
        "fastest that holds the gates on this host at the batch sizes served, never slower than the runtime's default float "
        "(INT8 only where it is `choice.margin` faster at every served batch, else FP32; see `choice`); the others stay "
        "in the run folder, and report.md (table `precision chosen`, headline) says what decided it. Named: each is written "
        "and delivered (a target's `precision: auto` still chooses), and where INT8 loses to float on this host, report.md "
        "and its headline say so. `int8` needs a `ptq` stage, or a `qat` stage ending in int8, before export; "
        "its artifacts hold that stage's quantization parameters and are compared with the quantized torch model. `bf16`: "
        "the openvino target's IR with fp16-stored weights whose deployment record pins OpenVINO's bf16 inference "
        "precision (computed in bf16 where the CPU has AVX-512 BF16 or AMX, in f32 elsewhere); onnxruntime's CPU "
        "provider has no bf16 kernels, so the onnx target does not write it.",
    )
    evaluate: bool = Field(default=True, description="Measure each artifact's task metrics (classification: accuracy) on the eval "
                           "split in its own runtime.")
    parity: ParitySpec = Field(default_factory=ParitySpec, description="Torch-vs-artifact parity check and its limits.")
    latency: LatencySpec | None = Field(
        default_factory=LatencySpec,
        description="Latency timing (null = skip): after every artifact is built and checked, all of them are timed together, "
        "interleaved, per batch size; OpenVINO artifacts both with the plugin's default inference precision and with f32 forced.",
    )
    choice: ChoiceSpec = Field(
        default_factory=ChoiceSpec,
        description="How a target delivering one artifact (precisions left out, or `precision: auto`) chooses it: the margin "
        "INT8 must win by and the batch sizes served. The choice (precision, INT8 form, OpenVINO hint) is recorded in "
        "manifest.json (`choices`) and `optimize --resume` reuses it, so a resumed run writes the same bytes; "
        "`--resume --retime` measures again.")
    gates: ArtifactGates = Field(
        default_factory=ArtifactGates,
        description="Gates on every artifact of the stage: speed-up against the fp32 artifact of its target, size on disk. "
        "A failed one exits 1, names the gate, the artifact and the value, and marks the artifact (kept on disk).",
    )

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
    def _unique_precisions(cls, value: list | None) -> list | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("a precision is listed twice")
        return value

    def written(self, quantized: bool) -> list[str]:
        """The stage's precisions: as named, else fp32 and (a quantized model, timed artifacts) int8."""
        if self.precisions is not None:
            return list(self.precisions)
        return ["fp32", "int8"] if quantized and self.latency is not None else ["fp32"]

    def of_target(self, target, writes: tuple[str, ...], quantized: bool) -> list[str]:
        """What ``target`` (its config) writes: its own list, else the stage's (left out: those it can write)."""
        if self.precisions is None:
            return list(target.precisions) if target.precisions else [p for p in self.written(quantized) if p in writes]
        return [p for p in self.precisions if p in (target.precisions or self.precisions)]

    def delivers_one(self, target) -> bool:
        """Whether ``target`` (its config) delivers one chosen artifact: `precision: auto`, or nothing named."""
        return getattr(target, "precision", None) == "auto" or (self.precisions is None and not target.precisions)

    def resolved(self, quantized: bool) -> "ExportConfig":
        """A copy with the precisions left out filled in (what doctor builds)."""
        if self.precisions is not None:
            return self
        named = [p for t in self.targets for p in (getattr(t, "precisions", None) or [])]
        return self.model_copy(update={"precisions": list(dict.fromkeys(self.written(quantized) + named))})


class ExportStage(Stage[ExportConfig]):
    Config = ExportConfig
    #: What it builds depends on the recipe's ``deploy`` (the serving CPUs its INT8 form and hint are chosen for), which
    #: the pipeline therefore adds to its resume key.
    serves_hosts = True
    #: What an earlier run of this stage chose (``{"host": ..., "targets": {TARGET: {"delivered", "int8_form",
    #: "int8_hint"}}}``, manifest.json's ``choices``), set by the pipeline under ``--resume`` when the stage's key is
    #: unchanged (None: choose by measuring). Taken again, a run writes the bytes the earlier one wrote.
    recorded_choices: dict[str, Any] | None = None
    #: What this run chose, per target, filled as it chooses: the pipeline writes it into manifest.json (``choices``),
    #: also when the stage fails part-way, so a resumed run takes the same forms again.
    choices: dict[str, Any] | None = None

    @classmethod
    def config_model(cls) -> type[ExportConfig]:
        """The config with `targets` typed as the union of every registered target's config."""
        return create_model(
            "ExportConfig",
            __base__=ExportConfig,
            targets=(list_of(target_union()), Field(min_length=1, description=ExportConfig.model_fields["targets"].description)),
        )

    def make_targets(self) -> list[tuple[str, Target]]:
        """``(name, target)`` for each target of the stage, built from its settings, in the order they run."""
        made = [(t.type, registry.targets.get(t.type)(t)) for t in self.config.targets]
        order = {n: i for i, (n, _) in enumerate(made)}
        # Targets that consume another target's artifact (e.g. OpenVINO from ONNX) come after it.
        made.sort(key=lambda nt: any(dep in order for dep in nt[1].depends_on))
        return made

    @classmethod
    def recipe_rules(cls, config, index, recipe):
        """Each target writes each precision asked for (``Target.precisions``), and int8 has a quantized
        model to write: a `ptq` stage, or a `qat` stage ending in int8, before this export (unless every target
        writing it quantizes itself, ``Target.quantizes_itself``); then each target's own ``recipe_rules``."""
        quantized = quantized_before(recipe, index)
        named = config.precisions is not None
        for t, target in enumerate(config.targets):
            cls_ = registry.targets.get(target.type)
            writes = cls_.precisions
            yield from cls_.recipe_rules(target, config.of_target(target, writes, quantized), recipe, index,
                                         ("stages", index, "targets", t))
            own = target.precisions is not None
            loc = ("stages", index, "targets", t, "precisions") if own else ("stages", index, "precisions")
            for i, precision in enumerate(target.precisions or config.precisions or []):
                if named and precision not in config.precisions:
                    yield ConfigError((*loc, i), f"{precision} is not among the stage's precisions", value=precision,
                                      hint=f"a target writes some of the stage's precisions ({', '.join(config.precisions)}); add it there")
                elif precision not in writes:
                    yield ConfigError((*loc, i), f"target {target.type!r} cannot write {precision}", value=precision,
                                      hint=f"{target.type} writes {', '.join(writes)}" + ("" if own else
                                           f"; give it its own list: `{{type: {target.type}, precisions: [{', '.join(w for w in writes if w in config.precisions)}]}}`"))
        int8_from_model = [t for t in config.targets if "int8" in (t.precisions or config.precisions or [])
                           and not registry.targets.get(t.type).quantizes_itself]
        if int8_from_model and not quantized:
            t = int8_from_model[0]
            loc = (("stages", index, "precisions", config.precisions.index("int8")) if named and not t.precisions else
                   ("stages", index, "targets", config.targets.index(t), "precisions", t.precisions.index("int8")))
            yield ConfigError(
                loc, "int8 needs a quantized model, and no stage before this export quantizes it", value="int8",
                hint="add a `ptq` stage (no training) or a `qat` stage whose schedule ends in an int8 phase before `export`",
            )
        for t, target in enumerate(config.targets):
            if getattr(target, "precision", None) == "auto" and config.latency is None:
                yield ConfigError(("stages", index, "targets", t, "precision"), "precision: auto picks the fastest artifact "
                                  "by the stage's timing, and `latency` is null", value="auto",
                                  hint="remove `latency: null`, or pin the precisions with `precisions:`")
        yield from cls._host_rules(config, index, recipe)
        timed = config.latency.batch_sizes if config.latency else []
        for i, bs in enumerate(config.choice.batch_sizes or []):
            if bs not in timed:
                yield ConfigError(("stages", index, "choice", "batch_sizes", i), f"batch size {bs} is not timed by this "
                                  "stage", value=bs, hint=f"add it to latency.batch_sizes ({', '.join(map(str, timed)) or 'none'})")
        yield from cls._gate_rules(config, index, quantized)

    @classmethod
    def _host_rules(cls, config, index, recipe):
        """A pinned INT8 form that needs VNNI, for serving CPUs of which one has none (``deploy.cpu``, ``--for``): the
        file would compute another model there, so the recipe is refused rather than warned about."""
        hosts = getattr(getattr(recipe, "deploy", None), "cpu", None)
        for t, target in enumerate(config.targets):
            form = getattr(target, "form", "auto")
            if form == "auto" or "cpu" not in getattr(target, "int8_forms", ["cpu"]):
                continue
            wrong = deploy_hosts.form_conflict(form, hosts)
            if wrong:
                yield ConfigError(("stages", index, "targets", t, "form"), f"the {form} INT8 form needs VNNI or AMX on x86, "
                                  f"and `deploy.cpu` names {', '.join(wrong)} (no VNNI: its int8 kernels add u8 x s8 products "
                                  "in int16 pairs, which this form can saturate)", value=form,
                                  hint="pin `form: u8s8` (exact on every CPU) or leave `form: auto`, or serve on CPUs with "
                                  "VNNI only (`deploy.cpu`, `optimize --for`)")

    @classmethod
    def _gate_rules(cls, config, index, quantized: bool = False):
        """The stage's `gates:` can be checked: a speed-up needs fp32 and latency, names known targets and batch sizes."""
        gates, loc = config.gates, ("stages", index, "gates")
        if gates.min_speedup is not None and "fp32" not in config.written(quantized):
            yield ConfigError((*loc, "min_speedup"), "min_speedup compares each artifact with the fp32 artifact of its target, "
                              "and this stage writes no fp32", value=gates.min_speedup, hint="add fp32 to the stage's precisions")
        if gates.min_speedup is not None and config.latency is None:
            yield ConfigError((*loc, "min_speedup"), "min_speedup needs latency timing, and `latency` is null",
                              value=gates.min_speedup, hint="remove `latency: null` (or the gate)")
        names = [t.type for t in config.targets]
        for i, name in enumerate(gates.targets or []):
            if name not in names:
                yield ConfigError((*loc, "targets", i), f"{name!r} is not a target of this stage", value=name,
                                  hint=f"targets here: {', '.join(names)}")
        timed = config.latency.batch_sizes if config.latency else []
        for i, bs in enumerate(gates.batch_sizes or []):
            if bs not in timed:
                yield ConfigError((*loc, "batch_sizes", i), f"batch size {bs} is not timed by this stage", value=bs,
                                  hint=f"add it to latency.batch_sizes ({', '.join(map(str, timed)) or 'none'})")

    def doctor(self, state, ctx) -> list:
        """`pruneflow doctor`: every target and precision built for real and run on one batch (``export_doctor.py``)."""
        from .export_doctor import export_checks

        if self.config.precisions is None:  # the precisions left out, as the run would write them
            resolved = type(self)(self.config.resolved(state.handle.quantized), self.id, self.index)
            return export_checks(resolved, state, ctx)
        return export_checks(self, state, ctx)

    def onnx_export(self) -> dict:
        """What a target of this stage asks of every ONNX the stage exports (the onnx target's ``opset`` and
        ``exporter``; {} without one), the ones the openvino and tensorrt targets export for themselves included."""
        return next((asked for t in self.config.targets if (asked := t.onnx_export())), {})

    def preflight(self, ctx) -> list[str]:
        """Each target's toolchain (what it writes was checked with the recipe, see ``recipe_rules``)."""
        notes = []
        for _, target in self.make_targets():
            notes += target.preflight()
        return notes

    def run(self, state, ctx) -> StageResult:
        cfg = self.config
        result = StageResult()
        opened: list[Opened] = []
        state = reading_view(state)
        quantized = bool(state.handle.quantized)
        recorded = (self.recorded_choices or {}).get("targets") or {}
        hosts = ctx.recipe.deploy.cpu
        self.choices = {"host": host_key(), "deploy_cpu": hosts, "targets": {}}
        targets = [(name, self._pinned(name, target, recorded.get(name) or {}, hosts)) for name, target in self.make_targets()]
        emulate = deploy_hosts.needs_avx2_emulation(hosts)
        for name, target in targets:
            # export/<target>/ for the usual single export stage; a second one gets export/<its id>/<target>/.
            out_dir = ctx.subdir("export", *([name] if self.id == "export" else [self.id, name]))
            for precision in cfg.of_target(target.config, type(target).precisions, quantized):
                for artifact in self._build(name, target, precision, out_dir, state, ctx, list(result.artifacts)):
                    if artifact.status == "failed":  # the vendor tool ran and refused: exit 1, its files kept
                        result.gates.append(GateResult(f"{artifact.label}.build", False, "; ".join(artifact.notes)
                                                       or f"{name} {precision} failed"))
                    if artifact.status == "built":
                        self._form_choice(name, target, artifact, recorded.get(name) or {})
                        artifact.metrics["size_mb"] = (artifact.size_bytes or 0) / 1e6
                        checked = self._check(artifact, target, state, ctx)
                        result.gates += checked[1]
                        if emulate and artifact.precision == "int8":
                            result.gates += self._emulated_avx2(artifact, state, ctx)
                        if checked[0].executors:
                            opened.append(checked[0])
                    result.artifacts.append(artifact)
            for table, rows in target.tables.items():
                if rows:  # (a form taken from the record was not timed: no rows)
                    result.tables.setdefault(table, []).extend(rows)
        if cfg.latency and opened:
            with tempfile.TemporaryDirectory(prefix="pruneflow-start-") as tmp:
                start = self._start_lanes(state, ctx, Path(tmp))
                self._time(opened + start, state, ctx)
            result.tables["start_latency"] = _start_rows(start, cfg.latency.batch_sizes)
            if emulate:
                self._time_emulated_avx2([o.artifact for o in opened], state, ctx)
        result.gates += artifact_gates(cfg.gates, [a for a in result.artifacts if a.status == "built"],
                                       cfg.latency.batch_sizes if cfg.latency else [])
        if cfg.latency:
            self._choose(targets, result, recorded)
        result.tables["host"] = [host_record(cfg.latency.threads if cfg.latency else None)]
        result.tables["served on"] = [deploy_hosts.served_on(a, hosts) for a in result.artifacts
                                      if a.status == "built" and a.target and a.metrics.get("precision_chosen") != 0.0]
        return result

    def _choose(self, targets: list[tuple[str, Target]], result: StageResult, recorded: dict[str, Any]) -> None:
        """Per target delivering one artifact, the one it delivers (``export_choice.py``); the others are checked."""
        cfg = self.config
        assert cfg.latency is not None
        one = [name for name, target in targets if cfg.delivers_one(target.config)]
        explicit = [name for name, target in targets if getattr(target.config, "precision", None) == "auto"]
        served = cfg.choice.batch_sizes or cfg.latency.batch_sizes
        result.gates, rows = choose_precisions(
            one, result.artifacts, result.gates, served, margin=cfg.choice.margin,
            checked_targets=[name for name, _ in targets], explicit=explicit,
            recorded={name: (r["delivered"], r.get("why") or "") for name, r in recorded.items() if r.get("delivered")})
        if rows:
            result.tables["precision chosen"] = rows
        for a in result.artifacts:
            if a.metrics.get("precision_chosen") == 1.0 and a.target:
                row = next((r for r in rows if r["artifact"] == a.label and r["choice"].startswith("chosen")), {})
                taken = row.get("choice") == "chosen (recorded)" and (recorded.get(a.target) or {}).get("why")
                why = taken or row.get("why", "")  # a choice taken again keeps the reason it was made for
                (self.choices or {}).setdefault("targets", {}).setdefault(a.target, {}).update(delivered=a.label, why=why)

    def _pinned(self, name: str, target: Target, recorded: dict[str, Any], hosts: list[str] | None = None) -> Target:
        """``target`` with `auto` settings pinned: to what an earlier run chose by measuring (``recorded``: nothing is
        timed again, and the files come out as that run wrote them), else to what the serving CPUs (``hosts``, None:
        unknown) leave to choose (``deploy_hosts``: ``u8s8`` unless every one has VNNI; f32 where none computes bf16)."""
        from_record, for_hosts = {}, {}
        if getattr(target.config, "form", None) == "auto":
            form, why = deploy_hosts.int8_form_for(hosts)
            if recorded.get("int8_form") and form in (None, recorded["int8_form"]):  # (one the hosts allow)
                from_record["form"] = recorded["int8_form"]
            elif form is not None:
                for_hosts["form"] = (form, why)
        if getattr(target.config, "int8_hint", None) == "auto":
            if recorded.get("int8_hint"):
                from_record["int8_hint"] = recorded["int8_hint"]
            else:
                hint, why = deploy_hosts.int8_hint_for(hosts)
                if hint is not None:
                    for_hosts["int8_hint"] = (hint, why)
        updates = {**from_record, **{k: v for k, (v, _) in for_hosts.items()}}
        if not updates:
            return target
        pinned = type(target)(target.config.model_copy(update=updates))
        pinned.from_record = from_record  # type: ignore[attr-defined]
        pinned.for_hosts = for_hosts  # type: ignore[attr-defined]
        return pinned

    def _form_choice(self, name: str, target: Target, artifact: Artifact, recorded: dict[str, Any]) -> None:
        """Record the INT8 form (and OpenVINO hint) ``artifact`` was written in; one taken from ``recorded`` says so."""
        if artifact.deployment is not None and "runtime" in artifact.deployment and artifact.deployment["runtime"] is None:
            del artifact.deployment["runtime"]  # asks nothing of the runtime: absent, as in every fp32 record
        if artifact.precision != "int8" or artifact.form == "tensorrt":
            return
        for setting, (value, why) in (getattr(target, "for_hosts", None) or {}).items():
            if setting == "form":
                artifact.metrics["int8_form"] = value
                artifact.notes[:] = [n for n in artifact.notes if not n.startswith(f"INT8 form {value}: set in the recipe")]
                artifact.notes.append(f"INT8 form {value}, chosen for the serving CPUs without timing: {why}")
            else:
                artifact.notes.append(f"OpenVINO {setting} {value}, chosen for the serving CPUs without timing: {why}")
        pinned = getattr(target, "from_record", None)
        if pinned:
            form = pinned.get("form") or artifact.metrics.get("int8_form")
            if form:
                artifact.metrics["int8_form"] = form
            # the target saw a pinned form and hint: its own note would say the recipe set them
            artifact.notes[:] = [n for n in artifact.notes if not n.startswith(f"INT8 form {form}: set in the recipe")]
            host = (self.recorded_choices or {}).get("host")
            elsewhere = f", measured on another host ({host.get('cpu')})" if isinstance(host, dict) and host != host_key() else ""
            settings = ", ".join(f"{k} {v}" for k, v in pinned.items())
            artifact.notes.append(f"{settings}: the choice of the run this one resumed (manifest.json `choices`{elsewhere}), "
                                  "taken again without timing so the file is the one that run wrote; `--retime` measures again")
            if form and needs_vnni(form):  # what forms.record_choice says of a form it chose by timing
                artifact.notes.append(f"the {form} form needs an x86 CPU with VNNI or AMX (or a non-x86 one): without them "
                                      "its int8 kernels can saturate; pin `form: u8s8` to build for such a host")
        chose = {k: artifact.metrics[k] for k in ("int8_form", "int8_hint") if artifact.metrics.get(k)}
        if chose:
            (self.choices or {}).setdefault("targets", {}).setdefault(name, {}).update(chose)

    def _emulated_avx2(self, artifact: Artifact, state, ctx) -> list[GateResult]:
        """An INT8 IR built for a named AVX2-only CPU, run in OpenVINO capped at AVX2 (``deploy_hosts.emulate_avx2``)
        against the quantized torch model: the ``LABEL.parity_emulated_avx2`` gate, under the int8 parity limits.
        onnxruntime has no such cap (MLAS picks kernels by CPUID): an ONNX gets a note, its form being exact by
        construction. One that cannot run under the cap gets a note (emulation has its own failures), no gate."""
        if artifact.form == "tensorrt":
            return []  # TensorRT's, not a CPU's
        if artifact.kind == "onnx":
            artifact.notes.append("not checked under AVX2 emulation: onnxruntime's MLAS picks its kernels from CPUID and "
                                  "has no instruction-set cap; its INT8 form is exact on AVX2 by construction (u8s8)")
            return []
        if artifact.kind != "openvino" or len(state.task.output_names) != 1:
            return []
        x = trim(take(state.data.eval.x, slice(0, self.config.parity.samples)))  # the samples `_check` compares
        try:
            got, kernels = deploy_hosts.emulate_avx2(ctx.run_dir / artifact.path, as_numpy(x))
        except Exception as exc:  # noqa: BLE001 - the emulation's own failure is reported, not the artifact's
            artifact.notes.append(f"not checked under AVX2 emulation (OpenVINO, ONEDNN_MAX_CPU_ISA=AVX2): {exc}")
            ctx.reporter.warning(f"{self.id}: {artifact.label} could not run under AVX2 emulation: {exc}")
            return []
        parity = parity_metrics(reference_outputs(state.model, x, state.task), got, state.task)
        suffix, agreement = "_emulated_avx2", state.task.agreement.name
        artifact.metrics.update({f"{k}{suffix}": v for k, v in parity.items()})
        artifact.metrics[f"agreement{suffix}"] = parity.get(agreement, parity["cosine"])  # (the served-on table's)
        artifact.metrics[f"{agreement}_fp32{suffix}"] = parity_metrics(  # and with the float model, as `_check` does
            reference_outputs(state.handle.float_module(), x, state.task), got, state.task)[agreement]
        ran = ", ".join(f"{layer} {'/'.join(p)}" for layer, p in kernels.items())
        artifact.notes.append(f"emulated AVX2 (OpenVINO with ONEDNN_MAX_CPU_ISA=AVX2, f32 hint, kernels {ran}): cosine "
                              f"{parity['cosine']:.6f} with the quantized torch model on {len(got)} eval samples "
                              "(figures `*_emulated_avx2`)")

        class _Emulated:
            label = "openvino, emulated AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, f32)"

        limits = self.config.parity.limits("int8", "f32", state.task)
        return [parity_gate(artifact, suffix, _Emulated(), parity, bool(np.isfinite(got).all()), limits)]  # type: ignore[arg-type]

    def _build(self, name: str, target: Target, precision: str, out_dir, state, ctx, upstream: list[Artifact]) -> list[Artifact]:
        """The artifacts of one target and precision; one that cannot be built is a ``failed`` artifact with the
        error in its notes (the stage then fails its ``<label>.build`` gate, exit 1), never the end of the stage:
        the other targets and precisions are still built and measured."""
        ctx.reporter.info(f"{self.id}: building {name} {precision}")
        target.upstream = upstream  # what this stage built before: a target may convert it (OpenVINO INT8 from ONNX)
        target.onnx_export = self.onnx_export()
        target.latency = self.config.latency  # how this stage times: a target choosing a form by measuring does the same
        try:
            built = target.build(state, ctx, out_dir, precision)
        except (InputError, MissingDependencyError):
            raise  # the recipe or the machine is wrong: no other artifact would fare better
        except Exception as exc:  # noqa: BLE001 - reported on the artifact, with the target named
            if getattr(target.config, "required", False) or disk_full_cause(exc) is not None:
                raise  # the recipe says this target must build (ascend); a full disk fails every target: exit 4
            if _disk_nearly_full(out_dir, state):  # OpenVINO's writer says only "basic_ios::clear: iostream error"
                raise OSError(errno.ENOSPC, f"No space left on device ({name} {precision}: {type(exc).__name__}: {exc})",
                              str(out_dir)) from exc
            error = exc if isinstance(exc, PruneflowError) else ExportError(f"{name} {precision} export failed: {type(exc).__name__}: {exc}")
            log.warning("%s: %s %s failed: %s", self.id, name, precision, error)
            ctx.reporter.warning(f"{self.id}: {name} {precision} failed: {error.message}")
            built = failed_artifact(ctx.run_dir, out_dir, name, precision, error)
        artifacts = built if isinstance(built, list) else [built]
        for artifact in artifacts:
            if artifact.parent is None:  # a target converting another's artifact names that one
                artifact.parent = state.model_artifact.path if state.model_artifact else f"source:{state.model_key}"
        return artifacts

    def _check(self, artifact: Artifact, target: Target, state, ctx) -> tuple[Opened, list[GateResult]]:
        """Parity against torch and the task's metrics, in every way the artifact is run (see ``measure.Opened``)."""
        cfg = self.config
        path = ctx.run_dir / artifact.path
        static = not getattr(target.config, "dynamic_batch", True)
        checks = open_for(artifact, target, path, threads=None)
        if not checks:
            return Opened(artifact), []
        x = trim(take(state.data.eval.x, slice(0, cfg.parity.samples)))
        # fp32/fp16 artifacts come from the float view of the model, int8 ones from the quantized model itself.
        source = state.model if artifact.precision == "int8" else state.handle.float_module()
        ref = reference_outputs(source, x, state.task)
        # An INT8 artifact is also held against the float model, in the task's agreement figure: matching the
        # quantized torch model exactly says nothing of what quantization did (a ranker's predicted CTR can drift
        # while its AUC holds).
        float_ref = reference_outputs(state.handle.float_module(), x, state.task) if artifact.precision == "int8" else None
        agreement = state.task.agreement.name
        gates = []
        for suffix, executor in checks.items():
            run = batched(executor, static)
            got = np.asarray(run(as_numpy(x)), dtype=np.float32)
            parity = parity_metrics(ref, got, state.task)
            artifact.metrics.update({f"{k}{suffix}": v for k, v in parity.items()})
            if float_ref is not None:
                artifact.metrics[f"{agreement}_fp32{suffix}"] = parity_metrics(float_ref, got, state.task)[agreement]
            artifact.metrics[f"runtime{suffix}"] = executor.label
            computed_in = executor.info.get("inference_precision")
            if computed_in:
                artifact.metrics[f"inference_precision{suffix}"] = computed_in
            limits = cfg.parity.limits(artifact.precision or "fp32", computed_in, state.task)
            gates.append(parity_gate(artifact, suffix, executor, parity, bool(np.isfinite(got).all()), limits))
            if cfg.evaluate:
                measured = evaluate_runtime(run, state.data.eval, state.task, ctx.recipe.data.eval_batch_size,
                                            ctx.reporter, description=f"{artifact.label} eval ({executor.label})")
                names = [m.name for m in state.task.metrics] + [f for f in state.task.figures if f in measured]
                artifact.metrics.update({f"{name}{suffix}": measured[name] for name in names})
        advice = runtime_advice(artifact, state.task)
        if advice:
            artifact.notes.append(advice)
        timed = open_for(artifact, target, path, cfg.latency.threads) if cfg.latency else {}
        if cfg.latency and static and any(bs != 1 for bs in cfg.latency.batch_sizes):
            artifact.notes.append("static batch 1: latency timed at batch 1 only")
        return Opened(artifact, timed, static), gates

    def _start_lanes(self, state, ctx, tmp: Path) -> list[Opened]:
        """The model the run started from (``headline.py``), as FP32 ONNX (and IR, when this stage builds one) in
        ``tmp``, opened in the runtimes the artifacts run in: the headline's latency ratios are then timed side by
        side with them. [] when no stage compressed the model, or when it cannot be exported (said in the log)."""
        from ..export.onnx import export_onnx
        from ..inputs import to

        start = getattr(state, "start", None)
        targets = [name for name, _ in self.make_targets() if name in ("onnx", "openvino")]
        if start is None or not targets or self.config.latency is None:
            return []
        view = reading_view(dataclasses.replace(state, handle=start.handle))
        paths = {"onnx": tmp / "start.onnx"}
        try:
            export_onnx(view.handle.float_module(), to(state.example_input, "cpu"), paths["onnx"],
                        output_name=state.task.output_name)
            if "openvino" in targets:
                import openvino as ov

                ov.save_model(ov.convert_model(str(paths["onnx"])), str(tmp / "start.xml"))
                paths["openvino"] = tmp / "start.xml"
        except Exception as exc:  # noqa: BLE001 - the headline then goes without latency; the artifacts are unaffected
            log.warning("%s: the starting model could not be exported for timing: %s", self.id, exc)
            return []
        lanes = []
        for name in targets:
            artifact = Artifact(path=f"(start) {paths[name].name}", kind="start", producer=self.id, target=name,
                                precision="fp32", form="start")
            executors = open_for(artifact, None, paths[name], self.config.latency.threads)  # type: ignore[arg-type]
            if executors:
                lanes.append(Opened(artifact, executors))
        return lanes

    def _time_emulated_avx2(self, artifacts: list[Artifact], state, ctx) -> None:
        """With an AVX2 CPU named on a richer host: every OpenVINO IR timed again with oneDNN capped at AVX2 (f32, one
        thread, in turn; ``deploy_hosts.time_avx2``), as ``latency_b{bs}_median_ms_emulated_avx2``, so the delivery
        choice (``export_choice``) asks INT8 to win there too. onnxruntime has no such cap: its files are not timed so."""
        lat = self.config.latency
        irs = [a for a in artifacts if a.status == "built" and a.path.endswith(".xml")]
        if lat is None or len(irs) < 2:
            return
        ctx.reporter.info(f"{self.id}: timing {len(irs)} OpenVINO IRs again under AVX2 emulation (ONEDNN_MAX_CPU_ISA=AVX2)")
        try:
            found = deploy_hosts.time_avx2([ctx.run_dir / a.path for a in irs],
                                           _emulated_feeds(state.data.eval.x, lat.batch_sizes), runs=lat.runs)
        except Exception as exc:  # noqa: BLE001 - the emulation's own failure is reported, the choice made without it
            ctx.reporter.warning(f"{self.id}: AVX2 emulation could not time the IRs ({exc}); the choice is this host's")
            return
        for a in irs:
            for bs, ms in found.get(str(ctx.run_dir / a.path), {}).items():
                a.metrics[f"latency_b{bs}_median_ms_emulated_avx2"] = ms
            a.notes.append("timed under AVX2 emulation (OpenVINO, oneDNN capped at AVX2, f32 hint, one thread): "
                           + ", ".join(f"batch {bs} {ms:.3g} ms" for bs, ms in sorted(found.get(str(ctx.run_dir / a.path), {}).items())))

    def _time(self, opened: list[Opened], state, ctx) -> None:
        lat = self.config.latency
        assert lat is not None
        runtimes = sum(len(o.executors) for o in opened)
        ctx.reporter.info(f"{self.id}: timing {len(opened)} artifacts ({runtimes} runtimes) interleaved, batch sizes "
                          f"{', '.join(map(str, lat.batch_sizes))}, {lat.runs} runs each")
        time_all(opened, state.data.eval.x, lat.batch_sizes, warmup=lat.warmup, runs=lat.runs,
                 progress=lambda description, total: ctx.reporter.progress(f"{self.id}: {description}", total=total))
        for o in opened:
            o.artifact.metrics["latency_threads"] = lat.threads or 0


def _emulated_feeds(x: Any, batch_sizes: list[int]) -> dict[int, Any]:
    """Fresh numpy batches of the eval split, one per batch size, as the export stage times them."""
    from ..runtime.timing import fresh_batch

    return {bs: fresh_batch(x, bs) for bs in batch_sizes}


def _start_rows(lanes: list[Opened], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """The starting model's timings, one row per target, way of running it and batch size (``headline.py``)."""
    rows = []
    for lane in lanes:
        m = lane.artifact.metrics
        for suffix, executor in lane.executors.items():
            for bs in batch_sizes:
                if f"latency_b{bs}_median_ms{suffix}" in m:
                    rows.append({"target": lane.artifact.target, "runtime": executor.label, "suffix": suffix, "batch": bs,
                                 "p50_ms": m[f"latency_b{bs}_median_ms{suffix}"], "p90_ms": m[f"latency_b{bs}_p90_ms{suffix}"]})
    return rows


def reading_view(state):
    """``state`` as the targets see it: when the model returns more than one tensor (a tuple, a dict, an HF-style
    output), its handle gives modules that return what the task reads (``tasks.ReadOutput``), so each artifact
    has the task's one output; ``state`` itself otherwise."""
    module = state.handle.float_module()
    with torch.no_grad():
        out = call(module.eval(), take(state.example_input, slice(0, 1)))
    if isinstance(out, torch.Tensor):
        return state
    task = state.task
    return dataclasses.replace(state, handle=state.handle.evolve(reader=lambda m: ReadOutput(m, task)))


def failed_artifact(run_dir: Path, out_dir: Path, target: str, precision: str, error: PruneflowError,
                    form: str | None = None) -> Artifact:
    """The record of an artifact that could not be built: no file (``path`` names the folder it was due in),
    status ``failed``, the error and its hint in ``notes``."""
    folder = Path(out_dir).resolve().relative_to(Path(run_dir).resolve()).as_posix()
    message = error.message + (f" (hint: {error.hint})" if error.hint else "")
    return Artifact(path=folder, kind=target, producer="export", status="failed", target=target, precision=precision,
                    form=form, notes=[message])


def host_key() -> dict[str, Any]:
    """The host a choice was measured on (CPU model, ISA flags), as manifest.json's ``choices`` record it."""
    cpu = host_info()["cpu"]
    return {"cpu": cpu.get("model"), "isa": sorted(cpu.get("isa") or [])}


def host_record(threads: int | None) -> dict[str, Any]:
    """One row for the stage's ``host`` table: where its latency was measured (``runtime.host_info``)."""
    host = host_info()
    versions = host["versions"]
    return {
        "cpu": host["cpu"]["model"], "arch": host["cpu"]["arch"], "isa": " ".join(host["cpu"]["isa"]),
        "usable_cpus": host["cpu"]["usable_cpus"], "threads": threads or "runtime default",
        "gpus": ", ".join(host.get("gpus", [])), "os": host["os"],
        "versions": ", ".join(f"{k} {versions[k]}" for k in ("onnxruntime", "openvino", "tensorrt", "torch") if k in versions),
    }
