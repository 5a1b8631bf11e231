"""Model checkpoints inside a run directory.

A model whose structure still matches its factory is saved as a plain state_dict (weights-only
loading). One whose structure changed (pruning) is saved whole, and a whole module is unpickled only
when our own manifest records the file's sha256: pickles run code, so we load only what we wrote.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from .artifacts import atomic_path, known_sha256
from .errors import InputError

FORMAT = "pruneflow-checkpoint/1"


def save_checkpoint(model: nn.Module, path: Path, *, whole_module: bool = False) -> None:
    payload = {"format": FORMAT, "state_dict": model.state_dict()}
    base = getattr(model, "_pruneflow_float_base", None)
    if base is not None:
        # NNCF-quantized: its hooks do not pickle; NNCF's own config + the float module rebuild it.
        import nncf.torch

        payload.update(module=base, nncf_config=nncf.torch.get_config(model))
    elif whole_module:
        payload["module"] = model
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_checkpoint(path: Path, into: nn.Module | None = None) -> nn.Module:
    """Load a run-directory checkpoint: into ``into`` (state_dict) or, for a whole module, as a new model."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
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
    try:
        into.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise InputError(f"{path} does not fit the model built from the recipe: {exc}") from exc
    return into


def _load_quantized(base: nn.Module, payload: dict) -> nn.Module:
    import copy

    from qat.nncf_setup import ensure_built

    ensure_built()
    import nncf.torch

    model = nncf.torch.load_from_config(copy.deepcopy(base), payload["nncf_config"])
    model.load_state_dict(payload["state_dict"])
    object.__setattr__(model, "_pruneflow_float_base", base)
    return model.eval()
