"""pruneflow: turn a trained PyTorch model into smaller, faster, deployable artifacts from one YAML recipe."""

import os
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pruneflow")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"



def _openvino_telemetry_off() -> None:
    """OpenVINO's converter and NNCF send usage telemetry (google-analytics) from a background thread unless the
    user opted out. pruneflow runs offline and in CI: with no network that thread sits in getaddrinfo holding
    glibc's resolver lock, and a process forked meanwhile (DataLoader workers, pytest's subprocesses) deadlocked
    on it for over an hour. Both fall back to their own no-op stubs when ``openvino_telemetry`` cannot be
    imported, so pruneflow blocks that import (a ``None`` in ``sys.modules``, Python's documented way) before
    either is loaded, and mutes an instance someone created earlier. ``PRUNEFLOW_OPENVINO_TELEMETRY=on`` leaves
    OpenVINO's telemetry as the user configured it."""
    if os.environ.get("PRUNEFLOW_OPENVINO_TELEMETRY", "").lower() == "on":
        return
    loaded = sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
    if loaded is not None:  # imported before pruneflow: mute the singleton, if one was made
        try:
            loaded.Telemetry().consent = False
        except Exception:  # noqa: BLE001 - none made yet (it refuses a first instance without a name), or another API
            pass


_openvino_telemetry_off()


def _source_checkout() -> None:
    """The QAT and calibration plugins and the CLI live beside ``pruneflow/`` in the repository (``qat/``,
    ``calibrate/``, ``cli.py``) and install as ``pruneflow.qat``, ``pruneflow.calibrate`` and ``pruneflow.cli``
    (pyproject's package-dir, setup.py): never as top-level ``qat`` or ``cli``, names anything else may have. Run
    from a checkout (``PYTHONPATH``, an editable install), the same names resolve to those files: the package also
    searches the repository root. An installed wheel holds them in ``pruneflow/`` itself and searches nothing more."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    checkout = os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isfile(os.path.join(root, "cli.py"))
    if checkout and not os.path.exists(os.path.join(here, "cli.py")) and root not in __path__:
        __path__.append(root)


_source_checkout()

#: The API, imported on first use so that ``import pruneflow`` stays light: name -> the module that defines it.
_LAZY = {
    "optimize": "pruneflow.api", "validate": "pruneflow.api", "bench": "pruneflow.api",
    "RunResult": "pruneflow.results", "BenchResult": "pruneflow.benchmark.result",
    "PruneflowError": "pruneflow.errors", "RecipeError": "pruneflow.errors",
    "metric": "pruneflow.tasks.user",  # @pruneflow.metric(higher_is_better=True) on a recipe's own metric
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    """``pruneflow.optimize``, ``validate`` and ``bench`` (``pruneflow/api.py``), the results they return and the
    errors they raise, imported on first use."""
    if name in _LAZY:
        import importlib  # a lazy re-export: the package root depends on nothing at import time

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pruneflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API, lazy names included, so ``dir(pruneflow)`` and a notebook's completion list it; subpackages already
    imported (``pruneflow.runtime``); not the helpers this file imports (os, sys)."""
    here = globals()
    submodules = {n for n, v in here.items() if getattr(v, "__name__", "").startswith(f"{__name__}.") and n != "_LAZY"}
    return sorted({*__all__, *submodules, *(n for n in here if n.startswith("__"))})
