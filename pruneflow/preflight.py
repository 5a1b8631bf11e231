"""Checks on what a run is handed, after its data and model load and before anything is trained or written.

Garbage in must never give exit 0 or fail late: inputs holding NaN or infinities, labels beyond the class
names or the model's outputs, a checkpoint whose tensors are NaN or of another kind than the model's
(int32 or bool where the model holds floats: ``load_state_dict`` casts them silently), a sample shape the
model is measured at but the data does not have. Each problem is an :class:`InputError` (exit 2) that names
what is wrong, where (file, column, key) and the fix. The pipeline runs these checks before it creates the
run folder, so a refused run writes nothing and leaves an earlier run in that folder as it was.

This module imports only torch, numpy and the error classes: ``data.py``, ``models.py`` and
``checkpoint.py`` call into it while they read.

    check_dtypes(model.state_dict(), state, "weights.safetensors")   # raises on int32 where a float is due
"""

from __future__ import annotations

import os

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .errors import ConfigError, InputError
from .inputs import Inputs, call, first, trim
from .recipe.models import input_shape_problem

#: Samples the preflight forward pass takes from the eval split.
PREFLIGHT_BATCH = 8


def dtype_class(dtype: torch.dtype) -> str:
    """``bool``, ``integer``, ``float`` or ``complex``: what ``load_state_dict`` must never cast between."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def check_dtypes(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], source: object) -> None:
    """Refuse checkpoint tensors of another kind than the model's (int vs float vs bool), naming each key.

    ``load_state_dict`` copies an int32 or bool tensor into a float parameter without a word (issue 14 saw
    accuracy fall from 1.00 to 0.10); float16 weights for a float32 model are the same kind and pass.
    """
    bad = [(k, given[k].dtype, expected[k].dtype) for k in given
           if k in expected and dtype_class(given[k].dtype) != dtype_class(expected[k].dtype)]
    if not bad:
        return
    first = "; ".join(f"{k} is {str(g).replace('torch.', '')} where the model's is {str(e).replace('torch.', '')}"
                      for k, g, e in bad[:3])
    raise InputError(
        f"model.checkpoint {source}: {len(bad)} tensor(s) hold another kind of number than the model's ({first}); "
        "loading would cast them silently and the weights would be garbage",
        hint="save the checkpoint from the trained model itself (torch.save(model.state_dict(), path) or "
        "safetensors' save_file(model.state_dict(), path)) so every tensor keeps its dtype",
    )


def check_finite_weights(state: Mapping[str, torch.Tensor], source: object) -> None:
    """Refuse a checkpoint whose floating-point tensors hold NaN or infinities, naming the first keys."""
    bad = []
    for key, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                bad.append(f"{key} ({int((~finite).sum())} of {tensor.numel()} values)")
    if bad:
        raise InputError(
            f"model.checkpoint {source}: {len(bad)} tensor(s) hold NaN or infinite values, e.g. {', '.join(bad[:3])}",
            hint="the file comes from a diverged or damaged training run: use a checkpoint saved before the loss "
            "became NaN",
        )


def check_finite_inputs(x: np.ndarray, source: str, columns: Sequence[str]) -> None:
    """Refuse input values that are NaN or infinite, naming the source, the column(s) and the first rows."""
    if not np.issubdtype(x.dtype, np.floating):
        return
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    if not bad.any():
        return
    rows = np.flatnonzero(bad)
    raise InputError(
        f"data: {source}, column {', '.join(map(repr, columns))}: {len(rows)} of {len(x)} samples hold NaN or "
        f"infinite values (rows {', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''})",
        hint="drop or impute those rows before training (e.g. numpy.nan_to_num, or remove them); NaN inputs "
        "make the loss NaN and every figure garbage",
    )


def check_shape_matches_data(shape: Sequence[int], data_shape: Sequence[int], explicit: bool) -> None:
    """The shape a model is measured at (MACs, exports) must be the data's sample shape."""
    problem = input_shape_problem(shape)
    if problem:
        raise ConfigError(("model", "input_shape"), problem, value=list(shape), hint="give one sample's shape, e.g. [3, 32, 32]")
    if tuple(shape) == tuple(data_shape):
        return
    origin = "model.input_shape" if explicit else "the zoo model's default input shape"
    raise ConfigError(
        ("model", "input_shape"),
        f"{origin} is {list(shape)} but the data's samples are {list(data_shape)}: MACs and exports would be "
        "for a shape the model never sees",
        value=list(shape),
        hint=f"set model.input_shape: {list(data_shape)}, or fix the data section (layout, image_size, input_column)",
    )


