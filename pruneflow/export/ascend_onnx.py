"""The Ascend target's ONNX: exported with static shapes at ATC's opset, folded, checked (onnx.checker, static shapes,
CANN's operator list) and compared in onnxruntime with the raw export and the onnx target's FP32 file."""

from __future__ import annotations

import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..deps import require
from ..errors import ExportError
from .bags import swap_bags
from .ascend_ops import OPS_DOCUMENTED_FOR, OPS_SOURCE, soc_family, unsupported_nodes

if TYPE_CHECKING:
    import onnx
    import torch

    from ..inputs import Inputs

#: The opset the model is exported at when torch cannot export at the configured one (then converted down).
FALLBACK_OPSET = 17


class StaticSettings(Protocol):
    """What the static export reads of the ascend target's settings (``AscendConfig``)."""

    batch: int
    opset: int
    extra_ops: list[str]
    soc_version: str


@dataclass
class Prepared:
    """A static ONNX ready for ATC, with what was checked on it."""

    model: "onnx.ModelProto"
    input_shape: tuple[int, ...]  # the first input's
    ops: dict[str, int]
    parity: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Every input's static shape, in the graph's order (a text model: input_ids, attention_mask, ...).
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def prepare_onnx(model: "torch.nn.Module", example: "Inputs", cfg: StaticSettings, samples: "Inputs",
                 reference: Path | None = None, sequence: int = 64) -> Prepared:
    """Export with a fixed batch at ``cfg.opset``, fold constants, check (full onnx.checker, static shapes,
    ATC's operator list), and compare in onnxruntime with the raw export and the onnx target's fp32 ONNX.
    A text model's (batch, sequence) inputs get the fixed length ``sequence`` (``data.max_length``)."""
    from .onnx import fold_constants

    onnx = require("onnx", "pip install onnx", "the ascend target")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.onnx"
        notes = export_static(model, example, raw_path, batch=cfg.batch, opset=cfg.opset, sequence=sequence)
        raw = onnx.load(str(raw_path))
    # The onnx target's folding (onnxscript): ATC sees the ResNet shortcut's Pad amounts as initializers,
    # not shape arithmetic, and no Identity nodes.
    # Shapes inferred first: with every dimension static, Shape of a tensor (an RNN's initial state) folds too.
    proto = to_opset(fold_constants(onnx.shape_inference.infer_shapes(raw, data_prop=True)), cfg.opset)
    del proto.graph.value_info[:]  # inferred again below, without entries of tensors folded away
    proto = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError and InferenceError
        raise ExportError(f"the ONNX for ATC failed onnx.checker (full check): {exc}") from exc
    ops = unsupported_nodes(proto, cfg.extra_ops)
    if ops:
        listed = ", ".join(f"{op} ({name})" for op, name in ops[:10]) + (f" and {len(ops) - 10} more" if len(ops) > 10 else "")
        raise ExportError(
            f"the model has operators ATC does not support for ONNX ({OPS_SOURCE}): {listed}",
            hint="replace them in the model (e.g. an equivalent built from supported ops), or, when your CANN version "
            "supports them, list their types in the ascend target's `extra_ops` (ATC's pre-check still decides)")
    check_static(proto)
    x = _numpy_samples(samples, sequence)
    parity = {"parity_max_abs_diff_vs_export": _parity(raw, proto, x, cfg.batch, 1e-4, "its own raw export")}
    if reference is not None:
        parity["parity_max_abs_diff_vs_onnx_fp32"] = _parity(onnx.load(str(reference)), proto, x, cfg.batch, 1e-3, reference.name)
    family = soc_family(cfg.soc_version)
    if family not in OPS_DOCUMENTED_FOR:
        notes.append(f"the CANN ONNX operator list is documented for {', '.join(sorted(OPS_DOCUMENTED_FOR))}; for {family} "
                     "it is the best reference there is, and ATC's pre-check (atc --mode=3) is authoritative")
    counts = dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))
    shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in proto.graph.input}
    return Prepared(proto, next(iter(shapes.values())), counts, parity, notes, shapes)


def _numpy_samples(samples: "Inputs", sequence: int) -> "np.ndarray | dict[str, np.ndarray]":
    """Parity samples as numpy; token inputs padded (0) or cut to the static ``sequence`` length."""
    if not isinstance(samples, dict):
        return samples.detach().cpu().numpy()
    out = {}
    for name, t in samples.items():
        v = t.detach().cpu().numpy()
        if v.ndim == 2 and v.dtype.kind in "iu":
            v = np.pad(v[:, :sequence], ((0, 0), (0, max(0, sequence - v.shape[1]))))
        out[name] = np.ascontiguousarray(v)
    return out


