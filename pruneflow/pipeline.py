"""Run a recipe: preflight → run directory → stages in order → gates → manifest, metrics, report.

    loaded = load_recipe("recipes/quickstart.yaml")
    result = run_recipe(loaded, out="runs")
    result.exit_code  # 0 ok, 1 a gate failed
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from . import registry
from .artifacts import Artifact, Manifest, run_dir_lock, sha256_file, tool_versions, write_json_atomic, write_text_atomic
from .checkpoint import PickledCheckpointError, load_checkpoint, save_checkpoint
from .context import Reporter, RunContext, RunState
from .errors import EXIT_GATE_FAILED, EXIT_OK, ConfigError, InputError, PruneflowError, StageError
from .gates import GateResult, check_gates
from .handle import ModelHandle
from .inputs import Inputs, take, to, trim
from .recipe import LoadedRecipe, dump_recipe
from .recipe.rules import stage_ids
from .results import RunResult, StageRecord, flat_metrics
from .runtime import host_info
from .stage import Stage

log = logging.getLogger("pruneflow")


def plan_stages(loaded: LoadedRecipe) -> list[Stage]:
    """Instantiate every stage with its id (its `name`, else its type, numbered when repeated).

    The ids are unique: ``load_recipe`` rejected a recipe that names two stages alike (``recipe/rules.py``).
    """
    stages: list[Stage] = []
    for index, (cfg, stage_id) in enumerate(zip(loaded.recipe.stages, stage_ids(loaded.recipe.stages))):
        stage = registry.stages.get(cfg.type)(cfg, stage_id, index)
        stage.before = tuple(stages)
        stages.append(stage)
    return stages


def preflight(loaded: LoadedRecipe, stages: list[Stage], out: str | Path | None = None) -> list[str]:
    """Checks that need neither model nor data but the machine: --out, factory import, files, toolchains.

    Returns notes; a ConfigError (a file the recipe names is absent) comes out located, FILE:LINE.
    """
    from .models import resolve_factory
    from .preflight import check_out_dir

    recipe = loaded.recipe
    if out is not None:
        check_out_dir(Path(out), recipe.name)
    with loaded.locating():
        resolve_factory(recipe.model.factory)
        files = [("model", "checkpoint")] + [("data", name) for name in ("path", "train", "eval")]
        for section, name in files:
            value = getattr(getattr(recipe, section), name)
            if value and not (Path(value).is_file() if name == "checkpoint" else Path(value).exists()):
                raise ConfigError((section, name), f"file not found: {value}",
                                  hint="a relative path is relative to the recipe file that sets it")
        notes = []
        for stage in stages:
            notes += stage.preflight(None)
    return notes


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
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    return _hash(r.model.model_dump(mode="json"), ckpt, code, r.data.model_dump(mode="json"), data_files, r.seed, r.task)


def _stat(path: str) -> list:
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [(f.as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]


def run_recipe(loaded: LoadedRecipe, out: str | Path = "runs", reporter: Reporter | None = None,
               resume: bool = False) -> RunResult:
    """Run every stage of ``loaded`` into ``OUT/NAME``, holding that folder's lock (``run_dir_lock``) throughout:
    a second run into the same folder stops with exit 2 before touching it.

    The data and the model are loaded and checked (``preflight.py``) before the lock and the run folder: a
    refused input writes nothing and leaves an earlier run in ``OUT/NAME`` as it was.
    """
    reporter = reporter or Reporter()
    stages = plan_stages(loaded)
    preflight(loaded, stages, out)
    with loaded.locating():
        inputs = load_inputs(loaded, stages, reporter)
    with run_dir_lock(Path(out) / loaded.recipe.name, notify=reporter.warning):
        return _run_locked(loaded, stages, inputs, Path(out), reporter, resume)


class RunInputs:
    """What a run starts from, loaded and checked before anything is written: data, model, device, example."""

    def __init__(self, data: Any, model: torch.nn.Module, device: str, example: "Inputs"):
        self.data, self.model, self.device, self.example = data, model, device, example


def load_inputs(loaded: LoadedRecipe, stages: list[Stage], reporter: Reporter) -> RunInputs:
    """Load the data and build the model, then check them together (``preflight.py``); raise before any write."""
    from .data import load_data
    from .models import build_model, input_shape_for
    from .preflight import PREFLIGHT_BATCH, check_labels, check_model_on_batch, check_shape_matches_data

    recipe = loaded.recipe
    device = ("cuda" if torch.cuda.is_available() else "cpu") if recipe.device == "auto" else recipe.device
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device: cuda was requested but torch sees no CUDA device", hint="set device: auto or cpu")
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    reporter.info(f"loading data ({recipe.data.format})")
    data = load_data(recipe.data, recipe.seed, with_train=any(s.needs_train_split for s in stages))
    labels = {"eval": data.eval.y} if data.train is None else {"train": data.train.y, "eval": data.eval.y}
    check_labels(labels, data.num_classes, data.class_names, recipe.data.label_column)
    model = build_model(recipe.model)
    shape = input_shape_for(recipe.model, data.input_shape)
    check_shape_matches_data(shape, data.input_shape, explicit=recipe.model.input_shape is not None)
    check_model_on_batch(model, take(data.eval.x, slice(0, PREFLIGHT_BATCH)), recipe.model.factory, data.num_classes)
    if isinstance(data.eval.x, dict):  # several inputs: the first real sample (text cut to its own length)
        example: Inputs = trim(take(data.eval.x, slice(0, 1)))
    else:
        example = torch.zeros((1,) + tuple(shape), dtype=data.eval.x.dtype)
    return RunInputs(data, model, device, example)


def _run_locked(loaded: LoadedRecipe, stages: list[Stage], inputs: RunInputs, out: Path, reporter: Reporter,
                resume: bool) -> RunResult:
    recipe = loaded.recipe
    run_dir = prepare_run_dir(out, recipe.name, resume)
    write_text_atomic(run_dir / "recipe.resolved.yaml", dump_recipe(recipe))
    handler = _attach_log(run_dir)
    manifest = Manifest(run_dir, recipe.name)
    manifest.host = host_info()
    manifest.write()
    try:
        # A rule that needs the model or data raises ConfigError(stage.loc(...)): reported at its FILE:LINE.
        with loaded.locating(), _disk_full_as_error():
            result = _run(loaded, stages, inputs, run_dir, manifest, reporter, resume)
    except KeyboardInterrupt:
        manifest.status = "interrupted"
        manifest.write()
        raise
    except BaseException:
        manifest.status = "failed"
        try:
            manifest.write()
        except OSError as exc:  # a full disk: the error on its way out is the one to report
            log.warning("could not mark the manifest failed: %s", exc)
        raise
    finally:
        logging.getLogger("pruneflow").removeHandler(handler)
        handler.close()
    manifest.status = "complete" if result.exit_code == EXIT_OK else "gate_failed"
    manifest.write()
    return result


def _run(loaded: LoadedRecipe, stages: list[Stage], inputs: RunInputs, run_dir: Path, manifest: Manifest,
         reporter: Reporter, resume: bool) -> RunResult:
    from .report import write_reports
    from .tasks import make_task

    recipe, data, device = loaded.recipe, inputs.data, inputs.device
    ctx = RunContext(run_dir=run_dir, recipe=recipe, recipe_file=loaded.file, seed=recipe.seed, device=device,
                     reporter=reporter, resume=resume)
    state = RunState(handle=ModelHandle(inputs.model.to(device)), task=make_task(recipe.task), data=data,
                     model_key=source_key(loaded), example_input=to(inputs.example, device))
    records: list[StageRecord] = []
    key = state.model_key
    for stage in stages:
        key = _hash(key, stage.config.model_dump(mode="json"), tool_versions())
        record = _resume(stage, key, state, ctx, manifest) if resume else None
        if record is None:
            record = _run_stage(stage, key, state, ctx, manifest, len(stages))
        records.append(record)
        state.metrics[stage.id] = record.metrics
    flat = flat_metrics(records, manifest.artifacts)
    gates = [GateResult(**g) for r in records for g in r.gates] + check_gates(recipe.gates, flat)
    exit_code = EXIT_GATE_FAILED if any(not g.passed for g in gates) else EXIT_OK
    result = RunResult(run_dir, exit_code, records, list(manifest.artifacts), gates, flat)
    write_json_atomic(run_dir / "metrics.json", {
        "stages": {r.id: r.metrics for r in records},
        "artifacts": {a.path: a.metrics for a in manifest.artifacts},
        "flat": flat,
        "gates": [g.as_dict() for g in gates],
        "tables": {r.id: r.tables for r in records if r.tables},
    })
    write_reports(result, loaded, data, state)
    return result


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _disk_full_as_error() -> Iterator[None]:
    """A full disk (or quota) while the run writes is a StageError naming the file, not an internal error.

    Exit 4, like any stage that could not finish: the atomic writers leave no half-written file, finished
    stages stay recorded and ``--resume`` continues once there is space.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise disk_full(exc, exc.filename) from exc


