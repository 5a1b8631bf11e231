"""The user cache (``$XDG_CACHE_HOME/pruneflow``, else ``~/.cache/pruneflow``): generated logs and built kernels,
kept private and checked before anything in it is used (issue 41, item 2).

Every level from ``pruneflow/`` down is this user's own folder, not a link, and closed to others (0700; one an older
pruneflow left 0755 is closed). Something else there (a link, another user's folder) is exit 2, named, with the
fix. A generated folder holds ``cache.json``: its key and the sha256 of every file the generator wrote. It is reused
only when the folder holds exactly those files with those hashes, each a regular file of this user's with one name.
Anything else (a folder planted at the key with its own ``planted.json``, a truncated file, a link, an older layout)
is moved aside and generated again, never read::

    folder = cached_folder("clicklog", {"rows": 1000000, "seed": 0}, lambda tmp: write(tmp, ...))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

from .artifacts import sha256_file
from .errors import InputError

log = logging.getLogger("pruneflow")

#: The record a generated folder carries: its key and each file's sha256.
RECORD = "cache.json"
#: A record larger than this is not one pruneflow wrote (a few lines a file).
MAX_RECORD_BYTES = 1024 * 1024


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/pruneflow``, else ``~/.cache/pruneflow`` (not made or checked: :func:`private_dir` does)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pruneflow"


def private_dir(*parts: str) -> Path:
    """``cache_home()/parts...``, each level made 0700 when missing, and checked: this user's own folder, not a link,
    closed to group and others (an own folder left open by an older pruneflow is closed). The folder above
    ``pruneflow/`` is the user's to choose (``~/.cache`` may be a link they made)."""
    home = cache_home()
    home.parent.mkdir(parents=True, exist_ok=True)
    path = home.parent
    for part in (home.name, *parts):
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        why = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode)
               else f"owned by another user (uid {st.st_uid})" if st.st_uid != os.geteuid() else None)
        if why:
            raise InputError(f"the pruneflow cache folder {path} is {why}: pruneflow keeps generated data and built kernels "
                             "only in a folder of its own user's, so it uses nothing there",
                             hint=f"remove {path} (look at it first: it may have been planted), or set XDG_CACHE_HOME to "
                             "a folder of your own")
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)
    return path


def cached_folder(kind: str, settings: dict[str, Any], make: Callable[[Path], Any]) -> Path:
    """The folder of generated data ``settings`` describe under ``private_dir(kind)``, reused when its record and
    files check out, else made by ``make(folder)`` (into a temporary folder beside it, sealed with its record, then
    renamed into place, so a run killed mid-write or a concurrent one never sees half of it)."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = private_dir(kind)
    folder = root / key
    problem = verify(folder, key)
    if problem is None:
        return folder
    if problem != "missing":
        log.warning("cache %s: %s; generating it again", folder, problem)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        make(tmp)
        _seal(tmp, key)
        _install(tmp, folder, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def verify(folder: Path, key: str) -> str | None:
    """Why ``folder`` may not be used as the generated data of ``key`` ("missing" when there is nothing); None when
    its record names exactly the files it holds, each a regular file of this user's with the recorded sha256."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return "not a folder of this user's"
    found = _files(folder)
    if isinstance(found, str):
        return found
    record = _record(folder / RECORD)
    if record is None or record.get("key") != key or not isinstance(record.get("files"), dict):
        return f"no valid {RECORD} record"
    if set(found) != set(record["files"]) | {RECORD}:
        return f"it holds other files than its record lists ({sorted(set(found) ^ (set(record['files']) | {RECORD}))[:5]})"
    for name, digest in record["files"].items():
        if sha256_file(folder / name) != digest:
            return f"{name} differs from what was generated (sha256)"
    return None


def _files(folder: Path) -> list[str] | str:
    """Every file under ``folder`` (relative, POSIX); or why one of its objects is not a plain file of this user's."""
    found: list[str] = []
    for path in sorted(folder.rglob("*")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # removed meanwhile (a build's lock file)
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            return f"{path.relative_to(folder)} is not a plain file of this user's (a link, another user's, or a hard link)"
        found.append(path.relative_to(folder).as_posix())
    return found


def check_tree(folder: Path, what: str) -> None:
    """Refuse (exit 2) a folder of the cache that holds anything but this user's plain files and folders: a link, a
    FIFO, another user's file or a hard link (``what`` it is for; e.g. built kernels, which are loaded as code)."""
    found = _files(folder) if folder.is_dir() else []
    if isinstance(found, str):
        raise InputError(f"the pruneflow cache folder {folder} ({what}): {found}; pruneflow loads nothing from it",
                         hint=f"remove {folder} (look at it first: it may have been planted); it is built again")


def _record(path: Path) -> dict | None:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
            return None
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _seal(folder: Path, key: str) -> None:
    files = _files(folder)
    if isinstance(files, str):
        raise InputError(f"generating {folder}: {files}", hint="please report this")
    record = {"key": key, "files": {name: sha256_file(folder / name) for name in files if name != RECORD}}
    (folder / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _install(tmp: Path, folder: Path, key: str) -> None:
    """Rename ``tmp`` to ``folder``; what is there and fails :func:`verify` is first moved aside (a reader holding
    its files keeps them) and removed. One a concurrent run installed meanwhile, and that checks out, is kept."""
    for _ in range(3):
        try:
            os.rename(tmp, folder)
            return
        except OSError:
            if verify(folder, key) is None:
                return
        aside = Path(tempfile.mkdtemp(prefix=f".{key}.stale.", dir=folder.parent))
        os.rename(folder, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    raise InputError(f"cannot put the generated data in place at {folder}", hint=f"remove {folder} and run again")
