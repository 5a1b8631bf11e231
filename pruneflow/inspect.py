"""`pruneflow inspect`: parameters, MACs and a per-layer table for a model wherever it lives."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from .artifacts import Manifest, check_run_sizes, manifest_entries, run_file
from .errors import InputError, UsageError
from .formats import format_of

if TYPE_CHECKING:
    from .inputs import Inputs


def _run_dir_of(path: Path) -> Path | None:
    for candidate in [path, *path.parents]:
        if (candidate / Manifest.FILE).is_file() and (candidate / "recipe.resolved.yaml").is_file():
            return candidate
    return None


def load_run_model(run_dir: Path, checkpoint: Path | None = None, recipe: Path | None = None,
                   trust_code: Sequence[str] = ()) -> tuple[torch.nn.Module, tuple[int, ...] | None, str]:
    """The model of a run: ``checkpoint`` if given, else the run's latest checkpoint, else the source model.

    The model is built from ``recipe`` (the user's own) when given, else from the run's recipe.resolved.yaml,
    but then only with a zoo factory: a run folder is data anyone may have edited, and a factory it names
    (``os:system`` with ``kwargs: {command: ...}``, a ``.py`` file planted beside it) would run their code.
    """
    from .checkpoint import load_checkpoint
    from .models import build_model, input_shape_for
    from .recipe import load_recipe
    from .zoo import ZOO

    if recipe is not None:
        loaded = load_recipe(recipe, trust_code=trust_code)
    else:  # names only a zoo model (below): code the folder names is refused whatever its `trust` says
        loaded = load_recipe(run_dir / "recipe.resolved.yaml", check_code=False)
    factory = loaded.recipe.model.factory
    if recipe is None and factory not in ZOO:
        raise InputError(
            f"{run_dir / 'recipe.resolved.yaml'} names model.factory {factory!r}: pruneflow does not run code that "
            "a run folder names (whoever wrote the folder chose it)",
            hint=f"pass the recipe the run was made with, which you trust: pruneflow inspect {run_dir} --recipe RECIPE.yaml")
    model = build_model(loaded.recipe.model)
    if checkpoint is None:
        manifest = Manifest.read(run_dir)
        checkpoints = [a for a in manifest_entries(manifest) if a.get("kind") == "checkpoint"]
        if checkpoints:
            checkpoint = run_file(run_dir, checkpoints[-1].get("path"), run_dir / Manifest.FILE)
            check_run_sizes(run_dir / Manifest.FILE, [checkpoint], checkpoints[-1].get("size_bytes"))
    if checkpoint is not None:
        # A quantized checkpoint is shown through its float view: the architecture, without quantizer ranges.
        model = load_checkpoint(checkpoint, into=model).float_module()
    try:
        shape = input_shape_for(loaded.recipe.model, None)
    except InputError:
        shape = None
    what = f"checkpoint {checkpoint.relative_to(run_dir)}" if checkpoint else "source model"
    return model, shape, what


class Found:
    """A model to inspect: the module, one sample's shape (None: unknown, then --input-shape must tell), its
    dtype, and what it is (``zoo model``, ``recipe model``, ``checkpoint ...``)."""

    def __init__(self, model: torch.nn.Module, shape: tuple[int, ...] | None, kind: str,
                 dtype: torch.dtype = torch.float32, example: "Inputs | None" = None):
        self.model, self.shape, self.kind, self.dtype = model, shape, kind, dtype
        self.example = example  # a real first sample, for a model with several inputs


#: What `pruneflow inspect` reads, for a path that is not there.
SOURCES_HINT = ("check the path; inspect reads a zoo name, a factory (models.py:build), a recipe, a run directory, a checkpoint "
            "in one (or with --recipe), an .onnx file or an OpenVINO IR (.xml)")

def inspect_source(source: str, input_shape: tuple[int, ...] | None = None, recipe: Path | None = None,
                   trust_code: Sequence[str] = ()) -> dict:
    """Params, MACs and a per-layer table of whatever ``source`` names: a zoo model, a factory
    (``models.py:build``, ``package.module:fn``), a recipe (its factory and checkpoint), a run folder or a
    checkpoint in one, a checkpoint of the user's own with ``recipe`` naming its model, or an ``.onnx`` file.

        inspect_source("models.py:build", (3, 32, 32))
        inspect_source("weights.pt", recipe=Path("recipe.yaml"))
    """
    if input_shape is not None:
        _check_input_shape(input_shape)
    path = Path(source)
    fmt = format_of(path)
    graph = fmt.inspect(path) if fmt is not None else None  # a file whose format tabulates its graph (ONNX, IR)
    if graph is not None:
        return graph
    found = _find_model(source, path, recipe, trust_code)
    shape = input_shape or found.shape
    if shape is None:
        raise InputError("the model's input shape is unknown", hint="pass --input-shape, e.g. 3,32,32")
    rows, macs, params = _count(found, tuple(shape), source, use_example=input_shape is None)
    return {"source": source, "kind": found.kind, "input_shape": list(shape), "layers": rows,
            "totals": {"params": params, "macs": macs, "layers": len(rows)}}


def _find_model(source: str, path: Path, recipe: Path | None, trust_code: Sequence[str] = ()) -> Found:
    from .models import CHECKPOINT_SUFFIXES, build_model, input_shape_for
    from .recipe.models import ModelSpec
    from .zoo import ZOO

    if source in ZOO and not path.exists():
        spec = ModelSpec(factory=source)
        return Found(build_model(spec), input_shape_for(spec, None), "zoo model")
    if path.is_dir() or path.suffix in CHECKPOINT_SUFFIXES:
        if not path.exists():
            raise InputError(f"{path} does not exist", hint=SOURCES_HINT)
        run_dir = _run_dir_of(path.resolve())
        if run_dir is not None:
            model, shape, kind = load_run_model(run_dir, path.resolve() if path.is_file() else None, recipe, trust_code)
            return Found(model, shape, kind)
        if recipe is not None and path.is_file():
            return _recipe_model(recipe, checkpoint=path, trust_code=trust_code)
        raise InputError(
            f"{path} is not inside a pruneflow run directory (no manifest.json and recipe.resolved.yaml above it)",
            hint=f"for a checkpoint of your own, name the recipe that builds its model: pruneflow inspect {path} --recipe "
            "RECIPE.yaml; else inspect a run directory, a checkpoint inside one, a recipe, a factory or a zoo name")
    if path.suffix in (".yaml", ".yml"):
        return _recipe_model(path, trust_code=trust_code)
    if ":" in source:  # a factory, as a recipe's model.factory names it (here relative to the working folder)
        return Found(build_model(ModelSpec(factory=source)), None, "factory")
    raise InputError(
        f"cannot inspect {source!r}: not a run directory, checkpoint, recipe, .onnx or .xml file, factory or zoo model",
        hint=f"a factory is `path/to/file.py:function` or `package.module:function`; zoo models: {', '.join(ZOO)}",
    )


def _recipe_model(recipe: Path, checkpoint: Path | None = None, trust_code: Sequence[str] = ()) -> Found:
    """The model a recipe builds (its factory, kwargs and checkpoint, or ``checkpoint`` instead), and its input."""
    from .models import build_model, input_shape_for
    from .recipe import load_recipe

    loaded = load_recipe(recipe, trust_code=trust_code)
    spec = loaded.recipe.model
    if checkpoint is not None:
        spec = spec.model_copy(update={"checkpoint": str(checkpoint)})
    with loaded.locating():
        model = build_model(spec)
        try:
            return Found(model, input_shape_for(spec, None), "recipe model" + (f", checkpoint {checkpoint}" if checkpoint else ""))
        except InputError:
            from .data import load_data
            from .inputs import first, take, trim
            from .tasks import make_task

            data = load_data(loaded.recipe.data, loaded.recipe.seed, task=make_task(loaded.recipe.task))
            example = trim(take(data.eval.x, slice(0, 1))) if isinstance(data.eval.x, dict) else None
            return Found(model, tuple(data.input_shape), "recipe model" + (f", checkpoint {checkpoint}" if checkpoint else ""),
                         first(data.eval.x).dtype, example)


def _count(found: Found, shape: tuple[int, ...], source: str, use_example: bool = True) -> tuple[list[dict], int, int]:
    """The layer table and totals; a model that cannot take an input of ``shape`` is a usage error (exit 2)."""
    from .evaluate import layer_table

    example: Inputs = torch.zeros((1,) + shape, dtype=found.dtype)
    if use_example and found.example is not None:
        example = found.example
    try:
        rows, macs, params = layer_table(found.model, example)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's model on a shape it may not take
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UsageError(f"{source}: the model fails on one input of shape {list(shape)} ({found.dtype}): "
                         f"{type(exc).__name__}: {first}",
                         hint="pass the shape of one sample the model takes, without the batch dimension, e.g. "
                         "--input-shape 3,32,32 (a recipe's model.input_shape sets it too)") from exc
    total_macs = sum(r["macs"] for r in rows) or 1
    for r in rows:
        r["macs %"] = round(100 * r["macs"] / total_macs, 1)
    return rows, macs, params


def _data_example(loaded) -> tuple[tuple[int, ...], "Inputs | None"]:
    """The data's sample shape, and for several inputs the first eval sample (text cut to its length)."""
    from .data import load_data
    from .inputs import take, trim
    from .tasks import make_task

    data = load_data(loaded.recipe.data, loaded.recipe.seed, task=make_task(loaded.recipe.task))
    return data.input_shape, trim(take(data.eval.x, slice(0, 1))) if isinstance(data.eval.x, dict) else None


def _check_input_shape(shape: tuple[int, ...]) -> None:
    """``--input-shape`` is checked before any model is built: 0 or negative dimensions, or one so large that
    the zero sample would exhaust memory (``10**9``), are a usage error (exit 2)."""
    from .recipe.models import input_shape_problem

    problem = input_shape_problem(shape)
    if problem:
        raise UsageError(f"--input-shape {','.join(map(str, shape))}: {problem}",
                         hint="give one sample's shape without the batch dimension, e.g. --input-shape 3,32,32")