def _shapes(batch: Inputs) -> str:
    if isinstance(batch, torch.Tensor):
        return f"shape {tuple(batch.shape)}"
    return "inputs " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items())


def check_inputs_match_forward(model: torch.nn.Module, batch: Inputs, factory: str) -> None:
    """Named inputs must name forward's parameters: a misspelt ``input_column`` key would otherwise be dropped
    and the model fail on a missing argument. (Named inputs none of which forward takes, e.g. tokenized text
    for a one-argument model, are fed by position: ``inputs.bind``.)"""
    import inspect

    from .inputs import forward_names

    params = forward_names(model)
    if not isinstance(batch, dict) or params is None or not set(batch) & set(params):
        return
    signature = inspect.signature(model.forward).parameters
    missing = [p for p in params if p not in batch and signature[p].default is inspect.Parameter.empty]
    if missing:
        raise InputError(
            f"the model from {factory!r} takes {', '.join(params)}, but the data gives {', '.join(batch)}: "
            f"nothing feeds {', '.join(missing)}",
            hint="map every forward parameter to a column: data.input_column: {" + ", ".join(f"{p}: COLUMN" for p in params) + "}")


def check_model_on_batch(model: torch.nn.Module, batch: "Inputs", factory: str,
                         read: "Callable[[Any], torch.Tensor]") -> torch.Tensor:
    """One real eval batch through the model: it must run and give finite outputs. ``read`` takes the tensor the
    task reads from the output (``Task.output``); returns that tensor, for the task's own check of it."""
    batch = trim(batch)
    check_inputs_match_forward(model, batch, factory)
    model.eval()
    try:
        with torch.no_grad():
            out = call(model, batch)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user model
        how = (f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
               else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        raise InputError(
            f"the model from {factory!r} fails on a batch of the data, {_shapes(batch)} "
            f"(the data's samples are {tuple(first(batch).shape[1:])}): {how}",
            hint=_table_hint(model, batch, exc) or "check model.input_shape, model.kwargs and the data section (layout, input_column)",
        ) from exc
    logits = read(out)
    if logits.is_floating_point() and not bool(torch.isfinite(logits).all()):
        raise InputError(
            f"the model from {factory!r} gives NaN or infinite outputs on the first {len(first(batch))} eval samples",
            hint="check model.checkpoint and the factory's initialisation (weights holding NaN), and the data's scale",
        )
    return logits


def _table_hint(model: torch.nn.Module, batch: "Inputs", exc: BaseException) -> str | None:
    """For an id beyond an embedding table (``IndexError: index out of range in self``, which names no table): the
    model's tables and the batch's largest id a column, so the field whose table is too small shows."""
    if not isinstance(exc, IndexError) or "out of range" not in str(exc):
        return None
    tables = [f"{n} {m.num_embeddings} rows" for n, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    if not tables:
        return None
    items = batch.items() if isinstance(batch, dict) else [("input", batch)]
    ids = {k: (v.flatten(2).amax(dim=(0, 2)) if v.dim() > 2 else v.amax(dim=0) if v.dim() == 2 else v.amax()).tolist()
           for k, v in items if not v.is_floating_point() and v.numel()}
    return (f"an id is beyond an embedding table: the model's tables hold {', '.join(tables[:8])}; the batch's largest "
            f"ids, per column: {ids}. Size each table for its field (a factory that takes `cardinalities`, "
            "`bag_cardinalities` gets every field's rows from data.features)")


#: The longest file or folder name Linux, macOS and Windows file systems take, in bytes.
NAME_MAX = 255
#: The longest path Linux takes (macOS: 1024, checked by the system itself), in bytes.
PATH_MAX = 4096


def _shown(path: Path) -> str:
    """``path`` as an error message shows it: a 5,000-byte --out is cut, not printed whole."""
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-40:]} ({len(os.fsencode(text)):,} bytes)"


