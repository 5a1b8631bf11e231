"""Model checkpoints inside a run directory: weights, structure and plain values, never code.

What a checkpoint (``FORMAT``, written by :func:`save_checkpoint` from a :class:`ModelHandle`) holds:

- ``structure`` and ``state_dict`` of the handle's *float* module (its float base for a quantized
  kind): per module, its class name and its plain attributes (channel and feature counts, head counts,
  kernel sizes), and its tensors. Recorded for every model, so one that a stage reshaped (pruning, or
  a third-party stage that knows nothing about checkpoints) reloads without a flag saying so.
- ``kind`` (a registered :class:`~pruneflow.handle.ModelKind`), ``meta`` (the handle's plain values)
  and ``kind_payload``: what that kind adds, e.g. NNCF's quantizer config and the quantized weights.

How it is loaded (:func:`load_checkpoint`): ``torch.load(weights_only=True)``, which allows only
tensors, plain containers and values, plus the classes the registered kinds name in ``safe_globals``
(imported only when a file holds them). No code of the file runs, and a file that holds anything else
(a pickled module) is refused. Then the recipe's model is copied and reshaped to ``structure``: its
attributes set, every parameter and buffer given its saved shape, a module of another class swapped in where
that class is registered as rebuildable (``registry.rebuildable_modules``, entry point
``pruneflow.rebuildable_modules``: the code that puts such a module in a model registers it, e.g. pruning's
option-A shortcut ChannelEmbedConv, a removed block's Identity, a HeadAttention that lost heads), the
weights loaded. The kind turns that float model into the handle (``ModelKind.restore``).

torch-pruning's own ``tp.state_dict`` pickles each module's ``__dict__``, and its ``load_pruning_history``
needs the dependency graph traced again on the right example; this needs neither (ours).
"""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import registry
from .artifacts import atomic_path
from .errors import InputError, PruneflowError
from .handle import ModelHandle
from .preflight import check_dtypes

FORMAT = "pruneflow-checkpoint/2"
_PLAIN = (int, float, bool, str, type(None))


def save_checkpoint(handle: ModelHandle, path: Path) -> None:
    """Write ``handle`` atomically: its float module's structure and weights, its kind and the kind's payload.

    The structure is recorded whatever the stage did, so any reshaped model reloads.
    """
    base = handle.float_base if handle.float_base is not None else handle.module
    payload = {"format": FORMAT, "kind": handle.kind, "structure": describe_structure(base),
               "state_dict": base.state_dict(), "meta": dict(handle.meta),
               "kind_payload": handle.behaviour.checkpoint_payload(handle)}
    with atomic_path(path) as tmp:
        tmp.write_bytes(checkpoint_bytes(payload))


