"""Run a recipe: preflight → run directory → stages in order → gates → manifest, metrics, report.

    loaded = load_recipe("recipes/quickstart.yaml")
    result = run_recipe(loaded, out="runs")
    result.exit_code  # 0 ok, 1 a gate failed
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .artifacts import (Artifact, Manifest, check_run_tree, disk_full_cause, open_run_log, run_dir_lock, run_subdir,
                        sha256_file, tool_versions, write_json_atomic, write_text_atomic)
from .checkpoint import PickledCheckpointError, load_checkpoint, save_checkpoint
from .context import Reporter, RunContext, RunState
from .errors import EXIT_GATE_FAILED, EXIT_OK, InputError, PruneflowError, StageError
from .gates import GateResult, check_gates
from .handle import ModelHandle
from .headline import baseline_notes, capture_start, headline_gate_of
from .inputs import to
from .recipe import LoadedRecipe, dump_recipe
from .results import RunResult, StageRecord, attach_partial, error_record, flat_metrics
from .runtime import host_info, timing_host
from .stage import Stage
# What a run does before its first stage lives a layer below (doctor.py does the same); re-exported for the CLI.
from .prepare import RunInputs as RunInputs, load_inputs as load_inputs
from .prepare import plan_stages as plan_stages, preflight as preflight

log = logging.getLogger("pruneflow")


def prepare_run_dir(out: Path, name: str, resume: bool) -> Path:
    run_dir = Path(out) / name
    if run_dir.exists() and not resume:
        ours = (run_dir / "recipe.resolved.yaml").exists() or (run_dir / Manifest.FILE).exists()
        if ours:
            shutil.rmtree(run_dir)
        elif any(run_dir.iterdir()):
            raise InputError(
                f"{run_dir} exists and is not a pruneflow run directory; refusing to write into it",
                hint="choose another --out, or empty that folder",
            )
    elif run_dir.exists():
        check_run_tree(run_dir)  # --resume reuses what is there: nothing in it may steer a write out of it
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _serving_part(stage: Stage, recipe: Any) -> list[Any]:
    """What a stage that chooses for the serving hosts (``serves_hosts``: export) adds to its resume key: the recipe's
    ``deploy`` (another ``--for`` builds other files); nothing for the others."""
    return [{"deploy": recipe.deploy.model_dump(mode="json")}] if getattr(stage, "serves_hosts", False) else []


def _host_part(stage: Stage) -> list[Any]:
    """What a stage whose results depend on the host (it times latency, or chooses by timing: export) adds to its
    resume key: the host it times on (``timing_host``). A ``--resume`` on another host runs such a stage again (and the
    stages after it), measuring here, instead of reusing figures and choices another machine made."""
    timed = getattr(stage, "serves_hosts", False) or getattr(stage.config, "latency", None) is not None
    return [{"host": timing_host()}] if timed else []


def source_key(loaded: LoadedRecipe) -> str:
    """Identity of the starting model and data: the input to the first stage's resume key.

    Covers the checkpoint's and a model file's content, and the data files' sizes and modification
    times (hashing gigabytes of data on every resume would cost more than it saves).
    """
    r = loaded.recipe
    ckpt = sha256_file(r.model.checkpoint) if r.model.checkpoint else None
    factory_file = r.model.factory.rsplit(":", 1)[0] if ".py:" in r.model.factory else None
    code = sha256_file(factory_file) if factory_file and Path(factory_file).is_file() else None
    data_files = [_stat(getattr(r.data, f)) for f in ("path", "train", "eval") if getattr(r.data, f)]
    return _hash(r.model.model_dump(mode="json"), ckpt, code, r.data.model_dump(mode="json"), data_files, r.seed,
                 r.task.model_dump(mode="json"))


def _stat(path: str) -> list:
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [(f.as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]


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
    run_dir = prepare_run_dir(out, recipe.name, resume)
    earlier = earlier_choices(run_dir) if resume else {}  # before this run's manifest replaces that run's
    write_text_atomic(run_dir / "recipe.resolved.yaml", dump_recipe(recipe))
    handler = _attach_log(run_dir)
    earlier_hosts, host_changed = _earlier_hosts(run_dir, reporter) if resume else ([], False)  # said in the log too
    manifest = Manifest(run_dir, recipe.name)
    manifest.host = host_info()
    manifest.earlier_hosts, manifest.host_changed = earlier_hosts, host_changed
    manifest.task = inputs.task.summary()
    manifest.choices = dict(earlier)  # kept for the stages this run reuses; replaced for those it runs
    manifest.write()
    progress = Progress()
    try:
        # A rule that needs the model or data raises ConfigError(stage.loc(...)): reported at its FILE:LINE.
        with loaded.locating(), _disk_full_as_error():
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


#: Files of the run itself rather than of a stage.
RUN_FILES = frozenset({"recipe.resolved.yaml", Manifest.FILE, "metrics.json", "report.md"})


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under the run folder but its logs -> (inode, mtime, size): a file a stage wrote (atomically:
    a new inode) is one that changed."""
    found = {}
    for path in run_dir.rglob("*"):
        rel = path.relative_to(run_dir).as_posix()
        if path.is_file() and not rel.startswith("logs/"):
            st = path.stat()
            found[rel] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return found


