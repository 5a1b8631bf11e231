"""Optional dependencies: import one where it is needed, or fail with the command that installs it.

Its own module because stages, export targets, the model loader and calibration consumers all need it;
living in ``export/`` it made every one of them depend on the export package::

    ort = require("onnxruntime", "pip install onnxruntime", "ONNX parity checks")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError


def require(module: str, install: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{purpose} needs the Python package {module!r}, which is not installed ({exc})",
                                     hint=install) from exc