def checkpoint_bytes(payload: Any) -> bytes:
    """``torch.save`` of ``payload`` into memory: identical tensors and values give identical bytes.

    Saved to a path, torch names the zip records after the file (``.model.pt.x1y2.tmp/data.pkl``), so a
    checkpoint written through a temporary name differed from run to run; in memory the archive is
    always named ``archive``.
    """
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def describe_structure(model: nn.Module) -> dict[str, dict]:
    """Per module: class name and public plain attributes (what shapes the module beyond its tensors)."""
    return {name: {"class": type(m).__name__,
                   "attrs": {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training" and _plain(v)}}
            for name, m in model.named_modules()}


#: What to do with a checkpoint file that cannot be used: the run that wrote it can write it again.
_RERUN = ("re-run the stage that wrote it (`pruneflow optimize RECIPE --out OUT --resume` redoes a stage whose checkpoint "
          "is damaged); a state_dict of your own goes in the recipe's model.checkpoint")

def restore_structure(model: nn.Module, structure: dict[str, dict], state_dict: dict[str, torch.Tensor], path: Path) -> nn.Module:
    """A copy of ``model`` (built from the recipe) reshaped to ``structure``, with ``state_dict`` loaded.

    ``model`` itself is left as it was, also when the checkpoint does not fit. Nothing is set on the
    copy beyond what the structure and the weights describe.
    """
    if not isinstance(structure, dict) or not all(isinstance(d, dict) and isinstance(d.get("attrs"), dict) for d in structure.values()):
        raise InputError(f"{path} is not a pruneflow checkpoint (its structure is malformed)", hint=_RERUN)
    _check_dtypes(model, state_dict, path)
    model = copy.deepcopy(model)
    _reshape_modules(model, structure, path)
    _reshape_tensors(model, state_dict, path)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:
        raise _mismatch(path, str(exc).splitlines()[0]) from exc
    return model


def _check_dtypes(model: nn.Module, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Each tensor must be of the kind (int, float, bool) of the recipe model's: reshaping takes the file's dtype,
    and ``load_state_dict`` would cast the rest silently."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise InputError(f"{path} is not a pruneflow checkpoint (its state_dict holds more than tensors)", hint=_RERUN)
    try:
        check_dtypes(model.state_dict(), state_dict, path)
    except InputError as exc:
        raise InputError(exc.message.replace("model.checkpoint ", "", 1),
                         hint="re-run the stage that wrote it; a checkpoint keeps each tensor's dtype") from None


def _mismatch(path: Path, detail: str) -> InputError:
    return InputError(f"{path} holds a model that does not fit the model the recipe builds: {detail}",
                      hint="inspect or resume it with the recipe of the run that wrote it (its recipe.resolved.yaml)")


def _reshape_modules(model: nn.Module, structure: dict[str, dict], path: Path) -> None:
    """Swap in the registered rebuildable modules and set each module's recorded plain attributes (parents before
    children)."""
    rebuildable = registry.rebuildable_modules
    modules = dict(model.named_modules())
    for name, desc in structure.items():
        module = modules.get(name)
        if module is None:
            raise _mismatch(path, f"the recipe's model has no module {name!r}")
        if type(module).__name__ != desc.get("class"):
            if not name or desc.get("class") not in rebuildable.names():
                raise _mismatch(path, f"module {name!r} is a {type(module).__name__}, the checkpoint's a {desc.get('class')}")
            # A blank one: its sizes come from the attributes below, its tensors from the state_dict.
            module = rebuildable.get(desc["class"])()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module)
            modules = dict(model.named_modules())  # the replaced module's children are gone
        for key, value in desc["attrs"].items():
            # Only what describe_structure writes: public plain values, never hooks, methods or dunders.
            if not isinstance(key, str) or key.startswith("_") or not _plain(value):
                continue
            if isinstance(getattr(type(module), key, None), property) or callable(getattr(module, key, None)):
                continue
            setattr(module, key, value)


def _reshape_tensors(model: nn.Module, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Give every parameter and buffer the saved shape (empty; load_state_dict fills them). A parameter the recipe's
    model ties between modules (an item table that is also the output projection) gets one new parameter for all
    of them: a pruned width stays tied when it reloads."""
    modules = dict(model.named_modules())
    reshaped: dict[int, nn.Parameter] = {}
    for key, tensor in state_dict.items():
        owner, _, leaf = key.rpartition(".")
        module = modules.get(owner)
        if module is None:
            raise _mismatch(path, f"the recipe's model has no module {owner!r} (for {key})")
        old = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
        if old is None or old.shape == tensor.shape:
            continue
        if leaf in module._parameters:
            shared = reshaped.get(id(old))
            if shared is None or shared.shape != tensor.shape:
                shared = reshaped[id(old)] = nn.Parameter(torch.empty_like(tensor), requires_grad=old.requires_grad)
            setattr(module, leaf, shared)
        else:
            module._buffers[leaf] = torch.empty_like(tensor)


def load_checkpoint(path: Path, into: nn.Module | None = None) -> ModelHandle:
    """The handle a run-directory checkpoint describes; ``into`` is the model the recipe builds (never changed:
    reshaped in a copy).

    >>> handle = load_checkpoint(run_dir / "stages/02-prune/model.pt", into=build_model(recipe.model))
    >>> handle.kind, handle.module
    """
    path = Path(path)
    payload = _current(_read(path), path)
    if into is None:
        raise InputError(f"{path} holds weights and structure, not code: the model to load them into is built from the recipe",
                         hint="pass into=build_model(recipe.model), the model the run's recipe builds; or `pruneflow inspect RUN_DIR`")
    base = restore_structure(into, payload["structure"], payload["state_dict"], path)
    kind = registry.model_kinds.get(payload["kind"])()
    try:
        handle = kind.restore(base, payload["kind_payload"])
    except PruneflowError:
        raise
    except Exception as exc:  # noqa: BLE001 - the kind's backend refusing what the file holds (e.g. NNCF's import guard)
        raise InputError(f"{path}: its {payload['kind']!r} model could not be restored: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}",
                         hint="re-run the stage that wrote it; a checkpoint is restored only from what its kind records") from exc
    return handle.evolve(meta=dict(payload["meta"])) if payload["meta"] else handle


class PickledCheckpointError(InputError):
    """A checkpoint holds pickled Python objects (code could run on loading): refused, never loaded.

    Distinct from a merely unusable file: ``--resume`` reruns a stage whose checkpoint is damaged, but
    stops (exit 2) on this one, since a file that a run's records vouch for was replaced.
    """


def _read(path: Path) -> Any:
    """The file's contents through weights-only loading; every way that fails is an InputError naming the file."""
    if not path.is_file():
        raise InputError(f"checkpoint not found: {path}", hint="a stage writes RUN_DIR/stages/NN-STAGE/model.pt (manifest.json lists "
                         "them); check the path, or run the recipe first")
    try:
        return _weights_only_load(path)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc) and "GLOBAL" not in str(exc):
            raise InputError(f"{path} is not a readable checkpoint (not a torch file, or damaged)", hint=_RERUN) from exc
        raise PickledCheckpointError(
            f"{path} holds pickled Python objects (e.g. a whole module), which pruneflow never unpickles: "
            "its checkpoints are weights, structure and plain values",
            hint="re-run the stage that wrote it with this version of pruneflow (earlier versions pickled pruned models), "
            "or save the model's state_dict and use model.checkpoint",
        ) from exc
    except Exception as exc:  # noqa: BLE001 - truncated or not a torch file
        raise InputError(f"{path} is not a readable checkpoint: {type(exc).__name__}: {exc}", hint=_RERUN) from exc


def _current(payload: Any, path: Path) -> dict[str, Any]:
    """``payload`` when it is a checkpoint of the current ``FORMAT`` with every part; an InputError otherwise (this
    version reads no earlier format: re-run the stage that wrote one)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("format"), str) or not payload["format"].startswith("pruneflow-checkpoint/"):
        raise InputError(f"{path} is not a pruneflow checkpoint", hint="use model.checkpoint for plain state_dicts")
    if payload["format"] != FORMAT:
        raise InputError(f"{path} is a pruneflow checkpoint of another format ({payload['format']}); this version reads {FORMAT}",
                         hint="re-run the stage that wrote it with this version of pruneflow")
    missing = [k for k in ("kind", "structure", "state_dict", "meta", "kind_payload") if k not in payload]
    if missing:
        raise InputError(f"{path} is not a pruneflow checkpoint (it has no {', '.join(missing)})", hint=_RERUN)
    return payload


def _weights_only_load(path: Path) -> Any:
    """``torch.load(weights_only=True)``, also allowing the classes a registered model kind names in
    ``safe_globals`` (imported only when the file needs them; no code of the file runs)."""
    import importlib
    import re

    allowed: list[Any] = []
    while True:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)\.(\w+)", str(exc))
            if found is None or f"{found.group(1)}.{found.group(2)}" not in _kind_safe_globals():
                raise
            if any(f"{c.__module__}.{c.__qualname__}" == f"{found.group(1)}.{found.group(2)}" for c in allowed):
                raise  # allowed already, and still refused: not what the kind declared
            allowed.append(getattr(importlib.import_module(found.group(1)), found.group(2)))


def _kind_safe_globals() -> set[str]:
    """Every class name a registered model kind declares safe (asked only when a file holds a class)."""
    kinds = registry.model_kinds
    return {name for kind in kinds.names() for name in kinds.get(kind).safe_globals}