def written_since(run_dir: Path, before: dict[str, tuple[int, int, int]]) -> list[str]:
    """The files (but the run's own and the stage records) that are new or changed since ``before``."""
    return sorted(rel for rel, sig in snapshot(run_dir).items()
                  if before.get(rel) != sig and rel not in RUN_FILES and not rel.endswith("/stage.json"))


def stale_files(run_dir: Path, records: list[StageRecord], failed_files: list[str]) -> list[str]:
    """``--resume``: the files an earlier run left that no stage of this run wrote or reused (exports of a stage
    that ran again with other targets, what a failed stage left, the stages a recipe no longer has)."""
    keep = RUN_FILES | set(failed_files) | {f for r in records for f in r.files}
    keep |= {f"stages/{r.index + 1:02d}-{r.id}/stage.json" for r in records}
    return sorted(rel for rel in snapshot(run_dir) if rel not in keep)


def sweep_stale(run_dir: Path, records: list[StageRecord]) -> list[str]:
    """After a ``--resume`` run that completed: remove ``stale_files`` and the folders they leave empty, so the
    manifest lists exactly the files on disk. (After a failure they are kept and listed instead.)"""
    stale = stale_files(run_dir, records, [])
    remove_files(run_dir, stale)
    if stale:
        log.info("--resume: removed %d files an earlier run left: %s", len(stale), ", ".join(stale[:20]))
    return stale


def remove_files(run_dir: Path, files: list[str]) -> None:
    """Remove ``files`` (relative paths inside ``run_dir``; anything else named is left alone) and empty folders."""
    root = run_dir.resolve()
    for rel in files:
        path = run_dir / rel
        if (path.is_file() or path.is_symlink()) and path.parent.resolve().is_relative_to(root) and rel not in RUN_FILES:
            path.unlink()
    for folder in sorted((p for p in run_dir.rglob("*") if p.is_dir() and not p.is_symlink()),
                         key=lambda p: len(p.parts), reverse=True):
        if folder.name != "logs" and not any(folder.iterdir()):
            folder.rmdir()


