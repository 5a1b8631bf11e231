"""Ascend INT8: AMCT's post-training quantization of the bundle's static FP32 ONNX, calibrated on the run's calibration
set, then ATC on the model AMCT deploys.

pruneflow does not quantize for Ascend itself: the NPU runs AMCT's own int8 operators (AscendQuant / AscendDequant
in its ``*_deploy_model.onnx``), which no other tool writes. What it prepares, in ``export/ascend/int8/``:

- ``calibration/<input>/NNNNN.bin``: the calibration set (the calibrate stage's ``amct: true`` files, the samples
  pruneflow's own quantization saw) regrouped into batches of the OM's static batch size, one directory per input,
  raw little-endian in the ONNX input's dtype, names in lexicographic order, as ``amct_onnx calibration`` reads them;
- the command: ``amct_onnx calibration --model=model.onnx --save_path=quant/model --input_shape=... --data_dir=...
  --data_types=... --batch_num=N``, writing ``quant/model_deploy_model.onnx`` (for ATC) and
  ``quant/model_fake_quant_model.onnx`` (AMCT's onnxruntime simulation of it);
- checks made here: every batch file decodes to the calibration samples it came from, and model.onnx runs on every
  batch in onnxruntime with finite outputs (the inference AMCT's calibration makes).

Where ``amct_onnx`` and CANN's ``atc`` are on PATH both run and the OM is built; otherwise the bundle is
"prepared, not built" and ``convert.sh`` does both on the machine that has them.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ExportError
from .ascend_ops import first_errors, onnx_inputs

if TYPE_CHECKING:
    import onnx

SAVE_PATH = "quant/model"
DEPLOY_MODEL = "quant/model_deploy_model.onnx"
AMCT_TIMEOUT_S = 3600


def read_amct_set(calibration_list: Path) -> dict[str, np.ndarray]:
    """The calibrate stage's AMCT files (``calibrate.consumers.write_amct``: one .bin per sample and input, listed in
    calibration_list.txt, shapes and dtypes in inputs.json) as one array per input, samples in list order."""
    folder = calibration_list.parent
    spec = json.loads((folder / "inputs.json").read_text())
    rows = [line.split() for line in calibration_list.read_text().splitlines() if line.strip()]
    out = {}
    for i, (name, info) in enumerate(spec.items()):
        dtype = np.dtype(info["dtype"]).newbyteorder("<")
        shape = tuple(info["shape"][1:])
        arrays = [np.fromfile(folder / row[i], dtype=dtype).reshape(shape) for row in rows]
        out[name] = np.stack(arrays) if arrays else np.empty((0, *shape), dtype)
    return out


def prepare_amct(folder: Path, model: "onnx.ModelProto", calibration_list: Path) -> dict[str, Any]:
    """Write ``calibration/`` for AMCT into the bundle ``folder`` (beside ``model``, its model.onnx), check it against
    model.onnx, and return the ``amct`` entry of status.json (the command, its argv, the deploy model, what was checked)."""
    inputs = onnx_inputs(model)
    samples = read_amct_set(calibration_list)
    missing = [name for name in inputs if name not in samples]
    if missing:
        raise ExportError(f"the calibration set has inputs {', '.join(samples)}, and the Ascend ONNX needs {', '.join(inputs)}",
                          hint="calibrate with the model this export writes (a calibrate stage after any stage changing its inputs)")
    batch = int(next(iter(inputs.values()))["shape"][0])
    count = len(next(iter(samples.values()))) // batch
    if count == 0:
        raise ExportError(f"the calibration set has {len(next(iter(samples.values())))} samples, fewer than the OM's "
                          f"static batch {batch}", hint="calibrate more samples (`size:`), or lower the ascend target's `batch`")
    for name, info in inputs.items():
        arr = _fit(samples[name], info, name)[: count * batch].reshape(count, batch, *info["shape"][1:])
        (folder / "calibration" / name).mkdir(parents=True, exist_ok=True)
        for i, block in enumerate(arr):
            np.ascontiguousarray(block).astype(np.dtype(info["dtype"]).newbyteorder("<")).tofile(folder / "calibration" / name / f"{i:05d}.bin")
    checked = _check(folder, inputs, count)
    argv = ["amct_onnx", "calibration", "--model=model.onnx", f"--save_path={SAVE_PATH}",
            "--input_shape=" + ";".join(f"{n}:{','.join(map(str, i['shape']))}" for n, i in inputs.items()),
            "--data_dir=" + ";".join(f"calibration/{n}/" for n in inputs),
            "--data_types=" + ";".join(i["dtype"] for i in inputs.values()), f"--batch_num={count}"]
    return {"command": shlex.join(argv), "argv": argv, "deploy_model": DEPLOY_MODEL, "batches": count, "batch": batch,
            "samples": count * batch, "source": str(calibration_list.name), "checked": checked}


def _fit(arr: np.ndarray, info: dict[str, Any], name: str) -> np.ndarray:
    """Samples shaped as the static ONNX input: token rows padded with 0 or cut to its length; anything else must match."""
    want = tuple(info["shape"][1:])
    if arr.shape[1:] == want:
        return arr
    if arr.ndim == 2 and len(want) == 1 and arr.dtype.kind in "iu":
        fitted = np.zeros((len(arr), want[0]), dtype=arr.dtype)
        fitted[:, : min(want[0], arr.shape[1])] = arr[:, : want[0]]
        return fitted
    raise ExportError(f"calibration samples of input {name!r} have shape {list(arr.shape[1:])}, and the Ascend ONNX "
                      f"takes {list(want)}", hint="calibrate with the data and model this export writes")


def _check(folder: Path, inputs: dict[str, dict[str, Any]], count: int) -> str:
    """Read every batch file back and run model.onnx on it in onnxruntime: AMCT's calibration inference, here."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    for i in range(count):
        feed = {name: np.fromfile(folder / "calibration" / name / f"{i:05d}.bin",
                                  dtype=np.dtype(info["dtype"]).newbyteorder("<")).reshape(info["shape"])
                for name, info in inputs.items()}
        outputs = session.run(None, feed)
        if not all(np.isfinite(np.asarray(o, dtype=np.float64)).all() for o in outputs):
            raise ExportError(f"model.onnx gives non-finite outputs on calibration batch {i}: AMCT would calibrate on them",
                              hint="check the calibration data and the model in onnxruntime")
    return f"each of the {count} batch files read back and run through model.onnx in onnxruntime: outputs finite"


def run_amct(folder: Path, amct: dict[str, Any], status: dict[str, Any], executable: str) -> bool:
    """AMCT's calibration in the bundle; True when it wrote the deploy model, else ``status`` says it failed."""
    try:
        done = subprocess.run([executable, *amct["argv"][1:]], cwd=folder, capture_output=True, text=True,
                              timeout=AMCT_TIMEOUT_S, check=False)
        code, log = done.returncode, done.stdout + done.stderr
    except (subprocess.TimeoutExpired, OSError) as exc:
        code, log = 124, f"ERROR: amct_onnx did not finish: {exc}\n"
    (folder / "amct.log").write_text(log)
    deploy = folder / DEPLOY_MODEL
    if code == 0 and deploy.is_file() and deploy.stat().st_size > 0:
        return True
    status["status"] = "failed"
    status["errors"] = first_errors(log) or [f"amct_onnx exited {code} without writing {DEPLOY_MODEL}"]
    return False
