"""`pruneflow doctor` for the ptq and qat stages: NNCF quantizes the model that will enter them, on one batch.

The check runs the stage's own ``quantize`` (same ``ignore``, preset, activation type) on a copy, with a
calibration set of the one batch doctor holds, then runs the quantized copy forward. A failure names the
module NNCF stopped in (``nncf_quant.failing_module``) and the fix; success leaves the quantized model on the
state, so the export checks after it try the int8 export of the model the run will have.
"""

from __future__ import annotations

import copy

import torch

from pruneflow.errors import StageError
from pruneflow.handle import ModelHandle
from pruneflow.inputs import call, to
from pruneflow.stage import Check

CHECK = "NNCF quantization on one batch"


def extension_check() -> Check:
    """Whether NNCF's C++ kernels are built for this environment, and where (read before the check below builds
    them): a doctor that waited minutes on a rebuild said nothing of it (issue 26)."""
    from .nncf_setup import BUILD_TOOLS_HINT, FALLBACK, extension_state, missing_build_tools, pin_ninja

    pin_ninja()
    built, folder = extension_state()
    if built:
        return Check("NNCF C++ extension", "ok", f"built, reused from {folder}")
    missing = missing_build_tools()
    if missing:
        return Check("NNCF C++ extension", "will skip", f"cannot be built here: {'; '.join(missing)}: {FALLBACK}",
                     BUILD_TOOLS_HINT)
    return Check("NNCF C++ extension", "ok", f"not built yet: built now, once for this environment, in {folder} (compiled "
                 "once; later runs reuse it)", "build it ahead: python -m pruneflow.qat.nncf_setup")


def quantize_checks(stage, state, ctx) -> list[Check]:
    """The rows of a ptq or qat stage (``Stage.doctor``); a ConfigError (an ``ignore`` NNCF refuses) propagates,
    so doctor reports it at its recipe line."""
    from pruneflow.calibrate.build import build_calibration_set

    from .nncf_quant import quantize, quantizer_parameters

    cfg = stage.config
    if not stage.quantizes(cfg):
        return [Check(CHECK, "ok", "no int8 phase: the stage trains in floating point only")]
    kernels = extension_check()
    split = state.data.train if state.data.train is not None else state.data.eval
    calib = build_calibration_set(split, size=len(split), strategy="random", seed=ctx.seed)
    base = copy.deepcopy(state.model).eval()
    try:
        quantized = quantize(copy.deepcopy(state.model), calib, cfg, ignore_loc=stage.loc("ignore"), task=state.task)
        with torch.no_grad():
            call(quantized.eval(), to(state.data.eval.x, ctx.device))
    except StageError as exc:
        return [kernels, Check(CHECK, "will fail", exc.message, exc.hint or "")]
    state.handle = ModelHandle(quantized, kind="nncf", float_base=base)
    kept = f"; kept float by `ignore`: {', '.join(cfg.ignore)}" if cfg.ignore else ""
    return [kernels, Check(CHECK, "ok", f"{len(quantizer_parameters(quantized))} quantizer parameters inserted, the quantized "
                  f"model runs on {len(state.data.eval)} samples{kept}")]
