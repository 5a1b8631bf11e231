"""What a run does before its first stage, and `pruneflow doctor` and `validate` too: the stages planned from the
recipe, the machine checked (``preflight``: --out, the factory, files, toolchains), the data and the model loaded
and checked together (``load_inputs``). Nothing here writes.

    stages = plan_stages(loaded)
    notes = preflight(loaded, stages, out="runs")
    inputs = load_inputs(loaded, stages, reporter)   # data, model, device, example, task
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from . import registry
from .context import Reporter
from .errors import ConfigError, InputError, MissingDependencyError
from .inputs import Inputs, take, trim
from .recipe import LoadedRecipe
from .recipe.code import CodeTrust
from .recipe.models import RecipeBase
from .recipe.rules import stage_ids
from .stage import Stage
from .tasks import Task


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
    """Checks that need the machine but neither model nor data: --out, factories (parsed), files, toolchains.

    Returns notes; a ConfigError (a file the recipe names is absent) comes out located, FILE:LINE.
    """
    from .preflight import check_out_dir

    recipe = loaded.recipe
    if out is not None:
        check_out_dir(Path(out), recipe.name)
    factory_notes, problems = factory_problems(loaded)
    files = [("model", "checkpoint")] + [("data", name) for name in ("path", "train", "eval")]
    for section, name in files:
        value = getattr(getattr(recipe, section), name)
        if value and not (Path(value).is_file() if name == "checkpoint" else _exists(value, section == "data"
                                                                                          and recipe.data.stream is not None)):
            problems.append(ConfigError((section, name), f"file not found: {value}", hint=path_hint(loaded, (section, name))))
    problems += _static_batch_problems(recipe)
    notes = list(factory_notes)
    for stage in stages:  # each stage's own files (a calibration source, a request log) and toolchains
        try:
            notes += stage.preflight(None)
        except MissingDependencyError as exc:  # exit 3, at the line of the stage that asks for the toolchain
            source, line = loaded.locate(stage.loc())
            exc.message = f"{f'{source}:{line}' if line else source}  stages.{stage.index} ({stage.config.type}): {exc.message}"
            exc.args = (exc.message,)
            raise
        except ConfigError as exc:
            if (exc.hint or "").startswith("a relative path is relative"):  # a stage's file: say where it was resolved
                exc.hint = path_hint(loaded, exc.loc)
            problems.append(exc)
    if problems:  # every missing file at once, each at its line
        raise loaded.error(problems)
    return notes


def _exists(path: str, glob_allowed: bool) -> bool:
    """A path exists; a streamed data source may be a glob of shards, which then matches at least one file."""
    if glob_allowed and any(ch in path for ch in "*?["):
        import glob

        return any(Path(f).is_file() for f in glob.iglob(path, recursive=True))
    return Path(path).exists()


def _static_batch_problems(recipe: RecipeBase) -> list[ConfigError]:
    """Batch sizes whose input cannot fit in memory, where one sample's shape is known without the data (``model.
    input_shape``, a zoo model's): float32 inputs of that shape (``preflight.batch_memory_problems``)."""
    import math

    from .models import input_shape_for
    from .preflight import batch_memory_problems

    try:
        shape = input_shape_for(recipe.model, None)
    except InputError:
        return []  # known from the data: checked when it is loaded (load_inputs)
    return batch_memory_problems(recipe, 4 * math.prod(shape))


def path_hint(loaded: LoadedRecipe, loc: tuple) -> str:
    """How a relative path at ``loc`` was resolved: against the recipe file that wrote it, or, given with ``--set``,
    against the working directory (the hint had said "the recipe file" for both)."""
    source, _ = loaded.locate(loc)
    if source.startswith("--set"):
        return f"a relative path given with --set is relative to the working directory ({Path.cwd()})"
    return f"a relative path is relative to the recipe file that sets it ({source})"


def factory_problems(loaded: LoadedRecipe) -> tuple[list[str], list[ConfigError]]:
    """``model.factory`` and each stage's ``teacher.factory`` name a zoo model or a callable whose file exists,
    parses and defines it, and which the recipe may run (``recipe/code.py``); nothing is imported, so none of the
    user's code runs (``models.check_factory_statically``). Returns (notes for what only the run can confirm,
    located problems), which ``preflight`` lists with the rest."""
    specs: list[tuple[tuple, str]] = [(("model", "factory"), loaded.recipe.model.factory)]
    teachers = [(i, getattr(getattr(stage, "teacher", None), "factory", None)) for i, stage in enumerate(loaded.recipe.stages)]
    specs += [(("stages", i, "teacher", "factory"), factory) for i, factory in teachers if isinstance(factory, str)]
    notes, problems = [], []
    for loc, factory in specs:
        try:
            notes += [note for note in [_check_one_factory(loc, factory, loaded.trust)] if note]
        except ConfigError as exc:
            problems.append(exc)
    for index, metric in enumerate(loaded.recipe.metrics):  # the recipe's own metrics: found as a factory is
        try:
            notes += [note for note in [_check_one_metric(("metrics", index, "fn"), metric, loaded.trust)] if note]
        except ConfigError as exc:
            problems.append(exc)
    return notes, problems


def _check_one_metric(loc: tuple, spec: Any, trust: CodeTrust | None) -> str | None:
    from .user_metrics import check_metric_statically

    try:
        return check_metric_statically(spec, trust)
    except InputError as exc:
        message = exc.message.removeprefix(f"model.factory {spec.fn!r}").removeprefix(f"metric {spec.fn!r}").lstrip(": ")
        raise ConfigError(loc, message, value=spec.fn, hint=exc.hint or "") from exc


def _check_one_factory(loc: tuple, factory: str, trust: CodeTrust | None) -> str | None:
    import difflib

    from .errors import key_path
    from .models import check_factory_statically
    from .zoo import ZOO

    field = key_path(loc)
    try:
        return check_factory_statically(factory, trust, field)
    except InputError as exc:
        close = difflib.get_close_matches(factory, list(ZOO), n=1) if ":" not in factory else []
        hint = f"did you mean {close[0]!r}? " if close else ""
        message = exc.message.removeprefix(f"{field} {factory!r}").lstrip(": ")
        raise ConfigError(loc, message, value=factory, hint=hint + (exc.hint or "")) from exc


class RunInputs:
    """What a run starts from, loaded and checked before anything is written: data, model, device, example."""

    def __init__(self, data: Any, model: torch.nn.Module, device: str, example: "Inputs", task: "Task",
                 new_parameters: list[str] | None = None):
        self.data, self.model, self.device, self.example, self.task = data, model, device, example, task
        #: Parameters no pretrained weights set (a new classifier head; ``models.build_model_with_new_parameters``).
        self.new_parameters = list(new_parameters or [])


