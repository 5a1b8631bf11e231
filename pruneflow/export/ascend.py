"""Ascend target: a static-shape ONNX at ATC's opset, checked against ATC's operator list, an AIPP config
from the recipe's preprocessing, and the ATC commands; the OM itself where CANN's ``atc`` is on PATH.

One bundle per precision under ``export/ascend/<precision>/``: ``model.onnx``, ``convert.sh``,
``README.md``, ``status.json`` (and ``aipp.cfg``, ``model.om`` when made). ATC casts to FP16 itself
(``--precision_mode``), so the fp16 bundle holds the same FP32 ONNX with another precision mode; the int8 one adds
the calibration batches and AMCT's quantization before ATC (``ascend_int8.py``).

Status: ``built`` only when an identified CANN ``atc`` made ``model.om`` here (and even then the OM is
not run: there is no Ascend runtime on such a machine); ``prepared`` when ``atc`` is absent, or when
the ``atc`` on PATH is not part of a CANN toolkit (a stand-in: its output is not kept); ``failed``
with ATC's own first error lines when its pre-check or conversion fails.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from ..artifacts import Artifact, publish_dir
from ..deps import require
from ..errors import ExportError, TargetUnavailableError
from ..stage import BuildInputs, Target, TargetConfig
from .ascend_onnx import Prepared, prepare_onnx
from .ascend_ops import OPS_SOURCE, SOC_FAMILIES, SOC_VERSIONS, first_errors, onnx_inputs

PrecisionMode = Literal["force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype", "allow_mix_precision"]
AippFormat = Literal["RGB888_U8", "BGR888_U8", "YUV420SP_U8", "YUV400_U8"]

#: The precision mode a precision gets by default, and those that agree with it.
DEFAULT_MODE = {"fp32": "must_keep_origin_dtype", "fp16": "force_fp16", "int8": "force_fp16"}
MODES_FOR = {"fp32": ("must_keep_origin_dtype", "allow_fp32_to_fp16", "allow_mix_precision"),
             "fp16": ("force_fp16", "allow_mix_precision", "allow_fp32_to_fp16"),
             # int8: the layers AMCT quantized run in int8 whatever the mode; it sets the rest's float type
             "int8": ("force_fp16", "allow_mix_precision", "allow_fp32_to_fp16", "must_keep_origin_dtype")}
AMCT_NOT_ON_PATH = "prepared, not built: Ascend AMCT (amct_onnx) not on PATH"
ATC_TIMEOUT_S = 3600
NOT_ON_PATH = "prepared, not built: CANN atc not on PATH"
# YUV420SP (JPEG, BT.601 full range) -> RGB: ATC instructions, AIPP "CSC Configuration", JPEG column.
JPEG_YUV_TO_RGB = ((256, 0, 359), (256, -88, -183), (256, 454, 0))
JPEG_YUV_BIAS = (0, 128, 128)


class AscendConfig(TargetConfig):
    type: Literal["ascend"] = Field(default="ascend", description="Ascend OM model (built where CANN atc is on PATH, prepared otherwise).")
    soc_version: str = Field(
        default="Ascend310P3",
        description="ATC's --soc_version: `Ascend` + the chip name `npu-smi info` prints on the target machine "
        "(e.g. Ascend310P3, Ascend310B1, Ascend910B3).",
    )
    opset: int = Field(default=11, ge=9, le=18, description="ONNX opset of the model handed to ATC (11 is what ATC's ONNX parser covers best).")
    batch: int = Field(default=1, ge=1, le=1024, description="Static batch size of the OM (ATC wants static shapes).")
    precision_mode: PrecisionMode | None = Field(
        default=None,
        description="ATC's --precision_mode. Default: from the precision written, `must_keep_origin_dtype` for fp32, "
        "`force_fp16` for fp16 and for int8 (the layers AMCT leaves in float).",
    )
    aipp: bool = Field(
        default=False,
        description="Insert static AIPP (aipp.cfg from the recipe's data scale/mean/std): the OM then takes uint8 "
        "images instead of normalised float tensors.",
    )
    input_format: AippFormat = Field(
        default="RGB888_U8",
        description="AIPP input image format: RGB888_U8 or BGR888_U8 (interleaved HWC; BGR is swapped to the model's "
        "RGB), YUV420SP_U8 (NV12, JPEG colour conversion to RGB) or YUV400_U8 (grayscale, one-channel models).",
    )
    extra_ops: list[str] = Field(
        default=[],
        description="ONNX operator types to accept beyond the documented CANN list (a newer CANN supports them); "
        "ATC's own pre-check still decides.",
    )

    @field_validator("soc_version")
    @classmethod
    def _known_soc(cls, value: str) -> str:
        if value not in SOC_VERSIONS:
            import difflib

            near = difflib.get_close_matches(value, SOC_VERSIONS, n=1)
            known = "; ".join(f"{fam}: {', '.join(socs)}" for fam, socs in SOC_FAMILIES.items())
            guess = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown Ascend SoC {value!r}{guess}; known: {known}")
        return value


@dataclass
class Aipp:
    """Static AIPP: ``out_c = (pixel_c - mean_chn_c - min_chn_c) * var_reci_chn_c`` on the uint8 image."""

    input_format: str
    width: int
    height: int
    min_chn: list[float]
    var_reci_chn: list[float]
    rbuv_swap: bool = False
    csc: bool = False

    def cfg(self) -> str:
        """aipp.cfg in ATC's format (``--insert_op_conf``)."""
        fmt = "RGB888_U8" if self.input_format == "BGR888_U8" else self.input_format
        lines = ["# Generated by pruneflow from the recipe's data scale, mean and std.",
                 "# out_c = (pixel_c - mean_chn_c - min_chn_c) * var_reci_chn_c, on uint8 pixels, in the model's channel order.",
                 "aipp_op {", "    aipp_mode: static", f"    input_format: {fmt}", "    related_input_rank: 0",
                 f"    src_image_size_w: {self.width}", f"    src_image_size_h: {self.height}", "    crop: false",
                 f"    csc_switch: {str(self.csc).lower()}", f"    rbuv_swap_switch: {str(self.rbuv_swap).lower()}"]
        if self.csc:
            lines += [f"    matrix_r{r}c{c}: {v}" for r, row in enumerate(JPEG_YUV_TO_RGB) for c, v in enumerate(row)]
            lines += [f"    input_bias_{i}: {b}" for i, b in enumerate(JPEG_YUV_BIAS)]
        for i, (lo, reci) in enumerate(zip(self.min_chn, self.var_reci_chn)):
            lines += [f"    mean_chn_{i}: 0", f"    min_chn_{i}: {lo!r}", f"    var_reci_chn_{i}: {reci!r}"]
        return "\n".join(lines + ["}"]) + "\n"

    def input_contract(self) -> str:
        h, w = self.height, self.width
        return {"RGB888_U8": f"uint8 RGB image, interleaved HWC ({h}x{w}x3 bytes)",
                "BGR888_U8": f"uint8 BGR image, interleaved HWC ({h}x{w}x3 bytes; AIPP swaps it to RGB)",
                "YUV420SP_U8": f"uint8 YUV420SP (NV12) image, {h}x{w} luma then interleaved UV ({h * w * 3 // 2} bytes)",
                "YUV400_U8": f"uint8 grayscale image ({h}x{w} bytes)"}[self.input_format]


