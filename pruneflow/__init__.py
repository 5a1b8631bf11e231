"""pruneflow: turn a trained PyTorch model into smaller, faster, deployable artifacts from one YAML recipe."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pruneflow")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

__all__ = ["__version__", "bench", "optimize", "validate"]


def __getattr__(name: str):
    """``pruneflow.optimize``, ``validate`` and ``bench`` (``pruneflow/api.py``), imported on first use so that
    ``import pruneflow`` stays light."""
    if name in ("optimize", "validate", "bench"):
        import importlib  # a lazy re-export: the package root depends on nothing at import time

        return getattr(importlib.import_module("pruneflow.api"), name)
    raise AttributeError(f"module 'pruneflow' has no attribute {name!r}")
