"""NNCF's torch C++ extension: built once, up front, in a cache that survives clean clones.

On a CPU, NNCF compiles its quantization kernels the first time they run (~130 s on two cores). Its
default load timeout is 60 s: past it NNCF raises ExtensionLoaderTimeoutException and leaves a lock
file that makes every later attempt wait. So: no timeout, a per-torch-version cache directory
outside the checkout (CI's fresh clones reuse it), stale locks removed, and one explicit build.

    python -m qat.nncf_setup      # build now (CI calls this before the tests)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pruneflow.errors import MissingDependencyError

STALE_LOCK_SECONDS = 15 * 60


def extensions_dir() -> Path:
    import torch

    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pruneflow" / "torch_extensions"
    return base / f"torch-{torch.__version__.replace('+', '_')}"


def configure() -> Path:
    """Set the environment NNCF's loader reads; must run before nncf.torch builds anything."""
    folder = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir())))
    os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for lock in folder.rglob("lock"):
        if now - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)  # left by a build that was killed
    return folder


def ensure_built() -> Path:
    """Build (or load from the cache) NNCF's CPU extension. Raises MissingDependencyError if it cannot."""
    folder = configure()
    try:
        import nncf.torch
        import nncf.torch.quantization.extensions  # noqa: F401 - registers the loaders force_build iterates
    except ImportError as exc:
        raise MissingDependencyError("QAT needs NNCF", hint="pip install nncf") from exc
    try:
        nncf.torch.force_build_cpu_extensions()
    except Exception as exc:  # noqa: BLE001 - compiler errors come in many types
        raise MissingDependencyError(
            f"NNCF's C++ extension could not be built in {folder}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            hint="install a C++ compiler and the Python headers (Debian: apt-get install g++ python3-dev), "
            f"or remove {folder} if a previous build was interrupted",
        ) from exc
    return folder


if __name__ == "__main__":
    start = time.perf_counter()
    where = ensure_built()
    print(f"NNCF CPU extension ready in {where} ({time.perf_counter() - start:.0f} s)")