def aipp_from_data(data_spec: Any, cfg: AscendConfig, input_shape: tuple[int, ...]) -> Aipp:
    """AIPP that turns a uint8 image into exactly what pruneflow feeds the model (``pruneflow.data``):
    ``(pixel * scale - mean) / std`` with ``scale`` 1/255 for uint8 images under ``scale: auto``, so
    ``min_chn = mean / scale`` (255*mean) and ``var_reci_chn = scale / std`` (1/(255*std))."""
    if len(input_shape) != 3:
        raise ExportError(f"AIPP needs an image model (C, H, W input); this model's input is {tuple(input_shape)}",
                          hint="set `aipp: false` on the ascend target")
    c, h, w = input_shape
    want = 1 if cfg.input_format == "YUV400_U8" else 3
    if c != want:
        raise ExportError(f"ascend input_format {cfg.input_format} gives {want} channel(s), but the model takes {c}",
                          hint="use YUV400_U8 for one-channel models and RGB888_U8, BGR888_U8 or YUV420SP_U8 for three")
    if cfg.input_format == "YUV420SP_U8" and (h % 2 or w % 2):
        raise ExportError(f"YUV420SP_U8 needs an even image size; the model takes {h}x{w}", hint="use RGB888_U8")
    scale = 1 / 255 if data_spec.scale == "auto" else float(data_spec.scale)
    mean = list(data_spec.mean) if data_spec.mean is not None else [0.0] * c
    std = list(data_spec.std) if data_spec.std is not None else [1.0] * c
    aipp = Aipp(cfg.input_format, w, h, [m / scale for m in mean], [scale / s for s in std],
                rbuv_swap=cfg.input_format == "BGR888_U8", csc=cfg.input_format == "YUV420SP_U8")
    bad = [v for v in aipp.min_chn if not 0 <= v <= 255] + [v for v in aipp.var_reci_chn if abs(v) > 65504]
    if bad:
        raise ExportError(f"data.mean/std/scale give AIPP values outside ATC's ranges (min_chn 0..255, var_reci_chn "
                          f"|v| <= 65504): {bad}", hint="AIPP fits pixel data scaled to [0, 1] or [0, 255]; set `aipp: false`")
    return aipp


class AscendTarget(Target[AscendConfig]):
    Config = AscendConfig
    precisions = ("fp32", "fp16", "int8")
    #: int8: AMCT calibrates the FP32 ONNX on the run's calibration set (``export/ascend_int8.py``), then ATC.
    quantizes_itself = True

    @classmethod
    def recipe_rules(cls, config, precisions, recipe, index, loc):
        """int8 is calibrated by AMCT from the calibration set's AMCT files: a stage before the export writes them."""
        if "int8" in precisions and not any(getattr(s, "amct", False) for s in recipe.stages[:index]):
            from ..errors import ConfigError

            yield ConfigError((*loc, "type"), "the ascend target's int8 is quantized by AMCT from the run's calibration set, "
                              "and no stage before this export writes it in AMCT's format", value="ascend",
                              hint="add a calibrate stage with `amct: true` before the export (e.g. `{type: calibrate, "
                              "size: 512, amct: true}`), or give the target `precisions: [fp32, fp16]`")
    #: The onnx target's fp32 ONNX, when built in this stage, is the parity reference and the parent.
    depends_on = ["onnx"]

    def __init__(self, config: AscendConfig):
        super().__init__(config)
        #: The ONNX prepared for the model handle it came from, shared by the precisions of one export.
        self._prepared: tuple[Any, Prepared] | None = None

    def preflight(self) -> list[str]:
        require("onnx", "pip install onnx", "the ascend target")
        require("onnxruntime", "pip install onnxruntime", "the ascend target (ONNX parity before ATC)")
        atc = shutil.which("atc")
        if atc is None:
            if self.config.required:
                raise TargetUnavailableError(
                    "the ascend target is required (`required: true`) but CANN's atc is not on PATH, so no OM can be built here",
                    hint="source the CANN toolkit's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) before running, "
                    "or set `required: false` on the ascend target to get the prepared bundle (ONNX, aipp.cfg, atc commands)")
            return [f"ascend: {NOT_ON_PATH}"]
        version = cann_version(Path(atc))
        if version is None and self.config.required:
            raise TargetUnavailableError(
                f"the ascend target is required (`required: true`) but the atc on PATH ({atc}) is not part of a CANN toolkit "
                "(no version.info beside it), so an OM it wrote would not be trusted",
                hint="put the CANN toolkit's atc first on PATH (source its set_env.sh), or set `required: false`")
        return [f"ascend: atc at {atc} ({'CANN ' + version if version else 'not inside a CANN toolkit: its output will not be trusted'})"]

    def build(self, state, ctx, out_dir: Path, precision: str, given: BuildInputs) -> Artifact:
        cfg = self.config
        mode = precision_mode_for(cfg, precision)
        if cfg.aipp and isinstance(state.example_input, dict):
            raise ExportError(f"the ascend target's `aipp: true` is for image models; this model takes {', '.join(state.example_input)}",
                              hint="set `aipp: false` on the ascend target (text inputs go to the OM as they are)")
        reference = self._reference_onnx(given.upstream)
        if self._prepared is None or self._prepared[0] is not state.handle:  # one ONNX for every precision
            from ..inputs import take

            samples = take(state.data.eval.x, slice(0, 64)) if state.data is not None else state.example_input
            self._prepared = (state.handle, prepare_onnx(state.handle.float_module(), state.example_input, cfg, samples,
                                                         ctx.run_dir / reference.path if reference else None,
                                                         sequence=int(ctx.recipe.data.max_length)))
        prepared = self._prepared[1]
        aipp = aipp_from_data(ctx.recipe.data, cfg, prepared.input_shape[1:]) if cfg.aipp else None
        amct = next((a.path for a in state.artifacts if a.kind == "amct-calibration"), None)
        if precision == "int8" and amct is None:
            raise ExportError("the ascend int8 bundle needs the run's calibration set in AMCT's format, and no stage wrote it",
                              hint="add `amct: true` to the calibrate stage before the export")
        bundle = out_dir / precision
        tmp = Path(tempfile.mkdtemp(prefix=f".{precision}.", dir=out_dir))
        try:
            status = write_bundle(tmp, prepared, cfg, precision, mode, aipp, amct,
                                  amct_list=ctx.run_dir / amct if amct and precision == "int8" else None)
            publish_dir(tmp, bundle)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if status["status"] == "failed" and cfg.required:
            raise ExportError(f"ATC failed on export/ascend/{precision}: " + "; ".join(status["errors"][:3]),
                              hint=f"read {bundle / 'atc.log'}; rerun {bundle / 'convert.sh'} after the fix")
        return _artifact(ctx.run_dir, bundle, status, precision, reference)

    def _reference_onnx(self, upstream: list[Artifact]) -> Artifact | None:
        """The onnx target's fp32 ONNX built earlier in this export stage, if any."""
        return next((a for a in upstream if a.label == "onnx.fp32" and a.status == "built"), None)


def precision_mode_for(cfg: AscendConfig, precision: str) -> str:
    mode = cfg.precision_mode or DEFAULT_MODE[precision]
    if mode not in MODES_FOR[precision]:
        raise ExportError(f"ascend precision_mode {mode!r} does not write {precision}: it allows {', '.join(MODES_FOR[precision])}",
                          hint=f"leave precision_mode unset (it follows the precision) or drop {precision} from the export's precisions")
    return mode


def _artifact(run_dir: Path, bundle: Path, status: dict, precision: str, reference: Artifact | None) -> Artifact:
    main = bundle / ("model.om" if status["status"] == "built" else "model.onnx")
    artifact = Artifact.from_file(run_dir, main, kind="ascend-om" if status["status"] == "built" else "ascend-bundle",
                                  producer="export", status=status["status"], target="ascend", precision=precision)
    for file in sorted(bundle.rglob("*")):  # the int8 bundle's calibration/ (and quant/, where AMCT ran) too
        if file.is_file() and file != main:
            artifact.add_file(run_dir, file)
    artifact.metrics.update({f"onnx_{k}": v for k, v in status["onnx"]["parity"].items()})
    artifact.notes += status["notes"] + status["errors"][:3]
    if reference is not None:
        artifact.parent = reference.path
    return artifact


def atc_commands(cfg: AscendConfig, mode: str, input_shape: "tuple[int, ...] | dict[str, tuple[int, ...]]",
                 aipp: bool, model: str = "model.onnx") -> tuple[list[str], list[str]]:
    """ATC's pre-check (``--mode=3``: writes check_result.json, needs no NPU) and conversion, run in the bundle.
    ``input_shape``: the one input's static shape, or every input's by name (``input_ids:1,64;attention_mask:1,64``;
    ``--input_format=ND`` then, as for any input that is not one NCHW image)."""
    shapes = input_shape if isinstance(input_shape, dict) else {"input": tuple(input_shape)}
    image = len(shapes) == 1 and len(next(iter(shapes.values()))) == 4
    listed = ";".join(f"{name}:{','.join(map(str, shape))}" for name, shape in shapes.items())
    precheck = ["atc", "--mode=3", "--framework=5", f"--model={model}", f"--soc_version={cfg.soc_version}"]
    convert = ["atc", "--framework=5", f"--model={model}", "--output=model", f"--soc_version={cfg.soc_version}",
               f"--input_shape={listed}", f"--input_format={'NCHW' if image else 'ND'}", f"--precision_mode={mode}"]
    if aipp:
        convert.append("--insert_op_conf=aipp.cfg")
    return precheck, convert


def write_bundle(folder: Path, prepared: Prepared, cfg: AscendConfig, precision: str, mode: str,
                 aipp: Aipp | None, amct: str | None, amct_list: Path | None = None) -> dict:
    """Write model.onnx, aipp.cfg, convert.sh (int8, from ``amct_list``: the calibration batches and AMCT's command
    first, ``ascend_int8.py``); run AMCT and ATC when on PATH; then status.json and README.md. Returns the status."""
    import onnx

    from .ascend_int8 import prepare_amct

    onnx.save(prepared.model, str(folder / "model.onnx"))
    if aipp is not None:
        (folder / "aipp.cfg").write_text(aipp.cfg())
    quant = prepare_amct(folder, prepared.model, amct_list) if amct_list is not None else None
    precheck, convert = atc_commands(cfg, mode, prepared.input_shapes or prepared.input_shape, aipp is not None,
                                     model=quant["deploy_model"] if quant else "model.onnx")
    _write_script(folder, precheck, convert, quant)
    status: dict[str, Any] = {
        "status": "prepared", "precision": precision, "soc_version": cfg.soc_version, "precision_mode": mode,
        "commands": {**({"amct": quant["command"]} if quant else {}), "precheck": shlex.join(precheck),
                     "convert": shlex.join(convert)},
        "onnx": {"opset": cfg.opset, "input_shape": list(prepared.input_shape),
                 "inputs": onnx_inputs(prepared.model),
                 "ops": prepared.ops, "parity": prepared.parity,
                 "operator_list": OPS_SOURCE},
        "aipp": None if aipp is None else {"input_format": aipp.input_format, "input": aipp.input_contract()},
        "amct_calibration": amct, "amct": quant, "atc": None, "errors": [], "notes": list(prepared.notes),
    }
    _run_tools(folder, status, precheck, convert, quant)
    (folder / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    (folder / "README.md").write_text(bundle_readme(status, cfg, aipp))
    return status


def _write_script(folder: Path, precheck: list[str], convert: list[str], quant: dict | None) -> None:
    amct = (f"# AMCT post-training quantization from calibration/ (writes {quant['deploy_model']}; source CANN's set_env.sh).\n"
            f"{quant['command']}\n") if quant else ""
    script = folder / "convert.sh"
    script.write_text("#!/bin/sh\n# Generated by pruneflow: model.onnx -> model.om with CANN's ATC (source CANN's set_env.sh first).\n"
                      f'set -e\ncd "$(dirname "$0")"\n{amct}'
                      f"# Pre-check: writes check_result.json, needs no NPU.\n{shlex.join(precheck)}\n{shlex.join(convert)}\n")
    script.chmod(0o755)


def _run_tools(folder: Path, status: dict, precheck: list[str], convert: list[str], quant: dict | None) -> None:
    """AMCT (int8) then ATC, each only when on PATH; what is absent is said in the notes."""
    from .ascend_int8 import run_amct

    atc, amct = shutil.which("atc"), shutil.which("amct_onnx")
    if quant is not None and amct is None:
        status["notes"].append(AMCT_NOT_ON_PATH)
    elif atc is None:
        status["notes"].append(NOT_ON_PATH)
    elif quant is None or run_amct(folder, quant, status, amct):  # type: ignore[arg-type]
        run_atc(folder, Path(atc), precheck, convert, status)


def run_atc(folder: Path, atc: Path, precheck: list[str], convert: list[str], status: dict) -> None:
    """Pre-check, then convert; fills ``status``. Only an ``atc`` inside a CANN toolkit can make a built OM."""
    version = cann_version(atc)
    status["atc"] = {"path": str(atc), "cann_version": version}
    code, log = _run([str(atc), *precheck[1:]], folder)
    failures = parse_check_result(folder / "check_result.json")
    if code != 0 or failures:
        status["status"] = "failed"
        status["errors"] = [f"ATC pre-check: {f}" for f in failures] + first_errors(log) or [f"ATC pre-check exited {code}"]
        (folder / "atc.log").write_text(log)
        return
    code, log = _run([str(atc), *convert[1:]], folder)
    (folder / "atc.log").write_text(log)
    om = folder / "model.om"
    if code != 0 or not om.is_file() or om.stat().st_size == 0:
        status["status"] = "failed"
        status["errors"] = first_errors(log) or [f"ATC exited {code} without writing model.om"]
    elif version is None:
        om.unlink()
        status["notes"].append(f"prepared, not built: the atc at {atc} is not part of a CANN toolkit (no version.info "
                               "beside it), so what it wrote is not taken for an OM and was removed")
    else:
        status["status"] = "built"
        status["notes"].append(f"built by CANN {version} atc, not run: there is no Ascend runtime here, so the OM's "
                               "outputs were not compared with the ONNX (the ONNX was)")


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=ATC_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        partial = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o for o in (exc.stdout, exc.stderr) if o)
        return 124, f"{partial}\nERROR: atc did not finish within {ATC_TIMEOUT_S} s\n"
    except OSError as exc:
        return 127, f"ERROR: could not start atc: {exc}\n"
    return done.returncode, done.stdout + done.stderr


def parse_check_result(path: Path) -> list[str]:
    """The operators ATC's pre-check failed, as ``type (name): reason``. The file lists one entry per
    operator with a ``result``; this reads any entry whose result is not a success, wherever it sits."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        return [f"check_result.json is not JSON ({exc})"]
    found: list[str] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            result = str(item.get("result", item.get("status", "success"))).lower()
            if result not in ("success", "succeed", "pass", "passed", "ok"):
                op = item.get("type") or item.get("op_type") or "?"
                name = item.get("name") or item.get("op_name") or "?"
                reason = item.get("reason") or item.get("message") or result
                found.append(f"{op} ({name}): {json.dumps(reason) if not isinstance(reason, str) else reason}")
            stack.extend(v for k, v in item.items() if isinstance(v, (dict, list)))
    return found


def cann_version(atc: Path) -> str | None:
    """The CANN version of the toolkit ``atc`` belongs to (``version.info``: ``Version=8.0.0``), None when
    it belongs to none: a stand-in, or a copy outside a toolkit."""
    for folder in list(Path(atc).resolve().parents)[:4]:
        info = folder / "version.info"
        if info.is_file():
            match = re.search(r"^\s*version\s*=\s*(\S+)", info.read_text(errors="replace"), re.I | re.M)
            if match:
                return match.group(1)
    return None


def bundle_readme(status: dict, cfg: AscendConfig, aipp: Aipp | None) -> str:
    """The bundle's README: status, input contract, commands, checks, and what is left for INT8."""
    shape = status["onnx"]["input_shape"]
    headline = {"built": "built: model.om was made here by CANN's atc (not run: no Ascend runtime here)",
                "prepared": "prepared, not built: run convert.sh where CANN's atc is installed",
                "failed": "failed: ATC rejected the model (its messages below and in atc.log)"}[status["status"]]
    lines = [f"# Ascend OM bundle ({status['precision']}, {cfg.soc_version})", "", f"Status: **{headline}**.", ""]
    lines += [f"- {note}" for note in status["notes"] + status["errors"]]
    lines += ["", "## Input contract", ""]
    inputs = status["onnx"]["inputs"]
    if aipp is None and len(inputs) > 1:
        lines += [f"- `{name}`: {i['dtype']} {i['shape']}" for name, i in inputs.items()]
        tokens = [i["shape"][1] for i in inputs.values() if len(i["shape"]) == 2 and i["dtype"].startswith("int")]
        if tokens:
            lines.append(f"\nToken inputs have the static length {tokens[0]} (`data.max_length`): pad every request to it (0, "
                         "attention_mask 0 on the padding) and cut longer ones, as a tokenizer does with padding='max_length'. "
                         "ATC takes them as `--input_format=ND`; no AIPP.")
    elif aipp is None:
        lines.append(f"Input `input`: float32 NCHW {shape}, preprocessed exactly as for training (scaled, mean/std normalised).")
    else:
        lines += [f"**Changed by AIPP**: the OM takes a {aipp.input_contract()} per batch item (batch {shape[0]}), not a "
                  "normalised float tensor. AIPP applies the recipe's normalisation on the NPU "
                  "(`out = (pixel - min_chn) * var_reci_chn` per channel, see aipp.cfg), in FP16 arithmetic, so expect "
                  "differences of FP16 rounding against the float preprocessing.",
                  "The ONNX (model.onnx) keeps the float NCHW input; only the OM changes."]
    lines += ["", "## Commands", "", "```sh", "./convert.sh   # or, by hand:", status["commands"]["precheck"],
              status["commands"]["convert"], "```", "",
              f"`--precision_mode={status['precision_mode']}`: "
              + ("keeps FP32 where the SoC has FP32 kernels; if ATC reports an operator without FP32 support, "
                 "use `precision_mode: allow_fp32_to_fp16`." if status["precision"] == "fp32" else
                 "ATC casts the FP32 ONNX to FP16 itself (this bundle's model.onnx is FP32)."),
              "", "## Checks made here", "",
              f"- ONNX opset {status['onnx']['opset']}, every shape static, onnx.checker full check passed.",
              f"- Operators {', '.join(f'{k} x{v}' for k, v in status['onnx']['ops'].items())}: all on {OPS_SOURCE}.",
              "- onnxruntime parity: " + ", ".join(f"{k} {v:.2e}" for k, v in status["onnx"]["parity"].items()) + "."]
    lines += _int8_readme(status)
    return "\n".join(lines) + "\n"


def _int8_readme(status: dict) -> list[str]:
    """The INT8 part: in the int8 bundle, AMCT's step and what was checked of it; elsewhere, how to get one."""
    quant = status.get("amct")
    if quant:
        return ["", "## INT8 (AMCT, then ATC)", "",
                f"AMCT calibrates model.onnx on `calibration/` ({quant['batches']} batches of {quant['batch']}: the "
                "run's calibration set, the samples pruneflow's own quantization saw) and writes "
                f"`{quant['deploy_model']}`, which ATC converts (the commands above, in that order in convert.sh). "
                "AMCT also writes `quant/model_fake_quant_model.onnx`, its simulation in onnxruntime: compare its "
                "task metric with the run's FP32 and INT8 figures before deploying.",
                f"- Checked here: {quant['checked']}.", f"- AMCT command: `{quant['command']}`"]
    lines = ["", "## INT8", "", "The run's `int8` precision on this target writes an AMCT + ATC bundle "
             "(`export/ascend/int8/`)."]
    if status["amct_calibration"]:
        lines.append(f"The run's AMCT calibration input is `{status['amct_calibration']}` (relative to the run folder: one raw "
                     "float32 .bin per sample, listed in calibration_list.txt, shapes in inputs.json).")
    else:
        lines.append("Add `amct: true` to the recipe's calibrate stage to write AMCT calibration input for it.")
    return lines