def export_static(model: "torch.nn.Module", example: "Inputs", path: Path, *, batch: int, opset: int,
                  sequence: int = 64) -> list[str]:
    """torch's TorchScript exporter with every dimension fixed; at ``opset`` when torch can, otherwise at
    FALLBACK_OPSET (then ``to_opset`` converts down). Several inputs (a text model) keep their names, in
    forward's order, token inputs at length ``sequence``. Returns notes on what was done."""
    import copy

    import torch

    from ..inputs import bind
    from .onnx import _Keyed

    model, _ = swap_bags(copy.deepcopy(model).cpu().eval())  # nn.EmbeddingBag in plain ops (bags.py)
    if isinstance(example, dict):
        bound = bind(model, {k: _static_like(v, batch, sequence) for k, v in example.items()})
        assert isinstance(bound, dict)
        names, args = list(bound), tuple(bound.values())
        model = _Keyed(model, names)
    else:
        names, args = ["input"], (_static_like(example, batch, sequence),)
    first: Exception | None = None
    for version in dict.fromkeys((opset, FALLBACK_OPSET)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, args, str(path), dynamo=False, opset_version=version,
                                  input_names=names, output_names=["logits"])
            return [] if version == opset else [f"torch could not export at opset {opset} ({first}); exported at "
                                                f"opset {version} and converted with onnx.version_converter"]
        except Exception as exc:  # noqa: BLE001 - torch raises many types when a model will not trace
            first = first or exc
    raise ExportError(f"the model could not be exported to a static ONNX for ATC: {type(first).__name__}: {first}",
                      hint="data-dependent control flow does not trace; make the forward pass shape-static")


def _static_like(t: "torch.Tensor", batch: int, sequence: int) -> "torch.Tensor":
    """A tensor shaped like ``t`` with ``batch`` rows (and ``sequence`` columns for token inputs): random
    floats, or ones for integers (valid token ids and a full attention mask)."""
    import torch

    from ..inputs import is_token

    shape = (batch, sequence, *t.shape[2:]) if is_token(t) else (batch, *t.shape[1:])
    return torch.randn(shape) if t.dtype.is_floating_point else torch.ones(shape, dtype=t.dtype)


def to_opset(model: "onnx.ModelProto", opset: int) -> "onnx.ModelProto":
    """``onnx.version_converter`` to ``opset``. It upgrades well but has few down-conversion adapters
    (none from Relu-14 or Identity-16 down, checked with onnx 1.23): a missing one is an ExportError."""
    from onnx import version_converter

    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), opset)
    if current == opset:
        return model
    try:
        return version_converter.convert_version(model, opset)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError from C++ assertions
        detail = str(exc).strip().splitlines()[-1]
        raise ExportError(f"onnx.version_converter cannot convert the model from opset {current} to {opset}: {detail}",
                          hint="set the ascend target's `opset` to one torch exports this model at (11 to 17)") from exc


def check_static(model: "onnx.ModelProto") -> None:
    """Every input, output and inferred intermediate tensor has fixed, positive dimensions."""
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    dynamic = [v.name for v in values if v.type.HasField("tensor_type") and (
        not v.type.tensor_type.HasField("shape") or any(d.dim_value <= 0 for d in v.type.tensor_type.shape.dim))]
    if dynamic:
        raise ExportError(f"the ONNX for ATC still has dynamic or unknown shapes: {', '.join(dynamic[:5])}",
                          hint="ATC needs static shapes: make the forward pass independent of the input's values")


def _parity(source: "onnx.ModelProto", converted: "onnx.ModelProto", x: Any, batch: int, limit: float, what: str) -> float:
    """Largest |difference| of the two models' outputs in onnxruntime over ``x`` (an array, or named arrays
    for several inputs; whole batches of ``batch``); more than ``limit`` (times the largest output, when that
    exceeds 1) is an ExportError."""
    rows = _rows(x)
    if rows < batch:
        x = _select(x, np.arange(batch) % rows)
        rows = batch
    x = _select(x, slice(0, rows // batch * batch))
    a, b = _run_onnx(source, x, batch), _run_onnx(converted, x, batch)
    n = min(len(a), len(b))
    diff = float(np.abs(a[:n].astype(np.float64) - b[:n]).max())
    allowed = limit * max(1.0, float(np.abs(a).max()))  # relative for large logits (float32 sums in another order)
    if not diff <= allowed:
        raise ExportError(f"the ONNX for ATC differs from {what} in onnxruntime: max abs diff {diff:.3g} > {allowed:.3g}",
                          hint="report the model to pruneflow; the constant folding or opset conversion changed it")
    return diff



def _rows(x: Any) -> int:
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def _select(x: Any, index: Any) -> Any:
    return {k: v[index] for k, v in x.items()} if isinstance(x, dict) else x[index]


def _run_onnx(proto: "onnx.ModelProto", x: Any, batch: int) -> np.ndarray:
    """Outputs over ``x`` fed at the model's static batch, or ``batch`` at a time when its batch is dynamic."""
    ort = require("onnxruntime", "pip install onnxruntime", "the ascend target's parity check")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    first = inputs[0]
    step = first.shape[0] if isinstance(first.shape[0], int) and first.shape[0] > 0 else batch
    feeds = x if isinstance(x, dict) else {first.name: x}
    return np.concatenate([session.run(None, {i.name: feeds[i.name][r : r + step] for i in inputs})[0]
                           for r in range(0, _rows(x) - step + 1, step)])
