"""Run a recipe: preflight → run directory → stages in order → gates → manifest, metrics, report.

The run folder's files, log and full-disk errors are ``run_folder.py``'s; resume keys and reusing a finished stage
``resume.py``'s; what happens before the first stage ``prepare.py``'s.

    loaded = load_recipe("recipes/quickstart.yaml")
    result = run_recipe(loaded, out="runs")
    result.exit_code  # 0 ok, 1 a gate failed
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .artifacts import Artifact, Manifest, disk_full_cause, run_dir_lock, write_json_atomic, write_text_atomic
from .checkpoint import save_checkpoint
from .context import Reporter, RunContext, RunState
from .errors import EXIT_GATE_FAILED, EXIT_OK, PruneflowError, StageError
from .gates import GateResult, check_gates
from .handle import ModelHandle
from .headline import baseline_notes, capture_start, headline_gate_of
from .inputs import to
from .recipe import LoadedRecipe, dump_recipe
from .results import RunResult, StageRecord, attach_partial, error_record, flat_metrics
from .resume import (earlier_choices, host_part, hosts_before, keep_choices, recorded_for, resume_stage, source_key,
                     stage_key)
from .run_folder import (attach_log, disk_full, disk_full_as_error, earlier_run, forget_earlier, prepare_run_dir, snapshot,
                         stale_files, sweep_stale, written_since)
from .runtime import host_info
from .stage import Stage
# What a run does before its first stage lives a layer below (doctor.py does the same); re-exported for the CLI.
from .prepare import RunInputs as RunInputs, load_inputs as load_inputs
from .prepare import plan_stages as plan_stages, preflight as preflight

log = logging.getLogger("pruneflow")


def run_recipe(loaded: LoadedRecipe, out: str | Path = "runs", reporter: Reporter | None = None,
               resume: bool = False, retime: bool = False) -> RunResult:
    """Run every stage of ``loaded`` into ``OUT/NAME``, holding that folder's lock (``run_dir_lock``) throughout:
    a second run into the same folder stops with exit 2 before touching it.

    ``resume``: reuse the stages an earlier run finished, and the choices it made by measuring (manifest.json's
    ``choices``: the precision, INT8 form and hint the export delivers), so the files come out as that run's;
    ``retime`` with it measures those choices again.

    The data and the model are loaded and checked (``preflight.py``) before the lock and the run folder: a
    refused input writes nothing and leaves an earlier run in ``OUT/NAME`` as it was.
    """
    reporter = reporter or Reporter()
    stages = plan_stages(loaded)
    preflight(loaded, stages, out)
    with loaded.locating():
        inputs = load_inputs(loaded, stages, reporter)
    with run_dir_lock(Path(out) / loaded.recipe.name, notify=reporter.warning):
        return _run_locked(loaded, stages, inputs, Path(out), reporter, resume, retime)


def _run_locked(loaded: LoadedRecipe, stages: list[Stage], inputs: RunInputs, out: Path, reporter: Reporter,
                resume: bool, retime: bool = False) -> RunResult:
    recipe = loaded.recipe
    replaced = earlier_run(out / recipe.name) if not resume else None
    if replaced:
        reporter.warning(f"replacing the earlier run in {out / recipe.name} ({replaced}); --resume continues it instead, "
                         "another --out keeps both")
    run_dir = prepare_run_dir(out, recipe.name, resume)
    earlier = earlier_choices(run_dir) if resume else {}  # before this run's manifest replaces that run's
    write_text_atomic(run_dir / "recipe.resolved.yaml", dump_recipe(recipe))
    handler = attach_log(run_dir)
    earlier_hosts, host_changed = hosts_before(run_dir, reporter) if resume else ([], False)  # said in the log too
    manifest = Manifest(run_dir, recipe.name)
    manifest.host = host_info()
    manifest.earlier_hosts, manifest.host_changed = earlier_hosts, host_changed
    manifest.task = inputs.task.summary()
    manifest.choices = dict(earlier)  # kept for the stages this run reuses; replaced for those it runs
    manifest.write()
    progress = Progress()
    try:
        # A rule that needs the model or data raises ConfigError(stage.loc(...)): reported at its FILE:LINE.
        with loaded.locating(), disk_full_as_error():
            result = _run(loaded, stages, inputs, run_dir, manifest, reporter, resume, progress,
                          {} if retime else earlier)
        if resume:
            sweep_stale(run_dir, progress.records)
    except BaseException as exc:
        manifest.status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        record_failure(exc, loaded, inputs, manifest, progress, resume)
        raise
    finally:
        logging.getLogger("pruneflow").removeHandler(handler)
        handler.close()
    manifest.status = "complete" if result.exit_code == EXIT_OK else "gate_failed"
    manifest.write()
    return result


@dataclass
class Progress:
    """How far a run got: the records of the finished stages, the stage running now and the run folder's files
    when it started (what it wrote is what changed since)."""

    records: list[StageRecord] = field(default_factory=list)
    stage: Stage | None = None
    before: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    key: str = ""  # the resume key of the stage running now


def record_failure(exc: BaseException, loaded: LoadedRecipe, inputs: RunInputs, manifest: Manifest,
                   progress: Progress, resume: bool) -> None:
    """After a failure: the error (message, hint, exit code) in logs/pruneflow.log; the manifest's ``failure``
    with the files the failed stage left; metrics.json and report.md with the stages that finished; and the
    partial RunResult attached to ``exc`` for ``--json``. Never masks ``exc``: a problem here is only logged."""
    from .report import write_reports

    run_dir, error, stage = manifest.run_dir, error_record(exc), progress.stage
    where = f"stage {stage.id} ({stage.config.type})" if stage else "the run"
    if isinstance(exc, KeyboardInterrupt):
        log.warning("%s interrupted (exit %d)", where, error["exit_code"])
    else:
        log.error("%s failed (exit %d) with %s: %s%s", where, error["exit_code"], error["type"], error["message"],
                  f"\nFix: {error['hint']}" if error["hint"] else "", exc_info=not isinstance(exc, PruneflowError))
    try:
        keep_choices(manifest, stage, progress.key)  # what the failed stage chose before it stopped: --resume takes it
        left = written_since(run_dir, progress.before) if stage else []
        earlier = (stale_files(run_dir, progress.records, left) if resume else None) or []
        manifest.failure = {"stage": stage.id if stage else None, "stage_type": stage.config.type if stage else None,
                            "error": error, "files": left, "earlier_run_files": earlier}
        manifest.write()
        records = progress.records
        result = RunResult(run_dir, error["exit_code"], list(records), list(manifest.artifacts), [],
                           flat_metrics(records, manifest.artifacts), inputs.task.summary())
        write_json_atomic(run_dir / "metrics.json", {**metrics_payload(result), "failure": manifest.failure})
        write_reports(result, loaded, inputs.data, None, failure=manifest.failure)
        attach_partial(exc, result)
    except Exception:  # noqa: BLE001 - e.g. a full disk: the error on its way out is the one to report
        log.warning("could not record the failure in the run folder", exc_info=True)


def metrics_payload(result: RunResult) -> dict[str, Any]:
    """metrics.json: every stage's metrics, every artifact's, the flat namespace the gates read, the gates, tables."""
    return {
        "task": result.task,
        "stages": {r.id: r.metrics for r in result.stages},
        "artifacts": {a.path: a.metrics for a in result.artifacts},
        "flat": result.metrics,
        "gates": [g.as_dict() for g in result.gates],
        "headline_gate": result.headline_gate,
        "baseline_notes": result.baseline_notes,
        "tables": {r.id: r.tables for r in result.stages if r.tables},
        "start": result.start,
        "headline": result.headline_rows(),
    }


def _run(loaded: LoadedRecipe, stages: list[Stage], inputs: RunInputs, run_dir: Path, manifest: Manifest,
         reporter: Reporter, resume: bool, progress: Progress, earlier: dict[str, Any] | None = None) -> RunResult:
    from .report import write_reports

    recipe, data, device = loaded.recipe, inputs.data, inputs.device
    ctx = RunContext(run_dir=run_dir, recipe=recipe, recipe_file=loaded.file, seed=recipe.seed, device=device,
                     reporter=reporter, resume=resume)
    # Which parameters no pretrained weights set travels as the handle's plain metadata (never on the module).
    meta = {"new_parameters": inputs.new_parameters} if inputs.new_parameters else {}
    state = RunState(handle=ModelHandle(inputs.model.to(device), meta=meta), task=inputs.task, data=data,
                     model_key=source_key(loaded), example_input=to(inputs.example, device))
    records = progress.records
    reporter.run_started(recipe.name, state.task.summary())
    key = state.model_key
    for stage in stages:
        key = stage_key(key, stage, recipe)
        progress.stage, progress.before, progress.key = stage, snapshot(run_dir), key
        if stage.compresses and state.start is None:  # the model entering the first compression: the run's start
            state.start = capture_start(stage.id, state, ctx, state.task.headline.name)
        reusable = resume and not (manifest.host_changed and host_part(stage))  # timed elsewhere: measure here
        record = resume_stage(stage, key, state, ctx, manifest) if reusable else None
        if record is None:
            if stage.records_choices:  # a stage that chooses by measuring: what the earlier run chose
                stage.recorded_choices = recorded_for(stage, key, earlier or {}) if resume else None
            record = _run_stage(stage, key, state, ctx, manifest, len(stages), progress.before)
            keep_choices(manifest, stage, key)
            manifest.write()
        records.append(record)
        state.metrics[stage.id] = record.metrics
    progress.stage = None
    ids = {stage.id for stage in stages}
    manifest.choices = {k: v for k, v in manifest.choices.items() if k in ids}  # a stage the recipe no longer has
    flat = flat_metrics(records, manifest.artifacts)
    gates = [GateResult(**g) for r in records for g in r.gates] + check_gates(recipe.gates, flat, state.task)
    exit_code = EXIT_GATE_FAILED if any(not g.passed for g in gates) else EXIT_OK
    result = RunResult(run_dir, exit_code, records, list(manifest.artifacts), gates, flat, state.task.summary(),
                       start=state.start.summary() if state.start is not None else None)
    result.headline_gate = headline_gate_of(result, recipe.gates, state.task)
    result.baseline_notes = baseline_notes(result, recipe.gates, state.task)
    write_json_atomic(run_dir / "metrics.json", metrics_payload(result))
    write_reports(result, loaded, data, state)
    return result


def _run_stage(stage: Stage, key: str, state: RunState, ctx: RunContext, manifest: Manifest, total: int,
               before: dict[str, tuple[int, int, int]]) -> StageRecord:
    stage_dir = ctx.stage_dir(stage.index, stage.id)
    forget_earlier(stage_dir, ctx.run_dir)
    ctx.reporter.stage_started(stage.id, stage.config.type, stage.index, total)
    start = time.perf_counter()
    try:
        stage.setup(state, ctx)
        try:
            result = stage.run(state, ctx)
        except BaseException:
            try:
                stage.teardown(state, ctx)
            except Exception:  # noqa: BLE001 - the run's own error is the one to report
                log.exception("stage %s: teardown failed after an error", stage.id)
            raise
        stage.teardown(state, ctx)
    except (PruneflowError, KeyboardInterrupt) as exc:
        if isinstance(exc, PruneflowError) and disk_full_cause(exc) is not None and "disk full at" not in exc.message:
            raise disk_full(exc, None, ctx.run_dir) from exc  # an ExportError over a full disk: exit 4, not its hint
        raise
    except SystemExit as exc:  # user or plugin code calling sys.exit: a failed stage, never a silent exit
        raise StageError(f"stage {stage.id} ({stage.config.type}) called sys.exit({exc.code!r})",
                         hint="code run by a stage (a model's forward, a plugin) must raise an exception, not exit") from exc
    except Exception as exc:  # noqa: BLE001 - wrapped so the CLI maps it to exit 4 with the stage named
        if disk_full_cause(exc) is not None:
            raise disk_full(exc, None, ctx.run_dir) from exc
        raise StageError(f"stage {stage.id} ({stage.config.type}) failed: {type(exc).__name__}: {exc}") from exc
    artifacts = list(result.artifacts)
    for artifact in artifacts:
        artifact.producer = stage.id
    if result.handle is not None:  # a new model (e.g. quantized): it is the one checkpointed and handed on
        state.handle = result.handle
    if stage.modifies_model or result.handle is not None:
        path = stage_dir / "model.pt"
        try:
            save_checkpoint(state.handle, path)
        except (OSError, RuntimeError) as exc:  # torch's writer raises RuntimeError("file write failed")
            if disk_full_cause(exc) is None:
                raise
            raise disk_full(exc, path) from exc
        checkpoint = Artifact.from_file(ctx.run_dir, path, kind="checkpoint", producer=stage.id,
                                        precision=state.handle.precision, form=state.handle.form,
                                        parent=state.model_artifact.path if state.model_artifact else f"source:{state.model_key}",
                                        metrics=dict(result.metrics))
        _pretrained_folder(state, stage_dir, checkpoint)
        artifacts.insert(0, checkpoint)
        state.model_artifact = checkpoint
    seconds = time.perf_counter() - start
    files = sorted(set(written_since(ctx.run_dir, before)) | {f for a in artifacts for f in [a.path, *a.files]})
    record = StageRecord(stage.id, stage.config.type, stage.index, seconds, result.metrics, key,
                         artifacts=[a.path for a in artifacts], tables=result.tables,
                         gates=[g.as_dict() for g in result.gates], files=files)
    write_json_atomic(stage_dir / "stage.json", {**record.as_dict(), "artifact_records": [a.as_dict() for a in artifacts]})
    manifest.add_stage(record.as_dict(), artifacts)
    state.artifacts.extend(artifacts)
    ctx.reporter.stage_finished(stage.id, seconds, result.metrics)
    return record


def _pretrained_folder(state: RunState, stage_dir: Path, checkpoint: Artifact) -> None:
    """Beside the checkpoint of a float `transformers` model whose shapes still fit its class: ``hf/``, a
    ``from_pretrained`` folder (pruneflow/zoo/hf.py); the checkpoint's notes say where, or why there is none.
    The first checkpoint's notes also name the parameters the pretrained folder lacked (a new classifier head)."""
    from .zoo.hf import save_pretrained_folder

    new: list[str] = state.handle.meta.get("new_parameters") or []
    if state.model_artifact is None and new:  # the first checkpoint
        checkpoint.notes.append("new, not in the pretrained folder (randomly initialised, then trained from this stage on): "
                                + ", ".join(new))
    if state.handle.quantized:
        return
    why = save_pretrained_folder(state.handle.module, stage_dir / "hf")
    where = (stage_dir / "hf").relative_to(stage_dir.parent.parent)
    if why is None:
        checkpoint.notes.append(f"also a transformers from_pretrained folder: {where}")
    elif why:
        checkpoint.notes.append(f"no transformers from_pretrained folder: {why}")


