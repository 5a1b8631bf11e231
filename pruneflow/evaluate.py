"""The task's metrics (``tasks.py``) of a torch model, or of any runtime that maps a numpy batch to outputs."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from .context import Reporter
from .data import Split
from .inputs import Inputs, as_numpy, call, lengths, to
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
    """MACs of one forward pass on ``example`` (``macs_by_module``'s total) and the model's parameters, a tied
    parameter (an item table that is also the output projection) counted once."""
    return macs_by_module(model, example)[""], sum(p.numel() for p in model.parameters())


def macs_by_module(model: nn.Module, example: Inputs) -> dict[str, int]:
    """Multiply-accumulates of one forward pass, per module name (``""``: the whole model), from torch's own
    ``FlopCounterMode`` (FLOPs / 2): it counts at the dispatcher what runs, wherever it is written.

    torch-pruning's op counter, used before, counts module hooks: a matmul written in a forward (a SASRec's scores
    against its tied item table, ``h @ items.weight.T``: half the model) did not count, and an ``nn.GRU`` counted
    59.2 M where it runs 2.2 M (issue 37). Two gaps of the FlopCounter are closed here: CPU attention
    (``_scaled_dot_product_flash_attention_for_cpu`` has no formula in torch 2.13; the generic one is registered),
    and ``nn.MultiheadAttention``'s fused eval path (turned off while counting, as an export turns it off, so the
    projections and the attention are counted as the exported graph runs them); and an ``nn.LSTM`` on the CPU, which
    runs as oneDNN's ``mkldnn_rnn_layer``, a kernel the counter has no formula for (it counted 0). Elementwise ops
    (norms, activations) are not MACs and count 0, as in every FLOP counter of the field."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_attention(query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(sdpa_flop_count(query, key, value))  # (shapes: FlopCounterMode wraps the formula)

    def cpu_lstm_layer(input, w_ih, w_hh, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        # oneDNN's LSTM layer: every step (input [steps, batch, in]) multiplies both gate matrices, 4H rows each
        return 2 * int(input[0]) * int(input[1]) * (int(w_ih[0]) * int(w_ih[1]) + int(w_hh[0]) * int(w_hh[1]))

    mapping: dict[Any, Any] = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", cpu_attention), ("mkldnn_rnn_layer", cpu_lstm_layer)):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            mapping[op] = formula
    was_training = model.training
    model.eval()
    try:
        with no_attention_fastpath(), torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            call(model, example)
    finally:
        model.train(was_training)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    out = {"": int(sum(counts.get("Global", {}).values()) // 2)}
    for key, ops in counts.items():
        if key.startswith(root + "."):
            out[key[len(root) + 1:]] = int(sum(ops.values()) // 2)
    return out


@contextlib.contextmanager
def no_attention_fastpath() -> Iterator[None]:
    """Exports (and the MAC count) see the composite ops of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``.

    In eval mode, with gradients off or the parameters frozen (a float base, a distillation teacher,
    an export under ``torch.no_grad()``), torch runs those modules through one fused kernel
    (``aten::_transformer_encoder_layer_fwd``, ``aten::_native_multi_head_attention``) that no ONNX
    exporter or OpenVINO converter knows. torch's own switch turns that fast path off for the export.
    """
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


def layer_table(model: nn.Module, example: Inputs) -> tuple[list[dict], int, int]:
    """Per-layer rows (name, type, shape summary, params, MACs) and the totals (MACs, params), from
    ``macs_by_module``.

    A row is a module that does its own work (a leaf, or one that runs its children's weights itself such as
    ``nn.MultiheadAttention``, whose ``out_proj`` it applies functionally) and holds parameters, plus one for what a
    container holds and computes itself (a class token, a position embedding, a tied output projection written as a
    matmul in its forward): the rows' params and MACs sum to the totals."""
    macs = macs_by_module(model, example)
    rows: list[dict] = []
    whole: list[str] = []
    seen: set[int] = set()  # whole: units whose subtree is in their row; seen: parameters shown (tied: once)
    for name, module in model.named_modules():
        if any(name.startswith(w + ".") for w in whole):
            continue
        called = _called_below(module, name, macs)
        unit = not called
        params = [p for p in (module.parameters() if unit else module.parameters(recurse=False)) if id(p) not in seen]
        seen.update(id(p) for p in params)
        work = macs.get(name, 0) - sum(macs[c] for c in called)  # a container: what its own forward computes
        if unit and name:
            whole.append(name)
        if params or work > 0:
            rows.append({"name": (name or "(model)") + ("" if unit else " (own parameters)"), "type": type(module).__name__,
                         "shape": _shape(module) if unit else "", "params": int(sum(p.numel() for p in params)),
                         "macs": int(work)})
    return rows, macs[""], sum(p.numel() for p in model.parameters())


def _called_below(module: nn.Module, name: str, macs: dict[str, int]) -> list[str]:
    """The nearest descendants of ``module`` that ran as modules (have a count), through containers that did not
    (an ``nn.ModuleList`` is never called itself)."""
    found, stack = [], [(f"{name}.{c}" if name else c, m) for c, m in module.named_children()]
    while stack:
        path, child = stack.pop()
        if path in macs:
            found.append(path)
        else:
            stack.extend((f"{path}.{c}", m) for c, m in child.named_children())
    return found


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
