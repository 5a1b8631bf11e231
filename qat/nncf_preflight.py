"""Can NNCF quantize this model? Asked before any training, on one calibration-shaped batch.

The qat/ptq stages quantize late in a run, after earlier stages trained for minutes or hours; an NNCF
failure there used to surface as an internal error from NNCF. This check runs the same quantization
(``nncf_quant.nncf_quantize``: the same rooting, the same ``ignore`` resolution) on a copy of the model
and one batch, and turns a failure into a ConfigError (exit 2) on the stage that names the failing module
(path and class) and the ``ignore`` entry that avoids it, checked by quantizing again with that entry.

    check_quantizable(model, batch, NncfSettings(ignore=["head"]), loc=("stages", 3))
"""

from __future__ import annotations

import copy

from torch import nn

from pruneflow.errors import ConfigError
from pruneflow.inputs import Inputs, to

from .nncf_quant import failing_module, nncf_quantize
from .nncf_setup import ensure_built
from .settings import NncfSettings


def _try(model: nn.Module, batch: Inputs, settings: NncfSettings, loc: tuple) -> BaseException | None:
    """Quantize a CPU copy of ``model`` on ``batch``; the exception NNCF raised, or None when it worked."""
    import nncf

    copied = copy.deepcopy(model).cpu().eval()
    try:
        nncf_quantize(copied, nncf.Dataset([batch]), 1, batch, settings, (*loc, "ignore"))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - tracing failures come in many types
        exc.failing_module = failing_module(copied, exc)  # type: ignore[attr-defined]
        return exc
    return None


def check_quantizable(model: nn.Module, batch: Inputs, settings: NncfSettings, *, loc: tuple) -> list[str]:
    """Raise ConfigError at ``loc`` (the stage) when NNCF cannot quantize ``model`` as ``settings`` say; returns
    notes otherwise."""
    ensure_built()
    batch = to(batch, "cpu")
    ignore = settings.ignore
    failure = _try(model, batch, settings, loc)
    if failure is None:
        return []
    where = getattr(failure, "failing_module", None)
    what = f"{type(failure).__name__}: {str(failure).strip().splitlines()[0] if str(failure).strip() else ''}"
    if where is None:
        raise ConfigError(loc, f"NNCF cannot quantize the model ({what}) and no module of it was running when it failed",
                          hint="NNCF traces the forward pass: check that the model runs under torch.no_grad on CPU, "
                          "or remove the qat/ptq stage (and int8 from export)")
    kind = type(model.get_submodule(where)).__name__
    fixed = _try(model, batch, settings.model_copy(update={"ignore": [*ignore, where]}), loc) is None
    if fixed:
        raise ConfigError(loc, f"NNCF cannot quantize module {where!r} ({kind}): {what}",
                          hint=f"keep it in float: add {where!r} to this stage's `ignore` (`ignore: {[*ignore, where]}`); "
                          "checked: NNCF quantizes the rest of the model with it")
    raise ConfigError(loc, f"NNCF cannot quantize the model: it fails in module {where!r} ({kind}): {what}; keeping that "
                      "module in float (`ignore`) does not avoid it, NNCF traces the whole model",
                      hint=f"change {kind} so it runs in plain PyTorch ops (no TorchScript, no tensors leaving torch), "
                      "or remove the qat/ptq stage (and int8 from export)")
