"""The run folder: made (or refused) before a run, the files each stage wrote and those an earlier run left
(``--resume`` sweeps them), the run's log, and a full disk reported as exit 4 naming the file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

from .artifacts import Manifest, check_run_tree, disk_full_cause, open_run_log, run_subdir
from .errors import InputError, StageError
from .results import StageRecord

log = logging.getLogger("pruneflow")


def prepare_run_dir(out: Path, name: str, resume: bool) -> Path:
    run_dir = Path(out) / name
    if run_dir.exists() and not resume:
        ours = (run_dir / "recipe.resolved.yaml").exists() or (run_dir / Manifest.FILE).exists()
        if ours:
            shutil.rmtree(run_dir)
        elif any(run_dir.iterdir()):
            raise InputError(
                f"{run_dir} exists and is not a pruneflow run directory; refusing to write into it",
                hint="choose another --out, or empty that folder",
            )
    elif run_dir.exists():
        check_run_tree(run_dir)  # --resume reuses what is there: nothing in it may steer a write out of it
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def earlier_run(run_dir: Path) -> str | None:
    """What a run folder holds, said in a few words (``complete, from 2026-12-05T19:34:48+00:00``), for the line that
    says a new run replaces it; None when there is no earlier run there."""
    try:
        manifest = json.loads((run_dir / Manifest.FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    return f"{manifest.get('status', 'unknown status')}, from {manifest.get('created', 'an unknown time')}"


#: Files of the run itself rather than of a stage.
RUN_FILES = frozenset({"recipe.resolved.yaml", Manifest.FILE, "metrics.json", "report.md"})


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under the run folder but its logs -> (inode, mtime, size): a file a stage wrote (atomically:
    a new inode) is one that changed."""
    found = {}
    for path in run_dir.rglob("*"):
        rel = path.relative_to(run_dir).as_posix()
        if path.is_file() and not rel.startswith("logs/"):
            st = path.stat()
            found[rel] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return found


def written_since(run_dir: Path, before: dict[str, tuple[int, int, int]]) -> list[str]:
    """The files (but the run's own and the stage records) that are new or changed since ``before``."""
    return sorted(rel for rel, sig in snapshot(run_dir).items()
                  if before.get(rel) != sig and rel not in RUN_FILES and not rel.endswith("/stage.json"))


def stale_files(run_dir: Path, records: list[StageRecord], failed_files: list[str]) -> list[str]:
    """``--resume``: the files an earlier run left that no stage of this run wrote or reused (exports of a stage
    that ran again with other targets, what a failed stage left, the stages a recipe no longer has)."""
    keep = RUN_FILES | set(failed_files) | {f for r in records for f in r.files}
    keep |= {f"stages/{r.index + 1:02d}-{r.id}/stage.json" for r in records}
    return sorted(rel for rel in snapshot(run_dir) if rel not in keep)


def sweep_stale(run_dir: Path, records: list[StageRecord]) -> list[str]:
    """After a ``--resume`` run that completed: remove ``stale_files`` and the folders they leave empty, so the
    manifest lists exactly the files on disk. (After a failure they are kept and listed instead.)"""
    stale = stale_files(run_dir, records, [])
    remove_files(run_dir, stale)
    if stale:
        log.info("--resume: removed %d files an earlier run left: %s", len(stale), ", ".join(stale[:20]))
    return stale


def remove_files(run_dir: Path, files: list[str]) -> None:
    """Remove ``files`` (relative paths inside ``run_dir``; anything else named is left alone) and empty folders."""
    root = run_dir.resolve()
    for rel in files:
        path = run_dir / rel
        if (path.is_file() or path.is_symlink()) and path.parent.resolve().is_relative_to(root) and rel not in RUN_FILES:
            path.unlink()
    for folder in sorted((p for p in run_dir.rglob("*") if p.is_dir() and not p.is_symlink()),
                         key=lambda p: len(p.parts), reverse=True):
        if folder.name != "logs" and not any(folder.iterdir()):
            folder.rmdir()


@contextlib.contextmanager
def disk_full_as_error() -> Iterator[None]:
    """A full disk (or quota) while the run writes is a StageError naming the file, not an internal error.

    Exit 4, like any stage that could not finish: the atomic writers leave no half-written file, finished
    stages stay recorded and ``--resume`` continues once there is space.
    """
    try:
        yield
    except OSError as exc:
        if disk_full_cause(exc) is None:
            raise
        raise disk_full(exc, exc.filename) from exc


def disk_full(exc: BaseException, path: object, where: Path | None = None) -> StageError:
    """Exit 4 naming the file (or the folder being written) and what is left free on that disk."""
    cause = disk_full_cause(exc) or exc
    path = path or getattr(cause, "filename", None) or where
    why = getattr(cause, "strerror", None) or str(cause).strip().splitlines()[0]
    return StageError(f"disk full at {path or 'the run folder'}: {why}{_free_space(path or where)}; nothing half-written "
                      "was left (files are written under a temporary name and renamed when complete)",
                      hint="free space on that disk (or choose another --out), then run again with --resume: "
                      "finished stages are kept")


def _free_space(path: object) -> str:
    """`` (12.0 MB free)``: what the disk holding ``path`` has left, or nothing when that cannot be told."""
    folder = Path(str(path)) if path else None
    while folder is not None and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f" ({shutil.disk_usage(folder).free / 1e6:,.1f} MB free)" if folder else ""
    except OSError:
        return ""


def forget_earlier(stage_dir: Path, run_dir: Path) -> None:
    """The stage runs again: what an earlier run of it wrote (its stage.json lists the files) is removed with that
    record, so neither is mistaken for this run's."""
    record = stage_dir / "stage.json"
    try:
        files = json.loads(record.read_text()).get("files") if record.is_file() else None
    except (ValueError, OSError, AttributeError):
        files = None
    if isinstance(files, list):
        remove_files(run_dir, [f for f in files if isinstance(f, str) and not f.endswith("stage.json")])
    record.unlink(missing_ok=True)
    run_subdir(run_dir, stage_dir.relative_to(run_dir).as_posix())


class _RunLog(logging.FileHandler):
    """logs/pruneflow.log, opened by ``open_run_log``: appended to, never through a link or into a planted file."""

    def _open(self):  # logging's own hook: the stream is a text file, as its default
        return os.fdopen(open_run_log(Path(self.baseFilename)), "a", encoding=self.encoding)


def attach_log(run_dir: Path) -> logging.Handler:
    handler = _RunLog(run_subdir(run_dir, "logs") / "pruneflow.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pruneflow")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler
