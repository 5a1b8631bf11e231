"""Model checkpoints inside a run directory, loaded without unpickling code.

A model whose structure still matches its factory is saved as a plain state_dict. One whose structure
changed (pruning) is saved as its state_dict plus a *structure*: per module, its class name and its
plain attributes (channel and feature counts, head counts, kernel sizes). Loading builds the model
from the recipe, sets those attributes, gives every parameter and buffer its saved shape, swaps in
the known rewrites (the option-A shortcut's ChannelEmbedConv, a removed block's Identity) and loads the weights: everything goes
through ``torch.load(weights_only=True)``, so a checkpoint from anywhere cannot run code.

torch-pruning's own ``tp.state_dict`` pickles each module's ``__dict__``, and its ``load_pruning_history``
needs the dependency graph traced again on the right example; this needs neither (ours).

Whole pickled modules (checkpoints of earlier versions, and the float base of an NNCF-quantized model,
whose hooks NNCF rebuilds from its config) are unpickled only when our own manifest records the file's
sha256.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from .artifacts import atomic_path, known_sha256
from .errors import InputError

FORMAT = "pruneflow-checkpoint/1"
_PLAIN = (int, float, bool, str, type(None))


def save_checkpoint(model: nn.Module, path: Path, *, whole_module: bool = False) -> None:
    """``whole_module``: the structure changed (pruning), so the structure is saved with the weights."""
    payload = {"format": FORMAT, "state_dict": model.state_dict()}
    base = getattr(model, "_pruneflow_float_base", None)
    if base is not None:
        # NNCF-quantized: its hooks do not pickle; NNCF's own config + the float module rebuild it.
        import nncf.torch

        # The float base is described like a pruned model (never pickled); NNCF's config holds plain
        # values and NNCF enums, which loading allows by name (see _weights_only_load).
        payload.update(nncf_config=nncf.torch.get_config(model), base_structure=describe_structure(base),
                       base_state_dict=base.state_dict())
    elif whole_module:
        payload["structure"] = describe_structure(model)
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def describe_structure(model: nn.Module) -> dict[str, dict]:
    """Per module: class name and public plain attributes (what shapes the module beyond its tensors)."""
    return {name: {"class": type(m).__name__,
                   "attrs": {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training" and _plain(v)}}
            for name, m in model.named_modules()}


def restore_structure(model: nn.Module, structure: dict[str, dict], state_dict: dict[str, torch.Tensor], path: Path) -> nn.Module:
    """A copy of ``model`` (built from the recipe) reshaped to ``structure``, with ``state_dict`` loaded.

    ``model`` itself is left as it was, also when the checkpoint does not fit.
    """
    import copy

    from .prune.surgery import ChannelEmbedConv

    def mismatch(detail: str) -> InputError:
        return InputError(f"{path} holds a pruned model that does not fit the model the recipe builds: {detail}",
                          hint="inspect or resume it with the recipe of the run that wrote it (its recipe.resolved.yaml)")

    if not isinstance(structure, dict) or not all(isinstance(d, dict) and isinstance(d.get("attrs"), dict) for d in structure.values()):
        raise InputError(f"{path} is not a pruneflow checkpoint (its structure is malformed)")
    model = copy.deepcopy(model)
    for name, desc in structure.items():  # parents come before their children
        modules = dict(model.named_modules())
        module = modules.get(name)
        if module is None:
            raise mismatch(f"the recipe's model has no module {name!r}")
        if type(module).__name__ != desc.get("class"):
            if desc.get("class") not in (ChannelEmbedConv.__name__, "Identity") or not name:
                raise mismatch(f"module {name!r} is a {type(module).__name__}, the checkpoint's a {desc.get('class')}")
            if desc["class"] == "Identity":
                module = nn.Identity()  # a residual block removed by depth pruning
            else:
                module = ChannelEmbedConv(1, 0, 1)  # its sizes and stride come from the attributes, its weight from state_dict
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module)
        for key, value in desc["attrs"].items():
            # Only what describe_structure writes: public plain values, never hooks, methods or dunders.
            if not isinstance(key, str) or key.startswith("_") or not _plain(value) \
                    or isinstance(getattr(type(module), key, None), property) or callable(getattr(module, key, None)):
                continue
            setattr(module, key, value)
    modules = dict(model.named_modules())
    for key, tensor in state_dict.items():
        owner, _, leaf = key.rpartition(".")
        module = modules.get(owner)
        if module is None:
            raise mismatch(f"the recipe's model has no module {owner!r} (for {key})")
        old = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
        if old is None or old.shape == tensor.shape:
            continue
        if leaf in module._parameters:
            setattr(module, leaf, nn.Parameter(torch.empty_like(tensor), requires_grad=old.requires_grad))
        else:
            module._buffers[leaf] = torch.empty_like(tensor)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:
        raise mismatch(str(exc).splitlines()[0]) from exc
    model._pruneflow_restructured = True
    return model


def load_checkpoint(path: Path, into: nn.Module | None = None) -> nn.Module:
    """Load a run-directory checkpoint: into ``into`` (state_dict) or, for a whole module, as a new model."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint not found: {path}")
    try:
        payload = _weights_only_load(path)
        whole = False
    except pickle.UnpicklingError as exc:  # a pickled module is refused by weights-only loading
        if "Unsupported global" not in str(exc) and "GLOBAL" not in str(exc):
            raise InputError(f"{path} is not a readable checkpoint (not a torch file, or damaged)") from exc
        whole = True
    except Exception as exc:  # noqa: BLE001 - truncated or not a torch file
        raise InputError(f"{path} is not a readable checkpoint: {type(exc).__name__}: {exc}") from exc
    if whole:
        if not known_sha256(path):
            raise InputError(
                f"{path} holds a pickled model, and no pruneflow manifest records its sha256",
                hint="pruneflow only unpickles checkpoints its own runs wrote (the manifest.json beside them lists "
                "their sha256); for other files, save a state_dict and use model.checkpoint",
            )
        payload = torch.load(path, map_location="cpu", weights_only=False)
        module = payload.get("module") if isinstance(payload, dict) else None
        if not isinstance(module, nn.Module):
            raise InputError(f"{path} is not a pruneflow checkpoint")
        if "nncf_config" in payload:
            return _load_quantized(module, payload)
        return module
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise InputError(f"{path} is not a pruneflow checkpoint", hint="use model.checkpoint for plain state_dicts")
    if into is None:
        raise InputError(f"{path} holds weights only; the model to load them into is built from the recipe")
    if "structure" in payload:
        return restore_structure(into, payload["structure"], payload["state_dict"], path)
    if "nncf_config" in payload:
        return _load_quantized(restore_structure(into, payload["base_structure"], payload["base_state_dict"], path), payload)
    try:
        into.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise InputError(f"{path} does not fit the model built from the recipe: {exc}") from exc
    return into


# NNCF's config (nncf.torch.get_config) holds plain values and this enum, rebuilt from its value.
_NNCF_ENUMS = {"nncf.common.quantization.structs.QuantizationScheme"}


def _weights_only_load(path: Path):
    """``torch.load(weights_only=True)``, also allowing the named NNCF enum classes of a quantized
    checkpoint (imported only when the file needs them; no code of the file runs)."""
    import importlib
    import re

    allowed: list[type] = []
    while True:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)\.(\w+)", str(exc))
            name = found and f"{found.group(1)}.{found.group(2)}"
            if name not in _NNCF_ENUMS or any(f"{c.__module__}.{c.__qualname__}" == name for c in allowed):
                raise
            allowed.append(getattr(importlib.import_module(found.group(1)), found.group(2)))


def _load_quantized(base: nn.Module, payload: dict) -> nn.Module:
    import copy

    from qat.nncf_setup import ensure_built

    ensure_built()
    import nncf.torch

    model = nncf.torch.load_from_config(copy.deepcopy(base), payload["nncf_config"])
    model.load_state_dict(payload["state_dict"])
    object.__setattr__(model, "_pruneflow_float_base", base)
    return model.eval()
