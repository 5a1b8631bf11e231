"""The task's metrics (``tasks.py``) of a torch model, or of any runtime that maps a numpy batch to outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .context import Reporter
from .data import Split
from .inputs import Inputs, as_numpy, bind, call, forward_names, lengths, to
from .tasks import MetricState, Task


@torch.no_grad()
def evaluate_model(model: nn.Module, split: Split, task: Task, batch_size: int = 256, device: str = "cpu",
                   reporter: Reporter | None = None, description: str = "evaluate") -> dict[str, float]:
    """``task.compute`` over ``split``: every metric of the task (its headline among them) and ``samples``."""
    was_training = model.training
    model.eval()
    state = MetricState()
    reporter = reporter or Reporter()
    with reporter.progress(description, total=len(split)) as advance:
        for x, y in split.batches(batch_size, by_length=True):
            out = call(model, to(x, device))
            task.update(state, task.output(out).float().cpu(), y)
            advance(len(y))
    model.train(was_training)
    return task.compute(state)


@torch.no_grad()
def model_outputs(model: nn.Module, split: Split, task: Task, batch_size: int = 256, device: str = "cpu",
                  reporter: Reporter | None = None, description: str = "outputs") -> torch.Tensor:
    """What ``task`` reads of ``model``'s output on every row of ``split``, in the split's order (float32, on the CPU).
    Batches are those ``evaluate_model`` runs (text sorted by length, each cut to its longest row), so a model
    evaluated against these outputs meets them batch for batch."""
    was_training = model.training
    model.eval()
    n = lengths(split.x)
    order = torch.argsort(n, stable=True) if n is not None else torch.arange(len(split))
    parts = []
    with (reporter or Reporter()).progress(description, total=len(split)) as advance:
        for x, _ in split.batches(batch_size, by_length=True):
            parts.append(task.output(call(model, to(x, device))).float().cpu())
            advance(len(parts[-1]))
    model.train(was_training)
    outputs = torch.empty((len(split), *parts[0].shape[1:]), dtype=torch.float32)
    outputs[order] = torch.cat(parts)
    return outputs


def evaluate_runtime(run: "Callable[[Any], np.ndarray] | str | Path", split: Split, task: Task, batch_size: int = 256,
                     reporter: Reporter | None = None, description: str = "evaluate", **open_options: Any) -> dict[str, float]:
    """The task's metrics of an artifact in its runtime: ``run`` is an executor of the runtime layer (or any
    ``run(x_numpy) -> logits_numpy``; a numpy feed dict for a model with several inputs), or the artifact's path, then opened with ``open_options``
    (``runtime=``, ``device=``, ``precision_hint=``: see ``pruneflow.runtime.open_artifact``)::

        evaluate_runtime("runs/q/export/openvino/model.int8.xml", data.eval, task, precision_hint="f32")
    """
    if isinstance(run, (str, Path)):
        from .runtime import open_artifact

        run = open_artifact(run, **open_options)
    state = MetricState()
    reporter = reporter or Reporter()
    with reporter.progress(description, total=len(split)) as advance:
        for x, y in split.batches(batch_size, by_length=True):
            out = torch.from_numpy(np.asarray(run(as_numpy(x))))
            task.update(state, out.float(), y)
            advance(len(y))
    return task.compute(state)


def count_macs_params(model: nn.Module, example: Inputs) -> tuple[int, int]:
    """MACs and parameters of one forward pass (torch-pruning's op counter; a dict is passed as keywords)."""
    import torch_pruning as tp

    was_training = model.training
    model.eval()
    with _counter_quiet():
        macs, params = tp.utils.count_ops_and_params(model, _tp_example(model, example))
    model.train(was_training)
    return int(macs), int(params)


def _counter_quiet():
    """torch-pruning's counter prints "Warning! No positional inputs found for a module, assuming batch size is 1."
    for every module a model calls with keywords only (a Hugging Face BERT's layers), on stdout: five lines a
    count. Our examples are one sample, so the assumption holds; the lines are dropped."""
    import contextlib
    import io

    return contextlib.redirect_stdout(io.StringIO())


def _tp_example(model: nn.Module, example: Inputs) -> "Inputs | tuple[torch.Tensor, ...]":
    """What forward takes, positionally where it can be (torch-pruning's counter reads the batch size from
    the first positional input, and calls ``model(**example)`` for a dict)."""
    bound = bind(model, example)
    if isinstance(bound, dict) and list(bound) == (forward_names(model) or [])[: len(bound)]:
        return tuple(bound.values())
    return bound


def layer_table(model: nn.Module, example: Inputs) -> tuple[list[dict], int, int]:
    """Per-layer rows (name, type, shape summary, params, MACs) and the totals (MACs, params), from
    torch-pruning's op counter.

    A row is a module the counter counts as one unit (a leaf, or one it counts whole such as
    ``nn.MultiheadAttention``, whose ``out_proj`` is inside its MACs) that holds parameters, plus one for the
    parameters a container holds itself (a class token, a position embedding): the rows' params sum to the total.
    """
    import torch_pruning as tp

    was_training = model.training
    model.eval()
    with _counter_quiet():
        total_macs, total_params, macs, _ = tp.utils.count_ops_and_params(model, _tp_example(model, example), layer_wise=True)
    model.train(was_training)
    rows = []
    for name, module in model.named_modules():
        if macs.get(module) is None:  # inside a module counted whole
            continue
        unit = all(macs.get(child) is None for child in module.children())
        params = sum(p.numel() for p in (module.parameters() if unit else module.parameters(recurse=False)))
        if not params:
            continue
        rows.append({
            "name": (name or "(model)") + ("" if unit else " (own parameters)"),
            "type": type(module).__name__,
            "shape": _shape(module) if unit else "",
            "params": int(params),
            "macs": int(macs[module]) if unit else 0,
        })
    return rows, int(total_macs), int(total_params)


def _shape(module: nn.Module) -> str:
    if isinstance(module, nn.Conv2d):
        g = f" g{module.groups}" if module.groups > 1 else ""
        return f"{module.in_channels}→{module.out_channels} k{module.kernel_size[0]} s{module.stride[0]}{g}"
    if isinstance(module, nn.Linear):
        return f"{module.in_features}→{module.out_features}"
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)):
        return str(getattr(module, "num_features", getattr(module, "normalized_shape", "")))
    w = getattr(module, "weight", None)
    return "×".join(map(str, w.shape)) if isinstance(w, torch.Tensor) else ""
