"""The calibration set on disk: a `datasets` folder plus calibration.json (fingerprint and statistics).

One set feeds every consumer (see ``consumers.py``), so the fingerprint in a run's manifest says
exactly which samples set every quantization range.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from pruneflow.artifacts import publish_dir
from pruneflow.errors import InputError
from pruneflow.inputs import SINGLE_NAME, Inputs, as_mapping, size, take, trim

from .sampling import content_hashes

FORMAT = "pruneflow-calibration/1"
PERCENTILES = (0.1, 1.0, 50.0, 99.0, 99.9)


@dataclass
class CalibrationSet:
    x: Inputs  # one tensor, or every input of a model with several (stored and replayed by name)
    y: torch.Tensor | None = None  # None where the source has no labels
    meta: dict = field(default_factory=dict)  # source, strategy, seed, indices, ...

    def __len__(self) -> int:
        return size(self.x)

    @property
    def fingerprint(self) -> str:
        """sha256 over the selected samples' content, in order: same inputs + seed, same fingerprint."""
        digest = hashlib.sha256()
        for h in content_hashes(self.x):
            digest.update(h.encode())
        if self.y is not None:
            digest.update(np.ascontiguousarray(self.y.numpy()).tobytes())
        return digest.hexdigest()

    def batches(self, batch_size: int = 1) -> Iterator[Inputs]:
        """Batches in order; text cut to each batch's longest row."""
        for start in range(0, len(self), batch_size):
            yield trim(take(self.x, slice(start, start + batch_size)))

    def stats(self) -> dict:
        if isinstance(self.x, dict):
            out: dict = {"count": len(self), "inputs": {k: _tensor_stats(v) for k, v in self.x.items()}}
        else:
            out = {"count": len(self), **_tensor_stats(self.x)}
        if self.y is not None and not self.y.is_floating_point():
            values, counts = np.unique(self.y.numpy(), return_counts=True)
            out["histogram"] = {str(int(v)): int(c) for v, c in zip(values, counts)}
        elif self.y is not None:  # a regression target: its spread, not a histogram of truncated values
            out["targets"] = _tensor_stats(self.y)
        return out

    def save(self, folder: str | Path, extras: Callable[[Path], object] | None = None) -> dict:
        """Write the folder atomically (built beside it, then renamed). Returns calibration.json's content.

        ``extras(tmp)`` writes more files into the folder being built, so they appear together with the
        set or not at all; the set knows no consumer (``consumers.save_set`` passes the AMCT writer).
        """
        import datasets

        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            columns = {name: t.numpy() for name, t in as_mapping(self.x).items()}  # one column an input
            features = {name: _feature(arr) for name, arr in columns.items()}
            if self.y is not None:
                columns["label"] = self.y.numpy()  # class ids int64, regression targets float: stored as they are
                features["label"] = _feature(columns["label"])
            datasets.Dataset.from_dict(columns, features=datasets.Features(features)).save_to_disk(str(tmp / "data"))
            info = {"format": FORMAT, "fingerprint": self.fingerprint, **self.stats(), **self.meta}
            (tmp / "calibration.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
            if extras is not None:
                extras(tmp)
            publish_dir(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return info

    @classmethod
    def load(cls, folder: str | Path) -> "CalibrationSet":
        import datasets

        folder = Path(folder)
        info_file = folder / "calibration.json"
        if not info_file.is_file():
            raise InputError(f"{folder} is not a calibration set (no calibration.json)",
                             hint="build one with `pruneflow calibrate` or a calibrate stage")
        info = json.loads(info_file.read_text())
        ds = datasets.load_from_disk(str(folder / "data")).with_format("numpy")
        names = [c for c in ds.column_names if c != "label"]
        if names == [SINGLE_NAME]:
            x: Inputs = torch.from_numpy(np.asarray(ds[SINGLE_NAME]).astype(info.get("dtype", "float32")))
        else:
            dtypes = {k: v.get("dtype", "float32") for k, v in info.get("inputs", {}).items()}
            x = {k: torch.from_numpy(np.asarray(ds[k]).astype(dtypes.get(k, "float32"))) for k in names}
        y = torch.from_numpy(np.asarray(ds["label"])) if "label" in ds.column_names else None
        meta = {k: v for k, v in info.items() if k in ("source", "strategy", "seed", "size", "by", "features", "indices")}
        calib = cls(x, y, meta)
        if calib.fingerprint != info["fingerprint"]:
            raise InputError(f"{folder}: the samples do not match the fingerprint in calibration.json (changed on disk?)",
                             hint="build it again: `pruneflow calibrate SOURCE --out FOLDER` (or the recipe's calibrate stage)")
        return calib


def _feature(arr: np.ndarray):
    """The `datasets` feature storing ``arr``'s samples column-wise."""
    import datasets

    shape = arr.shape[1:]
    types = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D}
    if len(shape) == 0:
        return datasets.Value(str(arr.dtype))
    if len(shape) == 1:
        return datasets.List(datasets.Value(str(arr.dtype)), length=shape[0])
    return types[len(shape)](shape, str(arr.dtype))


def _tensor_stats(t: torch.Tensor) -> dict:
    """Shape, dtype, value statistics (and per channel for images) of one input."""
    x = t.double()
    flat = x.flatten().numpy()
    out: dict = {
        "shape": list(t.shape[1:]),
        "dtype": str(t.dtype).replace("torch.", ""),
        "input": {"min": float(flat.min()), "max": float(flat.max()), "mean": float(flat.mean()),
                  "std": float(flat.std()),
                  "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, np.percentile(flat, PERCENTILES))}},
    }
    if x.dim() == 4:  # images: per channel as well
        per = x.transpose(0, 1).flatten(1)
        out["per_channel"] = [{"channel": c, "min": float(v.min()), "max": float(v.max()), "mean": float(v.mean()),
                               "std": float(v.std())} for c, v in enumerate(per)]
    return out