def check_out_dir(out: Path, name: str) -> None:
    """``--out`` must be a folder this process can create and write in; checked without writing anything.

    The nearest existing folder on the way to ``OUT/NAME`` must be writable (a nameless temporary file tells): a file in the way, a read-only
    folder or a read-only file system stop the run here (exit 2) instead of after loading data and model.
    """
    from .errors import UsageError

    run_dir = out / name
    shown = _shown(out)
    too_long = next((part for part in run_dir.parts if len(os.fsencode(part)) > NAME_MAX), None)
    if too_long is not None:
        raise UsageError(f"--out {shown}: the folder name {too_long[:40]}... is {len(os.fsencode(too_long))} bytes; file "
                         f"systems stop at {NAME_MAX} (File name too long); nothing was written",
                         hint="choose a shorter --out")
    whole = len(os.fsencode(str(run_dir.absolute()))) + len(f"/.{name}.lock") + NAME_MAX
    if whole > PATH_MAX:
        raise UsageError(f"--out {shown}: the run folder's path is {whole - NAME_MAX:,} bytes, and with its files' names it "
                         f"would pass the {PATH_MAX:,} bytes a path may have (File name too long); nothing was written",
                         hint="choose a shorter --out")
    if run_dir.is_symlink():
        raise UsageError(f"--out {shown}: the run folder {run_dir} is a symbolic link; a run replaces its folder whole, and "
                         "pruneflow never writes through a link into a folder it does not own (nothing was written)",
                         hint=f"remove {run_dir}, or choose another --out")
    for path in [run_dir, *run_dir.parents]:
        if not path.exists():
            continue
        if not path.is_dir():
            raise UsageError(f"--out {shown}: {path} is a file, not a folder; the run folder and its lock file go inside --out",
                             hint="choose an --out folder (it is created when missing)")
        if path == run_dir:  # the run replaces OUT/NAME itself (or, resumed, writes in it): both must be writable
            if not _writable(run_dir):
                raise UsageError(f"--out {shown}: cannot write in the existing run folder {run_dir} (read-only or immutable); "
                                 "a new run replaces it and --resume writes in it; nothing was written",
                                 hint=f"make {run_dir} writable (chattr -i, chmod u+w), or choose another --out")
            path = run_dir.parent
        if not _writable(path):
            raise UsageError(f"--out {shown}: cannot write in {path} (read-only folder or file system); nothing was written",
                             hint="choose an --out folder you can write to, e.g. --out ./runs")
        return


def _writable(folder: Path) -> bool:
    """A nameless temporary file made and dropped in ``folder``: the only test that also holds for root on a
    read-only mount or a pseudo file system (``os.access`` says yes there)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


#: One batch's input may take at most this share of the memory left: training keeps the activations and gradients,
#: evaluation the activations and outputs, each several times the input's size. A batch past it cannot run here; one
#: under it may still be too large for the model (``doctor`` tries one batch).
BATCH_INPUT_SHARE = 0.25
#: A batch advised is this share of the largest allowed, so that it still fits on the next run.
BATCH_ADVICE_MARGIN = 0.8


def batch_memory_problems(recipe: Any, sample_bytes: int, memory: tuple[int | None, str] | None = None) -> list[ConfigError]:
    """Each batch size of the recipe (``data.eval_batch_size``, a stage's ``batch_size``, ``importance_batch_size``,
    ``batch_sizes``) whose input alone (``sample_bytes`` a sample) would take more than ``BATCH_INPUT_SHARE`` of the
    memory this process may still use, its container's limit included (``config.memory_left``), as a located problem
    naming the batch that fits. Cheap (nothing is allocated) and a lower bound: it refuses only what cannot fit."""
    from .config import memory_left

    free, where = memory or memory_left()
    if free is None or sample_bytes <= 0:
        return []
    allowed = BATCH_INPUT_SHARE * free
    problems = []
    for loc, batch in _batch_sizes(recipe, ()):
        if batch * sample_bytes > allowed:
            fits = max(1, int(BATCH_ADVICE_MARGIN * allowed // sample_bytes))
            problems.append(ConfigError(
                loc, f"a batch of {batch:,} takes {batch * sample_bytes / 1e9:,.2f} GB of input alone ({sample_bytes:,} "
                f"bytes a sample), and there are {free / 1e9:,.2f} GB {where.removeprefix('available ')}; a batch's input "
                f"may take at most {BATCH_INPUT_SHARE:.0%} of that (activations, gradients and outputs need several "
                "times more)", value=batch, hint=f"use {loc[-1]}: {fits} or less"))
    return problems


def _batch_sizes(obj: Any, loc: tuple) -> list[tuple[tuple, int]]:
    """Every batch size a validated recipe sets, with its key path (a list of sizes: each entry)."""
    from pydantic import BaseModel

    found: list[tuple[tuple, int]] = []
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            value = getattr(obj, name)
            if name.endswith("batch_size") and isinstance(value, int) and not isinstance(value, bool):
                found.append(((*loc, name), value))
            elif name == "batch_sizes" and isinstance(value, list):
                found += [((*loc, name, i), v) for i, v in enumerate(value) if isinstance(v, int)]
            else:
                found += _batch_sizes(value, (*loc, name))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found += _batch_sizes(item, (*loc, i))
    return found


def sample_bytes(batch: Inputs) -> int:
    """Bytes one sample of ``batch`` takes (every input of a dict)."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch.values())
    return sum(int(t[:1].element_size() * t[:1].nelement()) for t in tensors)
