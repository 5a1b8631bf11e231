"""NNCF's torch C++ extension: built once, up front, in a cache that survives clean clones.

On a CPU, NNCF compiles its quantization kernels the first time they run (~130 s on two cores). Its
default load timeout is 60 s: past it NNCF raises ExtensionLoaderTimeoutException. So: no timeout, a
per-torch-version cache directory outside the checkout (CI's fresh clones reuse it), and one explicit build.

torch.utils.cpp_extension guards every build *and every load* with a ``lock`` file in the build folder
(``FileBaton``: created with O_EXCL, kept open by the building process, removed when it finishes); others
wait while it exists, silently and without end. A run killed mid-build leaves it behind, and every later
run then hangs. So the lock's owner is found as the process holding the file open (``/proc/*/fd``); a lock
no process holds is stale and removed, with a message, and while a live owner builds, what is awaited is
said every 30 s. Where ``/proc`` cannot tell (not Linux), a lock older than ``STALE_LOCK_SECONDS`` is stale.

    python -m pruneflow.qat.nncf_setup      # build now (CI calls this before the tests)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from pruneflow.errors import MissingDependencyError

#: Age past which a lock whose owner cannot be looked up (no /proc) counts as stale; a build takes ~130 s.
STALE_LOCK_SECONDS = 10 * 60
#: How often a wait for another process's build is reported.
REPORT_EVERY_SECONDS = 30.0

log = logging.getLogger("pruneflow.nncf")
Notify = Callable[[str], None]


def _notify(message: str) -> None:
    """Say it on stderr (a wait must never be silent, and restoring a checkpoint has no reporter) and in the log."""
    log.info(message)
    print(f"pruneflow: {message}", file=sys.stderr, flush=True)


def extensions_dir() -> Path:
    """One build folder per torch version *and environment*: the build commands name the environment's torch
    headers, so two environments sharing a folder (two checkouts, a fresh clone beside the old one) each took
    the other's build as stale and rebuilt it, minutes every switch (issue 26)."""
    import hashlib

    import torch

    from pruneflow.cache import cache_home

    base = cache_home() / "torch_extensions"
    environment = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:10]
    return base / f"torch-{torch.__version__.replace('+', '_')}-{environment}"


def lock_holders(lock: Path) -> list[int] | None:
    """Pids of the processes that hold ``lock`` open (its owner, for torch's FileBaton); None where /proc
    cannot tell (no /proc, or not even this process's descriptors readable)."""
    proc = Path("/proc")
    try:
        next((proc / "self" / "fd").iterdir())
    except (OSError, StopIteration):
        return None
    target = os.path.realpath(lock)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                holders.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's process
            continue
    return holders


def clear_stale_locks(folder: Path, notify: Notify = _notify, waiting: dict[Path, float] | None = None) -> list[Path]:
    """Remove every build lock under ``folder`` whose owner is gone (returned); report the live ones
    (``waiting`` remembers when each was last reported, so a caller polling says it every 30 s)."""
    removed = []
    now = time.time()
    for lock in folder.rglob("lock"):
        holders = lock_holders(lock)
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # released meanwhile
        stale = (holders is not None and not holders) or (holders is None and age > STALE_LOCK_SECONDS)
        if stale and holders is not None:
            # FileBaton.release closes its descriptor, then removes the file: look again after that moment.
            time.sleep(0.2)
            stale = lock.exists() and lock_holders(lock) == []
        if stale:
            lock.unlink(missing_ok=True)
            removed.append(lock)
            why = "no process holds it" if holders is not None else f"it is {age / 60:.0f} min old"
            notify(f"removed a stale lock of NNCF's C++ extension build, {lock} ({why}: a build was killed)")
        elif waiting is not None and os.getpid() not in (holders or []) and now - waiting.get(lock, 0.0) >= REPORT_EVERY_SECONDS:
            waiting[lock] = now
            owner = f"pid {', '.join(map(str, holders))}" if holders else "an unknown process"
            notify(f"waiting for NNCF's C++ extension build by {owner} (lock {lock}, {age:.0f} s old); "
                   f"if that process is stuck, stop it or remove the lock")
    return removed


@contextlib.contextmanager
def watching_locks(folder: Path, notify: Notify = _notify, every: float = 1.0) -> Iterator[None]:
    """While the block runs (torch may wait on a lock inside it), clear stale locks and report waits."""
    stop = threading.Event()
    waiting: dict[Path, float] = {}

    def watch() -> None:
        while not stop.wait(every):
            try:
                clear_stale_locks(folder, notify, waiting)
            except OSError as exc:  # a watcher problem must not break the build
                log.debug("lock watcher: %s", exc)

    thread = threading.Thread(target=watch, name="nncf-lock-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def pin_ninja() -> None:
    """Put this interpreter's own ``bin`` first on PATH when it holds a ``ninja`` (pip's, in the environment).

    torch runs the first ``ninja`` on PATH. With the environment activated that is pip's 1.13, without it (what
    ``.venv/bin/pruneflow`` and ``make demo`` do) the system's 1.11; the two hash the build commands differently
    in ``.ninja_log``, so each one took the other's build as stale and rebuilt the extension (1.5-3 minutes, six
    times in 26 minutes, issue 26). One ninja per environment, whatever the shell, builds it once."""
    here = Path(sys.executable).parent  # not resolved: a virtual environment's bin, not the base interpreter's
    if not (here / "ninja").exists():
        return
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not path or Path(path[0]) != here:
        os.environ["PATH"] = os.pathsep.join([str(here), *(p for p in path if Path(p) != here)])


def extension_state(folder: Path | None = None) -> tuple[bool, Path]:
    """(built, where): whether NNCF's CPU extension is already compiled in the cache this environment uses."""
    import torch

    folder = folder or Path(os.environ.get("TORCH_EXTENSIONS_DIR", str(extensions_dir())))
    found = list((folder / "nncf" / "quantized_functions_cpu").glob(f"{torch.__version__}/quantized_functions_cpu*.so"))
    return bool(found), folder


def configure(notify: Notify = _notify) -> Path:
    """Set the environment NNCF's loader reads and clear stale locks; must run before nncf.torch builds anything."""
    from pruneflow.cache import check_tree, private_dir

    pin_ninja()
    default = extensions_dir()
    folder = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default)))
    os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")
    if folder == default:  # ours: private (0700), no link on the way, nothing planted in it (a .so there is loaded as code)
        private_dir("torch_extensions", default.name)
        check_tree(folder, "NNCF's compiled kernels")
    folder.mkdir(parents=True, exist_ok=True)
    clear_stale_locks(folder, notify)
    return folder


