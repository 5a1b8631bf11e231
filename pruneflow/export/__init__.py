"""Export targets, one module each; heavy imports happen inside the functions that need them."""

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
