"""FakeQuantize insertion through NNCF: per-channel symmetric int8 weights, per-tensor activations,
ranges initialised from the calibration set, ignored scopes by module name or NNCF node regex."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
from typing import Iterator

import torch
from torch import nn

from pruneflow.errors import ConfigError, StageError
from pruneflow.inputs import Inputs, bind, take, to

from calibrate.calibset import CalibrationSet
from calibrate.consumers import nncf_dataset

from .nncf_setup import ensure_built

log = logging.getLogger("pruneflow")


@contextlib.contextmanager
def quiet_nncf() -> Iterator[None]:
    """NNCF draws Rich progress bars on stdout and logs there; the CLI's stdout belongs to --json."""
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        nncf_log.setLevel(level)
        if buffer.getvalue().strip():
            log.debug("nncf: %s", buffer.getvalue().strip()[-2000:])


def ignored_scope(model: nn.Module, ignore: list[str]):
    """NNCF IgnoredScope from module names (``features.0``) or regexes over NNCF node names."""
    import nncf

    if not ignore:
        return None
    modules = {n for n, _ in model.named_modules() if n}
    patterns = []
    for item in ignore:
        if item in modules:
            patterns.append(re.escape(item.replace(".", "/")) + "(/.*)?")  # NNCF node names use '/'
        else:
            patterns.append(item)
    return nncf.IgnoredScope(patterns=patterns, validate=True)


def quantize(model: nn.Module, calib: CalibrationSet, *, ignore: list[str] | None = None, preset: str = "performance",
             batch_size: int = 32, activations: str = "signed", ignore_loc: tuple = ("ignore",)) -> nn.Module:
    """Insert FakeQuantize operations and set their ranges from ``calib``. Returns the quantized model.

    ``ignore_loc``: the recipe key path of ``ignore`` (the stage's ``self.loc("ignore")``), for the error
    when NNCF refuses a pattern.

    ``activations="signed"`` forces every activation quantizer to int8 (-128..127, zero point 0), the
    only activation type TensorRT accepts; the CPU INT8 form writes the same grid as uint8 (zero point 0
    and a Clip at 127 after a ReLU, zero point 128 elsewhere), so one set of trained scales serves both
    (pruneflow/export/qdq.py). ``"auto"`` lets
    NNCF use unsigned quantizers after ReLU (one more bit there, but no exact TensorRT form).
    """
    ensure_built()
    import nncf

    scripted = [name for name, m in model.named_modules() if name and isinstance(m, torch.jit.ScriptModule)]
    if scripted or isinstance(model, torch.jit.ScriptModule):
        raise StageError(
            f"NNCF cannot trace TorchScript modules, and the model has {', '.join(map(repr, scripted[:3])) or 'a scripted root'} "
            f"({type(model.get_submodule(scripted[0]) if scripted else model).__name__})",
            hint="build the model from its Python class instead of torch.jit.script/torch.jit.load",
        )
    params = next(model.parameters(), None)
    dataset = nncf_dataset(calib, batch_size, device=str(params.device) if params is not None else None)
    items = -(-len(calib) // batch_size)
    was = model.training
    model.eval()
    try:
        with quiet_nncf():
            quantized = nncf.quantize(model, dataset, subset_size=items, ignored_scope=ignored_scope(model, ignore or []),
                                      preset=nncf.QuantizationPreset(preset))
    except nncf.ValidationError as exc:
        raise ConfigError(ignore_loc, str(exc), hint="use module names from `pruneflow inspect`, or NNCF node-name regexes") from exc
    except Exception as exc:  # noqa: BLE001 - tracing failures come in many types
        where = failing_module(model, exc)
        raise StageError(
            f"NNCF could not quantize the model{f' (failed in module {where!r})' if where else ''}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            hint="NNCF traces the forward pass: data-dependent control flow or unsupported ops stop it; "
            "`ignore` the module that fails, or run the ptq/qat stages on an exportable model",
        ) from exc
    if activations == "signed":
        force_signed_activations(quantized)
    quantized.train(was)
    return quantized


def failing_module(model: nn.Module, exc: BaseException) -> str | None:
    """The name of the innermost module of ``model`` whose code was running when ``exc`` was raised."""
    import traceback

    names = {id(m): n for n, m in model.named_modules() if n}
    found = None
    seen: set[int] = set()
    link: BaseException | None = exc  # then its cause or context, down the chain
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        for frame, _ in traceback.walk_tb(link.__traceback__):
            owner = frame.f_locals.get("self")
            if id(owner) in names:
                found = names[id(owner)]
        link = link.__cause__ or link.__context__
    return found


def force_signed_activations(model: nn.Module) -> int:
    """Make every per-tensor symmetric activation quantizer signed (int8, zero point 0); returns how many changed.

    NNCF's hardware configs do not let `signedness_to_force` constrain activations, so this is done
    on the inserted quantizers: an unsigned one covering [0, s] in 256 steps becomes [-s·128/127, s]
    in steps of s/127 (the same scale parameter, half the resolution for non-negative inputs), which is
    what TensorRT would run anyway. QAT then trains with the grid that is exported.
    """
    from nncf.torch.quantization.layers import SymmetricQuantizer

    changed = 0
    for module in model.modules():
        if isinstance(module, SymmetricQuantizer) and not module.per_channel and not module.signed:
            module.signed = True
            changed += 1
    return changed


def strip_quantizers(model: nn.Module, example: Inputs) -> nn.Module:
    """A CPU copy of ``model`` with NNCF's quantizers replaced by torch's native fake-quant ops.

    torch.onnx writes those as QuantizeLinear/DequantizeLinear pairs, the input of pruneflow's INT8 passes
    (pruneflow/export/qdq.py). The live model may be on a GPU and still in use, hence the copy.
    """
    import warnings

    import nncf

    copied = copy.deepcopy(model).cpu().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = bind(copied, to(take(example, slice(0, 1)), "cpu"))
        return nncf.strip(copied, do_copy=False, example_input=one).eval()


def quantizer_parameters(model: nn.Module) -> list:
    """The trainable range parameters NNCF added (frozen late in QAT)."""
    return [p for n, p in model.named_parameters() if "__nncf_hooks" in n and p.is_floating_point() and p.requires_grad]