def load_inputs(loaded: LoadedRecipe, stages: list[Stage], reporter: Reporter, probe_rows: int | None = None) -> RunInputs:
    """Load the data and build the model, then check them together (``preflight.py``); raise before any write.
    ``probe_rows`` (doctor, which tries one batch): a task whose targets are the model's outputs gets them for that
    many rows of each split, and the splits keep only those."""
    from .data import load_data
    from .models import build_model_with_new_parameters, input_shape_for, with_data_kwargs
    from .preflight import PREFLIGHT_BATCH, batch_memory_problems, check_model_on_batch, check_shape_matches_data, sample_bytes
    from .user_metrics import check_metrics_on_batch, recipe_task

    recipe = loaded.recipe
    device = ("cuda" if torch.cuda.is_available() else "cpu") if recipe.device == "auto" else recipe.device
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device: cuda was requested but torch sees no CUDA device", hint="set device: auto or cpu")
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    reporter.info(f"loading data ({recipe.data.format})")
    task = recipe_task(recipe)
    data = load_data(recipe.data, recipe.seed, with_train=any(s.needs_train_split for s in stages), task=task)
    too_large = batch_memory_problems(recipe, sample_bytes(data.eval.x))
    if too_large:
        raise loaded.error(too_large)
    labels = {"eval": data.eval.y} if data.train is None else {"train": data.train.y, "eval": data.eval.y}
    task.check_targets(labels, data, recipe.data.label_column)
    model_spec = recipe.model
    if data.tabular is not None:
        model_spec, filled = with_data_kwargs(model_spec, data.tabular)
        if filled:
            reporter.info("model.kwargs from data.features: " + ", ".join(f"{k}={v}" for k, v in filled.items()))
    with _at_the_model(recipe, "does not fit the model"):
        model, new_parameters = build_model_with_new_parameters(model_spec)
    shape = input_shape_for(recipe.model, data.input_shape)
    check_shape_matches_data(shape, data.input_shape, explicit=recipe.model.input_shape is not None)
    preflight_batch = take(data.eval.x, slice(0, PREFLIGHT_BATCH))
    output = check_model_on_batch(model, preflight_batch, recipe.model.factory, task.output)
    with _at_the_model(recipe):
        task.check_output(output, data.eval.y[:PREFLIGHT_BATCH], data, recipe.model.factory)
    check_metrics_on_batch(task, output, data.eval.y[:PREFLIGHT_BATCH])
    for stage in stages:  # each stage's checks on the model itself (qat/ptq: NNCF can quantize it), before any training
        for note in stage.check_model(model, preflight_batch):
            reporter.info(f"{stage.id}: {note}")
    if task.targets_from_model:
        reference_targets(data, model, task, device, recipe, reporter, probe_rows)
    if isinstance(data.eval.x, dict):  # several inputs: the first real sample (text cut to its own length)
        example: Inputs = trim(take(data.eval.x, slice(0, 1)))
    else:
        example = torch.zeros((1,) + tuple(shape), dtype=data.eval.x.dtype)
    return RunInputs(data, model, device, example, task, new_parameters)


@contextlib.contextmanager
def _at_the_model(recipe: RecipeBase, only: str = "") -> Iterator[None]:
    """A model that does not fit its checkpoint or the data is reported at the recipe line that chose it (issue 26:
    both came without FILE:LINE): ``model.checkpoint`` for the weights, ``model.kwargs`` when they are set, else
    ``model.factory``. ``only``: relocate just the errors whose message holds it (the others name their file)."""
    try:
        yield
    except ConfigError:
        raise
    except InputError as exc:
        if only not in exc.message:
            raise
        if exc.message.startswith("model.checkpoint"):
            loc: tuple = ("model", "checkpoint")
        else:
            loc = ("model", "kwargs") if recipe.model.kwargs else ("model", "factory")
        message = exc.message.removeprefix("model.checkpoint ").removeprefix("model.factory ")
        raise ConfigError(loc, message, hint=exc.hint) from exc


def reference_targets(data: Any, model: torch.nn.Module, task: "Task", device: str, recipe: "RecipeBase",
                      reporter: Reporter, rows: int | None = None) -> None:
    """Set every split's targets to the outputs of the model the recipe gives, for a task that judges a model against
    them (``Task.targets_from_model``: an embedding model's vectors). Run here, once, before any stage changes the
    model: pruning, distillation, quantization and every artifact are then measured against the original, whichever
    stage a ``--resume`` starts from. ``rows``: only the first rows of each split (doctor)."""
    from .evaluate import model_outputs
    from .splits import Split

    model.to(device)
    for role in ("train", "eval"):
        split = getattr(data, role)
        if split is None:
            continue
        if rows is not None:
            split = Split(take(split.x, slice(0, rows)), split.y[:rows])
            setattr(data, role, split)
        reporter.info(f"reference targets: the outputs of {recipe.model.factory} on the {len(split)} rows of the {role} split")
        outputs = model_outputs(model, split, task, recipe.data.eval_batch_size, device, reporter, f"reference {role}")
        split.y = task.reference_targets(outputs, role, recipe.model.factory)
