"""Per-layer quantization sensitivity of an NNCF-quantized torch model, and fallback to float under a bound on the
task's metric (NNCF's "accuracy control").

NNCF has this only for OpenVINO and ONNX models: ``nncf.quantize_with_accuracy_control`` dispatches on the
backend and raises UnsupportedBackendError for torch, and its ranker
(nncf/quantization/algorithms/accuracy_control/ranker.py) works on those backends' graphs. So the torch
side is written here, following NNCF's design: quantizers that share a consumer form one *group* (NNCF's
"groups of quantizers to rank"; e.g. BERT's query/key/value share their input quantizer), each group is
ranked by how much keeping it float restores the model's outputs on the calibration set, and the
most sensitive groups fall back to float one at a time until the metric's drop holds. What is reused from
NNCF: its graph of the quantized model (``build_nncf_graph``), its hook storage (``delete_hook``), and the
quantizers' own ``disable_quantization``/``enable_quantization``.

A group that falls back has its quantizers *deleted* from NNCF's hook storage (not only disabled), so every
later consumer sees a float layer: ``nncf.strip`` (the INT8 ONNX then has no Q/DQ around it), NNCF's
checkpoint config (``nncf.torch.get_config``) and OpenVINO's conversion.

    groups = quantizer_groups(quantized, example)
    rows = sensitivity(quantized, float_model, calib, task, groups)
    remove_group(quantized, groups[0])
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from pydantic import Field
from torch import nn

from pruneflow.inputs import Inputs, call, take, to
from pruneflow.config import StrictModel

if TYPE_CHECKING:
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.tasks import Metric, Task

#: NNCF graph node types of its fake-quantize operations.
QUANTIZE_OPS = frozenset({"symmetric_quantize", "asymmetric_quantize"})
HOOKS_PREFIX = "__nncf_hooks."
#: Ops that move values without computing new ones: NNCF puts an activation quantizer before them (the
#: runtimes propagate Q/DQ through them), so the op that really reads the quantizer is found after them.
PASS_THROUGH = frozenset({"flatten", "reshape", "view", "permute", "transpose", "squeeze", "unsqueeze", "contiguous",
                          "max_pool1d", "max_pool2d", "adaptive_max_pool2d", "dropout", "__getitem__", "expand", "chunk", "split"})


class Sensitivity(StrictModel):
    """Per-layer quantization sensitivity and, with ``max_drop``, fallback of the most sensitive layers to float."""

    max_drop: float | None = Field(
        default=None, ge=0,
        description="Largest worsening of `metric` (absolute, in the metric's own direction: 0.01 = 1 point of a share) of "
        "the INT8 model against the float model entering the stage, both on the whole eval split. Past it, the most "
        "sensitive layers fall back to float one at a time (their quantizers removed, so every export keeps them float) "
        "until it holds; when `max_fallback` is spent first, the gate `<stage>.sensitivity` fails (exit 1). Unset: only "
        "the sensitivity table.",
    )
    metric: str | list[str] | None = Field(
        default=None, description="Metric(s) of the task that `max_drop` bounds, each in its own direction (default: the "
        "task's headline; for a multi-head task every head's, e.g. `[click.auc, finish.auc]`: layers fall back until each "
        "holds).")
    max_fallback: int = Field(default=10, ge=0, description="Most layers (quantizer groups) that may fall back to float.")
    samples: int = Field(
        default=128, ge=1,
        description="Calibration samples the sensitivity is measured on: the outputs' SNR in dB against the float model, "
        "the task's agreement figure (and its headline metric, where the set has labels) with each layer alone kept float. One pass over them "
        "per layer (a 2-layer, 64-wide BERT has 23 such layers).",
    )
    alone_int8: bool = Field(
        default=False, description="Also measure each layer quantized alone (one more pass over the samples per layer).")


@dataclass
class QuantGroup:
    """Quantizers reverted together: those of one op (its weight and input quantizers), merged with every
    other op that reads one of them."""

    ops: list[str] = field(default_factory=list)  # NNCF op node names, e.g. ``mid/linear/0``
    hooks: list[str] = field(default_factory=list)  # names in NNCF's hook storage (``pre_hooks.mid/linear/0__1.0``)
    weights: int = 0  # weight elements quantized in the group (what falling back to float costs: 3 bytes each)
    #: Modules whose weights the group's ops read (named as in ``model.named_modules()``: what `ignore:` takes).
    #: NNCF's op names are not module paths: they leave out ModuleList indices (``encoder/attention/self/
    #: query/linear/1`` is layer 1's query), so modules are found from the weight parameters' names.
    modules: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The modules (``encoder.layer.0.attention.self.query+key+value``), and the ops without a weight
        (``.../matmul/2``) where the group has them."""
        others = [op for op, module in zip(self.ops, self._op_modules) if module is None]
        parts = []
        if self.modules:
            prefix = _common_prefix(self.modules)
            parts.append(prefix + "+".join(m[len(prefix):] for m in self.modules))
        if others and not parts:
            parts.append(", ".join(others))
        elif others:
            parts.append(f"(+{len(others)} op{'s' if len(others) > 1 else ''})")
        return " ".join(parts) or "?"

    _op_modules: list[str | None] = field(default_factory=list, repr=False)  # per op: its weight's module


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common) + "." if common and len(common) < min(map(len, parts)) else ""


def _hook_of(graph, node) -> str | None:
    """The hook-storage name of a quantize node, read from its parameter inputs (``__nncf_hooks.NAME._scale_param_storage``)."""
    for edge in graph.get_input_edges(node):
        name = edge.from_node.node_name
        if name.startswith(HOOKS_PREFIX):
            return name[len(HOOKS_PREFIX):].rsplit(".", 1)[0]
    return None


def quantizer_groups(model: nn.Module, example: Inputs) -> list[QuantGroup]:
    """Group the quantizers of an NNCF-quantized ``model`` by the ops that read them (connected components
    of the op-quantizer graph), in graph order."""
    from nncf.torch.function_hook import get_hook_storage
    from nncf.torch.function_hook.nncf_graph.nncf_graph_builder import build_nncf_graph

    storage = get_hook_storage(model)
    aliases: dict[int, list[str]] = {}  # one quantizer module may sit under several hook names
    for name, module in storage.named_hooks(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    with torch.no_grad():
        graph = build_nncf_graph(model, example)
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    weights: dict[str, int] = {}
    for node in graph.get_all_nodes():
        if node.node_type not in QUANTIZE_OPS:
            continue
        hook = _hook_of(graph, node)
        if hook is None:
            continue
        key = "q:" + min(aliases.get(id(storage.get_submodule(hook)), [hook]))
        weights[key] = max(weights.get(key, 0), _weight_elements(graph, node, model))
        for op in _readers(graph, node):
            parent[find("op:" + op)] = find(key)
    owners = _weight_owners(graph, model)
    groups: dict[str, QuantGroup] = {}
    for item in parent:
        group = groups.setdefault(find(item), QuantGroup())
        if item.startswith("op:"):
            group.ops.append(item[3:])
            group._op_modules.append(owners.get(item[3:]))
            if owners.get(item[3:]) and owners[item[3:]] not in group.modules:
                group.modules.append(owners[item[3:]])
        else:
            module = storage.get_submodule(item[2:])
            group.hooks += aliases.get(id(module), [item[2:]])
            group.weights += weights.get(item, 0)
    return [g for g in groups.values() if g.ops and g.hooks]


def _weight_owners(graph, model: nn.Module) -> dict[str, str]:
    """op node name -> the module owning the weight parameter it reads (directly or through its quantizer)."""
    params = {name for name, _ in model.named_parameters()}
    owners = {}
    for node in graph.get_all_nodes():
        if node.node_type in QUANTIZE_OPS:
            continue
        for edge in graph.get_input_edges(node):
            src = edge.from_node
            names = [src.node_name] + ([e.from_node.node_name for e in graph.get_input_edges(src)]
                                       if src.node_type in QUANTIZE_OPS else [])
            found = next((n for n in names if n in params and not n.startswith(HOOKS_PREFIX)), None)
            if found and "." in found:
                owners[node.node_name] = found.rsplit(".", 1)[0]
                break
    return owners


def _readers(graph, node) -> list[str]:
    """The ops that read a quantize node's output, looking through PASS_THROUGH ops."""
    found, todo, seen = [], [node], set()
    while todo:
        for edge in graph.get_output_edges(todo.pop()):
            to = edge.to_node
            if to.node_name in seen:
                continue
            seen.add(to.node_name)
            if to.node_type in PASS_THROUGH:
                todo.append(to)
            else:
                found.append(to.node_name)
    return found


def _weight_elements(graph, node, model: nn.Module) -> int:
    """Elements of the constant (a parameter of ``model``) a weight quantizer reads; 0 for an activation quantizer."""
    params = dict(model.named_parameters())
    for edge in graph.get_input_edges(node):
        name = edge.from_node.node_name
        if not name.startswith(HOOKS_PREFIX) and name in params:
            return params[name].numel()
    return 0


def group_quantizers(model: nn.Module, group: QuantGroup) -> list[nn.Module]:
    from nncf.torch.function_hook import get_hook_storage

    storage = get_hook_storage(model)
    return list({id(m): m for m in (storage.get_submodule(h) for h in group.hooks)}.values())


def all_quantizers(model: nn.Module) -> list[nn.Module]:
    from nncf.torch.function_hook import get_hook_storage
    from nncf.torch.quantization.layers import BaseQuantizer

    return [m for _, m in get_hook_storage(model).named_hooks() if isinstance(m, BaseQuantizer)]


@contextlib.contextmanager
def quantizers_off(quantizers: list[Any]) -> Iterator[None]:
    """Run with ``quantizers`` passing values through unchanged (NNCF's own switch), then switch them back."""
    was = [q.is_enabled_quantization() for q in quantizers]
    for q in quantizers:
        q.disable_quantization()
    try:
        yield
    finally:
        for q, on in zip(quantizers, was):
            if on:
                q.enable_quantization()


def remove_group(model: nn.Module, group: QuantGroup) -> None:
    """Delete the group's quantizers from NNCF's hook storage: the group's ops are float from now on, in
    the live model, its NNCF checkpoint config, nncf.strip and every export."""
    from nncf.torch.function_hook import get_hook_storage

    storage = get_hook_storage(model)
    for hook in group.hooks:
        storage.delete_hook(hook)


@torch.no_grad()
def outputs(model: nn.Module, x: Inputs, task: "Task", batch_size: int, device: str) -> torch.Tensor:
    """What the task reads of the model's outputs on ``x`` (in batches), on the CPU, in float32."""
    was = model.training
    model.eval()
    try:
        return torch.cat([task.output(call(model, to(take(x, slice(i, i + batch_size)), device))).float().cpu()
                          for i in range(0, len(x), batch_size)])
    finally:
        model.train(was)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``approx`` against ``reference`` in dB (inf when they are equal); NNCF's
    ranker uses the inverse of this ratio (normalized MSE) when it has no metric."""
    noise = float(((reference - approx) ** 2).sum())
    signal = float((reference ** 2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(max(signal, 1e-30) / noise)


def agreement(reference: torch.Tensor, approx: torch.Tensor, task: "Task") -> float:
    """The task's agreement figure (``Task.agree``) between two output tensors."""
    return float(task.agree(reference.numpy(), approx.numpy())[task.agreement.name])


def headline(task: "Task", output: torch.Tensor, y: torch.Tensor) -> float:
    """The task's headline metric of ``output`` against the labels ``y``."""
    from pruneflow.tasks import MetricState

    state = MetricState()
    task.update(state, output, y)
    return float(task.compute(state)[task.headline_name])


def sensitivity(model: nn.Module, float_model: nn.Module, calib: "CalibrationSet", task: "Task", groups: list[QuantGroup], *,
                samples: int = 256, batch_size: int = 64, device: str = "cpu", alone: bool = True) -> list[tuple[dict, QuantGroup]]:
    """(row, group) for each group, most sensitive first; a row holds: the outputs' SNR against ``float_model`` and the
    task's agreement figure (and headline metric, where the calibration set has labels) with only this group kept float, and,
    with ``alone``, with only this group quantized. Ranked by the SNR with the group kept float (the
    larger, the more of the INT8 error it carries); NNCF's ranker ranks by normalized MSE the same way
    when it has no metric, and this one is continuous where a share of a few hundred samples is not."""
    x = take(calib.x, slice(0, samples))
    y = calib.y[:samples] if calib.y is not None else None
    reference = outputs(float_model, x, task, batch_size, device)
    every = all_quantizers(model)
    rows = []
    for group in groups:
        mine = group_quantizers(model, group)
        with quantizers_off(mine):
            kept = outputs(model, x, task, batch_size, device)
        row: dict = {"rank": 0, "layer": group.name, "quantizers": len(mine), "weights": group.weights,
                     "snr_db_kept_float": snr_db(reference, kept), "agreement_kept_float": agreement(reference, kept, task)}
        if y is not None:
            row[f"{task.headline_name}_kept_float"] = headline(task, kept, y)
        if alone:
            others = [q for q in every if all(q is not m for m in mine)]
            with quantizers_off(others):
                only = outputs(model, x, task, batch_size, device)
            row["snr_db_alone_int8"] = snr_db(reference, only)
            row["agreement_alone_int8"] = agreement(reference, only, task)
        rows.append((row, group))
    rows.sort(key=lambda rg: -rg[0]["snr_db_kept_float"])
    for rank, (row, _) in enumerate(rows, 1):
        row["rank"] = rank
    return rows


def fall_back(model: nn.Module, ranked: list[tuple[dict, QuantGroup]], measure: Callable[[], dict[str, float]], *,
              baseline: dict[str, float], start: dict[str, float], max_drop: float, max_fallback: int,
              metrics: dict[str, "Metric"]) -> tuple[list[dict], dict[str, float]]:
    """Keep the most sensitive groups float, one at a time (their quantizers deleted), until ``measure()`` is worse than
    ``baseline`` by at most ``max_drop`` in every metric of ``metrics`` (each in its own direction: a multi-head
    model's heads), or ``max_fallback`` groups fell back. ``start``: the metrics before any fallback. Returns one row per
    fallback (layer, the first metric after it and, with several, each one's, the worst drop, the weight bytes it costs
    against int8) and the final metrics."""
    def worst(value: dict[str, float]) -> float:
        return max(m.worsening(baseline[n], value[n]) for n, m in metrics.items())

    rows: list[dict] = []
    value = start
    first = next(iter(metrics))
    for row, group in ranked:
        if worst(value) <= max_drop or len(rows) >= max_fallback:
            break
        remove_group(model, group)
        value = measure()
        each = {f"{n}_after": value[n] for n in metrics} if len(metrics) > 1 else {}
        rows.append({"step": len(rows) + 1, "layer": row["layer"], "modules": ", ".join(group.modules),
                     "metric_after": value[first], **each, "drop_after": worst(value), "size_cost_bytes": 3 * group.weights})
    return rows, value


def _fallback_metrics(spec: "Sensitivity", loc: tuple, task, fp32: dict) -> dict[str, "Metric"]:
    """The metrics ``max_drop`` bounds: ``metric`` (one name or several), else the task's headline (every head's, for a
    multi-head task: a fallback that saves one head while the other drops is no fallback)."""
    from pruneflow.errors import ConfigError

    names = [spec.metric] if isinstance(spec.metric, str) else list(spec.metric or task.headline_names)
    for name in names:
        if name not in fp32 or name == "samples":
            raise ConfigError((*loc, "metric"), f"the task computes no metric {name!r}", value=name,
                              hint=f"use one of: {', '.join(sorted(k for k in fp32 if k != 'samples'))}")
    return {name: task.metric(name) for name in names}


def sensitivity_control(spec: Sensitivity, stage_id: str, loc: tuple, model: nn.Module, float_model: nn.Module,
                        calib: "CalibrationSet", state, ctx, *, fp32: dict, int8: dict | None) -> tuple[dict, dict, list]:
    """The qat/ptq stages' ``sensitivity``: the sensitivity table on the calibration set and, with
    ``max_drop``, the fallback measured on the whole eval split (the split the stage's ``<metric>_drop``
    and the recipe's gates read). Returns (metrics, tables, gates); ``metrics[metric]`` is the metric
    after the fallback. ``fp32``/``int8``: the stage's evaluations of the float and the INT8 model on the
    eval split (``int8`` None: measured here)."""
    from pruneflow.evaluate import evaluate_model
    from pruneflow.gates import GateResult

    bounded = _fallback_metrics(spec, loc, state.task, fp32)

    def measure() -> dict[str, float]:
        got = evaluate_model(model, state.data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                             ctx.reporter, f"{stage_id} int8 fallback")
        return {n: float(got[n]) for n in bounded}

    groups = quantizer_groups(model, to(take(calib.x, slice(0, 1)), ctx.device))
    ranked = sensitivity(model, float_model, calib, state.task, groups, samples=spec.samples,
                         batch_size=ctx.recipe.data.eval_batch_size, device=ctx.device, alone=spec.alone_int8)
    tables: dict[str, list[dict]] = {"quantization sensitivity": [row for row, _ in ranked]}
    metrics: dict = {"sensitivity_groups": len(ranked), "sensitivity_samples": min(spec.samples, len(calib)),
                     "most_sensitive": ranked[0][0]["layer"] if ranked else ""}
    if spec.max_drop is None:
        return metrics, tables, []
    base = {n: float(fp32[n]) for n in bounded}
    start = {n: float(int8[n]) for n in bounded} if int8 and all(n in int8 for n in bounded) else measure()
    rows, value = fall_back(model, ranked, measure, baseline=base, start=start, max_drop=spec.max_drop,
                            max_fallback=spec.max_fallback, metrics=bounded)
    tables["quantization fallback"] = rows
    worse = {n: m.worsening(base[n], value[n]) for n, m in bounded.items()}
    held = max(worse.values()) <= spec.max_drop
    for n in bounded:
        metrics.update({f"{n}_before_fallback": start[n], n: value[n], f"{n}_drop": worse[n]})
    metrics.update({"fallback_layers": len(rows), "fallback_size_cost_bytes": sum(r["size_cost_bytes"] for r in rows)})
    kept = ", ".join(r["layer"] for r in rows) or "none"
    figures = "; ".join(f"int8 {n} {value[n]:.4g} vs fp32 {base[n]:.4g}: worse by {worse[n]:.4g} ({m.direction})"
                        for n, m in bounded.items())
    message = (f"{figures}; {'each' if len(bounded) > 1 else 'it'} {'<=' if held else 'not all <='} max_drop "
               f"{spec.max_drop:g} on the eval split; kept float: {kept}")
    if not held:
        message += (f" (max_fallback {spec.max_fallback} spent)" if len(rows) >= spec.max_fallback
                    else " (every quantized layer ranked)")
    return metrics, tables, [GateResult(f"{stage_id}.sensitivity", held, message, max(worse.values()))]