def _earlier_hosts(run_dir: Path, reporter: Reporter) -> tuple[list[dict[str, Any]], bool]:
    """The hosts earlier runs in ``run_dir`` ran on, and whether the last one is not this one (``timing_host``): said,
    and kept in the manifest (``earlier_hosts``) rather than silently replaced. What depends on the host is then
    measured again here: the stages that time or choose by timing run again (``_host_part``; their resume key holds the
    host too), and the export's choices with them."""
    try:
        found = json.loads((run_dir / Manifest.FILE).read_text())
    except (OSError, ValueError):
        return [], False
    host = found.get("host") if isinstance(found, dict) else None
    before = [h for h in found.get("earlier_hosts") or [] if isinstance(h, dict)] if isinstance(found, dict) else []
    if not isinstance(host, dict) or timing_host(host) == timing_host():
        return before, False
    was, now = timing_host(host), timing_host()
    changed = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in now if was.get(k) != now.get(k))
    reporter.warning(f"--resume on another host ({changed}): the stages that time latency or choose by timing (export) run "
                     "again and measure here; the stages that do not depend on the host are reused. manifest.json keeps "
                     "the earlier host under `earlier_hosts`")
    return [*before, host], True


def earlier_choices(run_dir: Path) -> dict[str, Any]:
    """The ``choices`` of the manifest an earlier run left in ``run_dir`` ({} when there is none to read)."""
    try:
        found = json.loads((run_dir / Manifest.FILE).read_text()).get("choices")
    except (OSError, ValueError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}


def recorded_for(stage: Stage, key: str, earlier: dict[str, Any]) -> dict[str, Any] | None:
    """What an earlier run of ``stage`` chose by measuring, when it ran with the same resume key (same model, settings
    and tool versions); None otherwise: the stage measures."""
    found = earlier.get(stage.id)
    return found if isinstance(found, dict) and found.get("key") == key else None


def keep_choices(manifest: Manifest, stage: Stage | None, key: str) -> None:
    """The choices ``stage`` made (its ``choices``, when it has any) into the manifest, under its id, with its key."""
    made = getattr(stage, "choices", None) if stage is not None else None
    if stage is not None and isinstance(made, dict) and made.get("targets"):
        manifest.choices[stage.id] = {"key": key, **made}


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
        key = _hash(key, stage.config.model_dump(mode="json"), tool_versions(), *_serving_part(stage, recipe),
                    *_host_part(stage))
        progress.stage, progress.before, progress.key = stage, snapshot(run_dir), key
        if stage.compresses and state.start is None:  # the model entering the first compression: the run's start
            state.start = capture_start(stage.id, state, ctx, state.task.headline.name)
        reusable = resume and not (manifest.host_changed and _host_part(stage))  # timed elsewhere: measure here
        record = _resume(stage, key, state, ctx, manifest) if reusable else None
        if record is None:
            if hasattr(stage, "recorded_choices"):  # a stage that chooses by measuring: what the earlier run chose
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


@contextlib.contextmanager
def _disk_full_as_error() -> Iterator[None]:
    """A full disk (or quota) while the run writes is a StageError naming the file, not an internal error.

    Exit 4, like any stage that could not finish: the atomic writers leave no half-written file, finished
    stages stay recorded and ``--resume`` continues once there is space.
    """
    try:
        yield
    except OSError as exc:
        if disk_full_cause(exc) is None:
            raise
        raise disk_full(exc, exc.filename) from exc


def disk_full(exc: BaseException, path: object, where: Path | None = None) -> StageError:
    """Exit 4 naming the file (or the folder being written) and what is left free on that disk."""
    cause = disk_full_cause(exc) or exc
    path = path or getattr(cause, "filename", None) or where
    why = getattr(cause, "strerror", None) or str(cause).strip().splitlines()[0]
    return StageError(f"disk full at {path or 'the run folder'}: {why}{_free_space(path or where)}; nothing half-written "
                      "was left (files are written under a temporary name and renamed when complete)",
                      hint="free space on that disk (or choose another --out), then run again with --resume: "
                      "finished stages are kept")


def _free_space(path: object) -> str:
    """`` (12.0 MB free)``: what the disk holding ``path`` has left, or nothing when that cannot be told."""
    folder = Path(str(path)) if path else None
    while folder is not None and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f" ({shutil.disk_usage(folder).free / 1e6:,.1f} MB free)" if folder else ""
    except OSError:
        return ""