def disk_full(exc: OSError, path: object) -> StageError:
    return StageError(f"disk full at {path or 'the run folder'}: {exc.strerror or exc}; nothing half-written was left "
                      "(files are written under a temporary name and renamed when complete)",
                      hint="free space on that disk (or choose another --out), then run again with --resume: "
                      "finished stages are kept")


def _run_stage(stage: Stage, key: str, state: RunState, ctx: RunContext, manifest: Manifest, total: int) -> StageRecord:
    stage_dir = ctx.stage_dir(stage.index, stage.id)
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
    except (PruneflowError, KeyboardInterrupt):
        raise
    except SystemExit as exc:  # user or plugin code calling sys.exit: a failed stage, never a silent exit
        raise StageError(f"stage {stage.id} ({stage.config.type}) called sys.exit({exc.code!r})",
                         hint="code run by a stage (a model's forward, a plugin) must raise an exception, not exit") from exc
    except Exception as exc:  # noqa: BLE001 - wrapped so the CLI maps it to exit 4 with the stage named
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
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            raise disk_full(exc, path) from exc
        checkpoint = Artifact.from_file(ctx.run_dir, path, kind="checkpoint", producer=stage.id,
                                        precision=state.handle.precision, form=state.handle.form,
                                        parent=state.model_artifact.path if state.model_artifact else f"source:{state.model_key}",
                                        metrics=dict(result.metrics))
        artifacts.insert(0, checkpoint)
        state.model_artifact = checkpoint
    seconds = time.perf_counter() - start
    record = StageRecord(stage.id, stage.config.type, stage.index, seconds, result.metrics, key,
                         artifacts=[a.path for a in artifacts], tables=result.tables,
                         gates=[g.as_dict() for g in result.gates])
    write_json_atomic(stage_dir / "stage.json", {**record.as_dict(), "artifact_records": [a.as_dict() for a in artifacts]})
    manifest.add_stage(record.as_dict(), artifacts)
    state.artifacts.extend(artifacts)
    ctx.reporter.stage_finished(stage.id, seconds, result.metrics)
    return record


def _resume(stage: Stage, key: str, state: RunState, ctx: RunContext, manifest: Manifest) -> StageRecord | None:
    """Reuse a completed stage whose key matches and whose files are intact; None to run it again."""
    stage_file = ctx.run_dir / "stages" / f"{stage.index + 1:02d}-{stage.id}" / "stage.json"
    if not stage_file.is_file():
        return None
    try:
        saved = json.loads(stage_file.read_text())
    except ValueError:
        return None
    if saved.get("key") != key or saved.get("status") != "done":
        return None
    artifacts = [Artifact.from_record(a) for a in saved.get("artifact_records", [])]
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
                         gates=saved.get("gates", []))
    manifest.add_stage(record.as_dict(), artifacts)
    state.artifacts.extend(artifacts)
    ctx.reporter.stage_finished(stage.id, 0.0, record.metrics, skipped=True)
    return record


def _attach_log(run_dir: Path) -> logging.Handler:
    (run_dir / "logs").mkdir(exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / "pruneflow.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pruneflow")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler
