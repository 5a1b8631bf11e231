"""A calibration set from a local source (a file or folder of inputs): what `pruneflow calibrate SOURCE` calls.

The calibrate stage's logic without a run directory; the CLI only parses options and renders the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from pruneflow.errors import ConfigError, InputError, UsageError

from .build import STRATEGIES, build_calibration_set, feature_layer, penultimate_features
from .consumers import save_set
from .sampling import length_buckets

SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".npz": "npz"}


def guess_format(source: Path) -> str:
    """The loader format of SOURCE from its suffix or folder contents, so `--format` is needed only when ambiguous."""
    if source.is_dir():
        return "disk" if any((source / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")) else "imagefolder"
    fmt = SUFFIX_FORMATS.get(source.suffix.lower())
    if fmt is None:
        raise InputError(f"cannot tell the format of {source}", hint=f"pass --format, one of {', '.join(sorted(set(SUFFIX_FORMATS.values())))}, imagefolder, disk")
    return fmt


def _recipe_model(recipe: Path):
    """The model, data section and tabular schema (vocabularies fitted on its training split, else None) of a recipe."""
    from pruneflow.models import build_model, with_data_kwargs
    from pruneflow.recipe import load_recipe

    loaded = load_recipe(recipe)
    spec, model_spec, schema = loaded.recipe.data, loaded.recipe.model, None
    if spec.features is not None:
        from pruneflow.data import load_data

        schema = load_data(spec, loaded.recipe.seed).tabular
        model_spec = with_data_kwargs(model_spec, schema)[0]
    return build_model(model_spec), spec, schema


def calibrate_source(source: Path, out: Path, *, size: int, strategy: str, by: str = "label", seed: int = 0,
                     recipe: Path | None = None, fmt: str | None = None, input_column: str | None = None,
                     label_column: str | None = None, amct: bool = False,
                     warn: Callable[[str], None] = lambda m: None) -> dict:
    """Check the options, load SOURCE, select ``size`` samples and save the set to ``out``; returns calibration.json.

    Options are checked before any data loads so a typo fails in milliseconds; ``recipe`` supplies the data
    spec and the model whose features the `diverse` strategy compares.
    """
    from pruneflow.data import load_inputs
    from pruneflow.recipe.models import DataSpec

    if strategy not in STRATEGIES:
        raise UsageError(f"--strategy: unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if size < 1:
        raise UsageError("--size must be at least 1", hint="e.g. --size 512: samples to keep")
    if not source.exists():
        raise InputError(f"calibration source not found: {source}", hint="SOURCE is a data file or folder (npz, csv, json, parquet, "
                         "an image folder, a save_to_disk folder); check the path")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "calibration.json").is_file())):
        raise InputError(f"--out {out} exists and is not a calibration set; refusing to replace it",
                         hint="choose a new or empty folder for --out")
    if source.resolve() == out.resolve() or out.resolve() in source.resolve().parents:
        raise InputError("--out must not contain SOURCE", hint="write the calibration set somewhere else")
    fmt = fmt or guess_format(source)
    model, spec, schema = _recipe_model(recipe) if recipe is not None else (None, DataSpec(format="npz", eval=str(source)), None)
    update = {k: v for k, v in (("input_column", input_column), ("label_column", label_column)) if v}
    split, ds = load_inputs(spec.model_copy(update=update), fmt, str(source), "SOURCE", schema=schema)
    groups = None
    if strategy == "stratified" and by == "length":  # token-count buckets of tokenized text (sampling.length_buckets)
        try:
            groups = length_buckets(split.x)
        except ValueError as exc:
            raise UsageError(f"--by length: {exc}", hint="--by length needs tokenized text: pass --recipe with a recipe whose data has a "
                             "tokenizer, or stratify --by label or a column") from None
    elif strategy == "stratified" and by not in ("label", label_column or spec.label_column):
        if by not in ds.column_names:
            raise UsageError(f"--by: the source has no column {by!r}; columns: {', '.join(ds.column_names)}")
        groups = np.asarray([str(v) for v in ds[by]])
    layer = feature_layer(model) if model is not None else None  # a model with no Linear or convolution: its inputs
    features = (lambda x: penultimate_features(model, x)) if layer is not None and model is not None else None
    try:
        calib = build_calibration_set(split, size=size, strategy=strategy, seed=seed, groups=groups, features=features,
                                      meta={"source": str(source), "by": by if strategy == "stratified" else None,
                                            "features": (layer[1] if layer is not None else "inputs") if strategy == "diverse" else None},
                                      warn=warn)
    except ConfigError as exc:  # a setting of the build (e.g. `by`): here it is the command-line option
        option = "--recipe" if exc.loc == ("features",) else f"--{exc.loc[-1]}"
        raise UsageError(f"{option}: {exc.detail}", hint=exc.hint) from None
    return save_set(calib, out, amct=amct)