def _run_stage(stage: Stage, key: str, state: RunState, ctx: RunContext, manifest: Manifest, total: int,
               before: dict[str, tuple[int, int, int]]) -> StageRecord:
    stage_dir = ctx.stage_dir(stage.index, stage.id)
    _forget_earlier(stage_dir, ctx.run_dir)
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


def _forget_earlier(stage_dir: Path, run_dir: Path) -> None:
    """The stage runs again: what an earlier run of it wrote (its stage.json lists the files) is removed with that
    record, so neither is mistaken for this run's."""
    record = stage_dir / "stage.json"
    try:
        files = json.loads(record.read_text()).get("files") if record.is_file() else None
    except (ValueError, OSError, AttributeError):
        files = None
    if isinstance(files, list):
        remove_files(run_dir, [f for f in files if isinstance(f, str) and not f.endswith("stage.json")])
    record.unlink(missing_ok=True)
    run_subdir(run_dir, stage_dir.relative_to(run_dir).as_posix())


def _resume(stage: Stage, key: str, state: RunState, ctx: RunContext, manifest: Manifest) -> StageRecord | None:
    """Reuse a completed stage whose key matches and whose files are intact; None to run it again."""
    stage_file = ctx.run_dir / "stages" / f"{stage.index + 1:02d}-{stage.id}" / "stage.json"
    if not stage_file.is_file():
        return None
    try:
        saved = json.loads(stage_file.read_text())
    except ValueError:
        return None
    if saved.get("key") != key or saved.get("status") != "done" or not isinstance(saved.get("files"), list):
        return None
    try:
        artifacts = [Artifact.from_record(a) for a in saved.get("artifact_records", [])]
    except (TypeError, ValueError):  # a record of a layout this version does not write: run the stage again
        return None
    if not all(a.verify(ctx.run_dir) for a in artifacts):
        return None
    checkpoint = next((a for a in artifacts if a.kind == "checkpoint"), None)
    if stage.modifies_model and checkpoint is None:
        return None
    if checkpoint is not None:
        try:
            # The structure is applied to (a copy of) the float model in hand: the recipe's, or an earlier stage's.
            loaded = load_checkpoint(ctx.run_dir / checkpoint.path, into=state.handle.float_module())
        except PickledCheckpointError as exc:
            # Its sha256 matches the run's records, so they were edited to vouch for it: stop, load nothing.
            raise PickledCheckpointError(f"--resume: {exc.message}; {stage_file} records this file's sha256, so the "
                                         "run folder was altered after the run", hint="run without --resume (the folder "
                                         "is replaced), or use a run folder you made yourself") from exc
        except (PruneflowError, RuntimeError, ValueError, OSError) as exc:
            log.warning("stage %s: checkpoint not reusable (%s); running the stage again", stage.id, exc)
            return None
        state.handle = loaded.to(ctx.device)
        state.model_artifact = checkpoint
    try:
        stage.restore(state, ctx)
    except (PruneflowError, ValueError, OSError) as exc:
        log.warning("stage %s: saved results not reusable (%s); running the stage again", stage.id, exc)
        return None
    record = StageRecord(saved["id"], saved["type"], saved["index"], saved["seconds"], saved["metrics"], key,
                         resumed=True, artifacts=saved.get("artifacts", []), tables=saved.get("tables", {}),
                         gates=saved.get("gates", []), files=saved["files"])
    manifest.add_stage(record.as_dict(), artifacts)
    state.artifacts.extend(artifacts)
    ctx.reporter.stage_finished(stage.id, 0.0, record.metrics, skipped=True)
    return record


class _RunLog(logging.FileHandler):
    """logs/pruneflow.log, opened by ``open_run_log``: appended to, never through a link or into a planted file."""

    def _open(self):  # logging's own hook: the stream is a text file, as its default
        return os.fdopen(open_run_log(Path(self.baseFilename)), "a", encoding=self.encoding)


def _attach_log(run_dir: Path) -> logging.Handler:
    handler = _RunLog(run_subdir(run_dir, "logs") / "pruneflow.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pruneflow")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler
