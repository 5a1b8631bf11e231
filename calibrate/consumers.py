"""One calibration set, every consumer: onnxruntime static quantization, NNCF/OpenVINO post-training
quantization (and QAT range initialisation, which reads the same NNCF dataset), Ascend AMCT.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pruneflow.artifacts import write_text_atomic
from pruneflow.deps import require

from pruneflow.inputs import as_mapping, feed, to

from .calibset import CalibrationSet


def ort_reader(calib: CalibrationSet, input_name: str = "input", batch_size: int = 1):
    """An onnxruntime ``CalibrationDataReader`` over the set (for ``quantize_static``)."""
    require("onnxruntime.quantization", "pip install onnxruntime", "onnxruntime calibration")
    from onnxruntime.quantization import CalibrationDataReader  # present: require raised otherwise

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._batches = iter(list(calib.batches(batch_size)))

        def get_next(self):
            batch = next(self._batches, None)
            return None if batch is None else feed(batch, [input_name] if not isinstance(batch, dict) else None)

        def rewind(self):
            self._batches = iter(list(calib.batches(batch_size)))

    return Reader()


def nncf_dataset(calib: CalibrationSet, batch_size: int = 1, as_numpy: bool = False, device: str | None = None):
    """An ``nncf.Dataset`` of input batches: torch tensors (on ``device``) for torch models (QAT range
    init, PTQ), numpy arrays for OpenVINO models."""
    nncf = require("nncf", "pip install nncf", "NNCF quantization")
    items = [(b.numpy() if not isinstance(b, dict) else feed(b)) if as_numpy else b for b in calib.batches(batch_size)]
    if device and not as_numpy:
        return nncf.Dataset(items, lambda b: to(b, device))
    return nncf.Dataset(items)


def write_amct(calib: CalibrationSet, out_dir: str | Path, input_names: tuple[str, ...] = ("input",)) -> Path:
    """Ascend AMCT / ATC calibration input: one raw little-endian .bin per sample and input, plus a list file.

    Layout: ``out_dir/<input>/NNNNN.bin`` (C-order, the set's dtype), ``out_dir/calibration_list.txt``
    (one line a sample, the inputs' paths separated by spaces), and ``inputs.json`` (names, shapes, dtypes).
    """
    out = Path(out_dir)
    lines = []
    arrays = {k: v.numpy() for k, v in as_mapping(calib.x).items()}
    if not isinstance(calib.x, dict):
        arrays = {input_names[0]: arrays.popitem()[1]}
    input_names = tuple(arrays)
    for name in input_names:
        (out / name).mkdir(parents=True, exist_ok=True)
    for i in range(len(calib)):
        paths = []
        for name, arr in arrays.items():
            path = out / name / f"{i:05d}.bin"
            np.ascontiguousarray(arr[i : i + 1]).astype(arr.dtype.newbyteorder("<")).tofile(path)
            paths.append(path.relative_to(out).as_posix())
        lines.append(" ".join(paths))
    write_text_atomic(out / "calibration_list.txt", "\n".join(lines) + "\n")
    write_text_atomic(out / "inputs.json", json.dumps(
        {name: {"shape": [1, *arr.shape[1:]], "dtype": str(arr.dtype)} for name, arr in arrays.items()}, indent=2) + "\n")
    return out / "calibration_list.txt"


def save_set(calib: CalibrationSet, folder: str | Path, *, amct: bool = False) -> dict:
    """Save the set, with the Ascend AMCT input in ``folder/amct`` when asked; returns calibration.json's content.

    Here rather than in ``CalibrationSet.save`` so the set depends on no consumer; the AMCT files are
    written into the folder before it is published, so a set and its AMCT input never disagree.
    """
    extras = (lambda tmp: write_amct(calib, tmp / "amct")) if amct else None
    return calib.save(folder, extras=extras)
