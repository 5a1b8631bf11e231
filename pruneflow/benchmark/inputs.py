"""What the artifacts are timed on: fresh batches of the run's eval split when its recipe names a
dataset, otherwise random values of the artifact's input shape, and the output says which."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import PruneflowError
from ..inputs import as_numpy
from .variants import Variant


@dataclass
class Source:
    """Samples (no batch dimension yet) or, when ``samples`` is None, random values; ``what`` says which."""

    what: str
    samples: "np.ndarray | dict[str, np.ndarray] | None" = None


class Feeds:
    """One input batch per variant and batch size, made before any timing starts."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._eval: dict[Path, Source | None] = {}

    def source(self, variant: Variant) -> Source:
        """The eval split of the variant's run when its samples fit the artifact's input, else random."""
        run = self._run_samples(variant.run_dir) if variant.run_dir is not None else None
        spec = variant.input
        if run is not None and isinstance(run.samples, dict):
            return run  # several named inputs: the executors feed each by name
        if run is not None and isinstance(run.samples, np.ndarray):
            expected = tuple(spec.shape[1:]) if spec is not None else ()
            sample = run.samples.shape[1:]
            if spec is None or all(e in (None, s) for e, s in zip(expected, sample)) and len(expected) == len(sample):
                return run
        shape = "?" if spec is None else "[B," + ",".join("?" if d is None else str(d) for d in spec.shape[1:]) + "]"
        dtype = spec.dtype if spec is not None else "float32"
        if run is None:
            why = "no dataset: a bare artifact, or a run without recipe.resolved.yaml"
        elif not isinstance(run.samples, np.ndarray):
            why = run.what
        else:
            why = f"samples of shape {list(run.samples.shape[1:])} from {run.what} do not fit the input"
        return Source(f"random values, shape {shape} {dtype} ({why})")

    def batch(self, variant: Variant, batch: int) -> "np.ndarray | dict[str, np.ndarray]":
        """A new contiguous batch for ``variant``: eval samples chosen at random (repeated when the split is
        smaller than the batch) or random normal values; cast to the artifact's input type."""
        rng = np.random.default_rng([self.seed, batch])
        source = self.source(variant)
        spec = variant.input
        dtype = np.dtype(spec.dtype if spec is not None else "float32")
        if isinstance(source.samples, dict):
            rows = len(next(iter(source.samples.values())))
            index = rng.choice(rows, size=batch, replace=batch > rows)
            return _trimmed({k: np.ascontiguousarray(v[index]) for k, v in source.samples.items()})
        if source.samples is not None:
            index = rng.choice(len(source.samples), size=batch, replace=batch > len(source.samples))
            return np.ascontiguousarray(source.samples[index]).astype(dtype, copy=False)
        if spec is None or any(d is None for d in spec.shape[1:]):
            raise PruneflowError(f"{variant.name}: the input shape is not fixed beyond the batch dimension, "
                                 "and random input needs one", hint="bench the run folder, whose data gives real input")
        shape = (batch, *(int(d) for d in spec.shape[1:] if d is not None))
        if dtype.kind in "iub":
            return rng.integers(0, 2, size=shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)

    def sample_bytes(self, variant: Variant) -> int | None:
        """Bytes of one sample of ``variant``'s input, as ``batch`` would make it (None: not known before)."""
        source, spec = self.source(variant), variant.input
        if isinstance(source.samples, dict):
            return sum(int(v[0].nbytes) for v in source.samples.values() if len(v))
        dtype = np.dtype(spec.dtype if spec is not None else "float32")
        if source.samples is not None and len(source.samples):
            return int(np.prod(source.samples.shape[1:], dtype=np.int64)) * dtype.itemsize
        if spec is None or any(d is None for d in spec.shape[1:]):
            return None
        return int(np.prod([int(d) for d in spec.shape[1:] if d is not None], dtype=np.int64)) * dtype.itemsize

    def _run_samples(self, run_dir: Path) -> Source | None:
        if run_dir not in self._eval:
            self._eval[run_dir] = _eval_split(run_dir)
        return self._eval[run_dir]


def _trimmed(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Token arrays cut to the batch's longest row (as the data's batches are: ``inputs.trim``)."""
    from ..inputs import trim

    import torch

    return as_numpy(trim({k: torch.from_numpy(v) for k, v in feed.items()}))  # type: ignore[return-value]


def _eval_split(run_dir: Path) -> Source | None:
    """The eval split named by the run's recipe.resolved.yaml, preprocessed as the run saw it."""
    import yaml

    from ..data import load_data
    from ..recipe.models import DataSpec
    from ..tasks import make_task

    recipe_file = run_dir / "recipe.resolved.yaml"
    if not recipe_file.is_file():
        return None
    try:
        recipe = yaml.safe_load(recipe_file.read_text()) or {}
        spec = DataSpec.model_validate(recipe["data"])
        bundle = load_data(spec, seed=int(recipe.get("seed", 0)), with_train=False, task=make_task(recipe.get("task")))
    except (PruneflowError, KeyError, ValueError, OSError) as exc:
        return Source(f"its recipe's data could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0]})")
    samples = as_numpy(bundle.eval.x)
    return Source(f"eval split of {bundle.description} ({len(bundle.eval)} samples)", samples)
