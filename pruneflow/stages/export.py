"""`export`: write the model for each target and precision, then measure every artifact.

Each artifact is checked in its own runtime right after it is built: parity against the torch model it
came from (max abs diff, cosine similarity and the task's agreement figure: top-1 agreement for classes; an
INT8 artifact's agreement with the float model too, ``<agreement>_fp32``) and the task's metrics on the eval split. Once every
artifact of the stage exists, all of them are timed together, interleaved, per batch size
(``measure.py``), and the stage's gates (speed-up against fp32, size on disk) are checked.

The stage's settings and their recipe rules are in ``export_config.py``; what depends on the serving CPUs (pinned
`auto` settings, a resumed run's choices, AVX2 emulation) in ``export_hosts.py``; the delivered precision in
``export_choice.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field, create_model

from .. import registry
from ..artifacts import Artifact, disk_full_cause
from ..errors import ExportError, InputError, MissingDependencyError, PruneflowError
from ..evaluate import evaluate_runtime
from ..export import deploy_hosts
from ..gates import GateResult, artifact_gates
from ..inputs import as_numpy, call, take, trim
from ..recipe.models import list_of, target_union
from ..stage import BuildInputs, Stage, StageResult, Target
from ..tasks import ReadOutput
from .export_choice import choose_precisions
from .export_config import ExportConfig, recipe_rules
from .export_hosts import check_emulated_avx2, form_choice, host_key, host_record, pinned, time_emulated_avx2
from .measure import Opened, batched, open_for, parity_gate, parity_metrics, reference_outputs, runtime_advice, time_all

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


class ExportStage(Stage[ExportConfig]):
    Config = ExportConfig
    #: What it builds depends on the recipe's ``deploy`` (the serving CPUs its INT8 form and hint are chosen for), which
    #: the pipeline therefore adds to its resume key.
    serves_hosts = True
    records_choices = True
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
        """What each target writes and whether int8 has a quantized model to write, pinned forms against the serving
        CPUs and the gates (``export_config.recipe_rules``)."""
        return recipe_rules(config, index, recipe)

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
        made = [(name, *pinned(name, target, recorded.get(name) or {}, hosts)) for name, target in self.make_targets()]
        targets, pins = [(name, target) for name, target, _ in made], {name: p for name, _, p in made}
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
                        form_choice(name, pins[name], artifact, recorded.get(name) or {}, self.recorded_choices, self.choices)
                        artifact.metrics["size_mb"] = (artifact.size_bytes or 0) / 1e6
                        checked = self._check(artifact, target, state, ctx)
                        result.gates += checked[1]
                        if emulate and artifact.precision == "int8":
                            result.gates += check_emulated_avx2(self.id, cfg.parity, artifact, state, ctx)
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
                time_emulated_avx2(self.id, cfg.latency, [o.artifact for o in opened], state, ctx)
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
        explicit = [name for name, target in targets if target.config.precision == "auto"]
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

    def _build(self, name: str, target: Target, precision: str, out_dir, state, ctx, upstream: list[Artifact]) -> list[Artifact]:
        """The artifacts of one target and precision; one that cannot be built is a ``failed`` artifact with the
        error in its notes (the stage then fails its ``<label>.build`` gate, exit 1), never the end of the stage:
        the other targets and precisions are still built and measured."""
        ctx.reporter.info(f"{self.id}: building {name} {precision}")
        given = BuildInputs(upstream=upstream, onnx_export=self.onnx_export(), latency=self.config.latency)
        try:
            built = target.build(state, ctx, out_dir, precision, given)
        except (InputError, MissingDependencyError):
            raise  # the recipe or the machine is wrong: no other artifact would fare better
        except Exception as exc:  # noqa: BLE001 - reported on the artifact, with the target named
            if target.config.required or disk_full_cause(exc) is not None:
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
        static = target.config.static_batch()
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
        targets = [(name, target) for name, target in self.make_targets() if target.times_start]
        if start is None or not targets or self.config.latency is None:
            return []
        view = reading_view(dataclasses.replace(state, handle=start.handle))
        onnx, paths = tmp / "start.onnx", {}
        try:
            export_onnx(view.handle.float_module(), to(state.example_input, "cpu"), onnx, output_name=state.task.output_name)
            for name, target in targets:
                paths[name] = target.start_file(onnx, tmp)
        except Exception as exc:  # noqa: BLE001 - the headline then goes without latency; the artifacts are unaffected
            log.warning("%s: the starting model could not be exported for timing: %s", self.id, exc)
            return []
        lanes = []
        for name, _ in targets:
            artifact = Artifact(path=f"(start) {paths[name].name}", kind="start", producer=self.id, target=name,
                                precision="fp32", form="start")
            executors = open_for(artifact, None, paths[name], self.config.latency.threads)  # type: ignore[arg-type]
            if executors:
                lanes.append(Opened(artifact, executors))
        return lanes

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
