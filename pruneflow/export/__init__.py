"""Export targets, one module each; heavy imports happen inside the functions that need them.

A target reads the model through the run's handle: ``state.handle.float_module()`` for fp32/fp16
artifacts, ``state.handle.int8_module(example)`` for int8 ones (the model kind knows how to strip its
quantization backend), so nothing here imports one.
"""

from __future__ import annotations

import importlib

from ..errors import MissingDependencyError


def require(module: str, install: str, purpose: str):
    """Import ``module`` or raise MissingDependencyError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{purpose} needs the Python package {module!r}, which is not installed ({exc})",
                                     hint=install) from exc