#: What NNCF's C++ extension build needs, and how to get it (README "Quick start", docs/recipes.md).
BUILD_TOOLS_HINT = ("install a C++ compiler and Python's headers (Debian/Ubuntu: apt-get install g++ python3-dev; "
                    "Fedora/RHEL: dnf install gcc-c++ python3-devel; macOS: xcode-select --install), then build the "
                    "extension: python -m pruneflow.qat.nncf_setup")
#: What NNCF does without the extension.
FALLBACK = "NNCF will fall back to slower torch ops (QAT and PTQ still work, QAT's training steps more slowly)"


def missing_build_tools() -> list[str]:
    """What NNCF's C++ extension build needs and this machine lacks: a C++ compiler (``$CXX``, else ``c++``, as torch's
    builder runs), Python's headers (``Python.h``) and ``ninja``; [] when all are there."""
    import shutil
    import sysconfig

    pin_ninja()
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler (`{compiler}` is not on PATH)")
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").is_file():
        missing.append(f"Python's headers ({Path(include) / 'Python.h'} is absent)")
    if shutil.which("ninja") is None:
        missing.append("ninja (pip install ninja)")
    return missing


def ensure_built(notify: Notify = _notify, strict: bool = False) -> Path:
    """Build (or load from the cache) NNCF's CPU extension; returns its folder.

    Where it cannot be built (the build tools are missing, or the build failed) NNCF falls back to slower torch ops:
    a run says so and goes on; ``strict`` (``python -m pruneflow.qat.nncf_setup``) raises MissingDependencyError
    instead, naming what is missing and the fix (before this, setup printed 60 lines of compiler errors, then "ready",
    exit 0)."""
    folder = configure(notify)
    try:
        import nncf.torch
        import nncf.torch.quantization.extensions  # noqa: F401 - registers the loaders force_build iterates
    except ImportError as exc:
        raise MissingDependencyError("QAT needs NNCF", hint="pip install nncf") from exc
    if not extension_state(folder)[0]:
        missing = missing_build_tools()
        if missing:  # the build cannot work: say so in one line instead of the compiler's errors
            return _not_built(f"NNCF's C++ extension cannot be built here: {'; '.join(missing)}", folder, notify, strict)
        notify(f"building NNCF's C++ quantization kernels, once for this environment (QAT and PTQ need them); later "
               f"runs, from any shell, reuse {folder}")
    try:
        with watching_locks(folder, notify):
            nncf.torch.force_build_cpu_extensions()
    except Exception as exc:  # noqa: BLE001 - compiler errors come in many types
        raise MissingDependencyError(
            f"NNCF's C++ extension could not be built in {folder}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            hint=f"{BUILD_TOOLS_HINT}; or remove {folder} if a previous build was interrupted",
        ) from exc
    if not extension_state(folder)[0]:  # NNCF logs the compiler's errors as a warning and falls back
        return _not_built(f"NNCF's C++ extension failed to build in {folder} (the compiler's errors are above)", folder,
                          notify, strict)
    return folder


#: Folders whose failed build this process already reported (a run asks for the extension at every NNCF step).
_REPORTED: set[Path] = set()


def _not_built(why: str, folder: Path, notify: Notify, strict: bool) -> Path:
    if strict:
        raise MissingDependencyError(f"{why}: {FALLBACK}", hint=BUILD_TOOLS_HINT)
    if folder not in _REPORTED:
        _REPORTED.add(folder)
        notify(f"{why}: {FALLBACK}. Fix: {BUILD_TOOLS_HINT}")
    _fall_back_now()
    return folder


def _fall_back_now() -> None:
    """Hand NNCF the torch-op fallback it would end with. Left alone, its first quantizer call tries the build again
    (torch's "Your compiler is not compatible" banner, the compiler's errors, then its own warning), after the one
    line above has said what is missing. NNCF 3.4 loads its CPU kernels lazily through ``ExtensionNamespace``; where
    that attribute is not there (another NNCF), NNCF's own attempt runs as before."""
    try:
        from nncf.torch.quantization.extensions import QuantizedFunctionsCPU
        from nncf.torch.quantization.reference import ReferenceQuantizedFunctions
    except ImportError:
        return
    if getattr(QuantizedFunctionsCPU, "_loaded_namespace", ...) is None:
        QuantizedFunctionsCPU._loaded_namespace = ReferenceQuantizedFunctions


def main() -> int:
    """``python -m pruneflow.qat.nncf_setup``: build the extension now; exit 3 when it cannot be built."""
    start = time.perf_counter()
    try:
        where = ensure_built(strict=True)
    except MissingDependencyError as exc:
        print(f"pruneflow: {exc.message}\nFix: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    print(f"NNCF CPU extension ready in {where} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
