"""Artifacts and the run manifest; atomic file writes.

Every file a run produces is written under a temporary name and renamed when complete, so a crash
or Ctrl-C never leaves a half-written model that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator, Literal

Status = Literal["built", "prepared", "failed"]

TRACKED_PACKAGES = ("pruneflow", "torch", "torch-pruning", "onnx", "onnxruntime", "nncf", "openvino", "datasets", "numpy")


@cache
def tool_versions() -> dict[str, str]:
    out = {}
    for name in TRACKED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it to ``final`` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return obj.as_posix()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


@dataclass
class Artifact:
    """One file a run produced. ``path`` is relative to the run directory."""

    path: str
    kind: str  # "checkpoint" | "onnx" | "openvino" | ...
    producer: str  # the stage id that wrote it
    status: Status = "built"
    target: str | None = None
    precision: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    parent: str | None = None  # path of the artifact (or "source:..." description) it was made from
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tool_versions: dict[str, str] = field(default_factory=tool_versions)

    @classmethod
    def from_file(cls, run_dir: Path, file: Path, **kwargs: Any) -> "Artifact":
        file = Path(file)
        return cls(
            path=file.resolve().relative_to(run_dir.resolve()).as_posix(),
            sha256=sha256_file(file),
            size_bytes=file.stat().st_size,
            **kwargs,
        )

    def verify(self, run_dir: Path) -> bool:
        """True when the file exists and still has the recorded sha256."""
        file = run_dir / self.path
        return file.is_file() and self.sha256 is not None and sha256_file(file) == self.sha256

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Manifest:
    """manifest.json: the lineage of every artifact of a run, rewritten atomically after each stage."""

    FILE = "manifest.json"
    FORMAT = "pruneflow-manifest/1"

    def __init__(self, run_dir: Path, recipe_name: str):
        self.run_dir = run_dir
        self.recipe_name = recipe_name
        self.created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.stages: list[dict[str, Any]] = []
        self.artifacts: list[Artifact] = []
        self.status = "running"

    def add_stage(self, record: dict[str, Any], artifacts: list[Artifact]) -> None:
        self.stages.append(record)
        self.artifacts.extend(artifacts)
        self.write()

    def find(self, path: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.path == path), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.FORMAT,
            "recipe": self.recipe_name,
            "created": self.created,
            "status": self.status,
            "tool_versions": tool_versions(),
            "stages": self.stages,
            "artifacts": [a.as_dict() for a in self.artifacts],
        }

    def write(self) -> None:
        write_json_atomic(self.run_dir / self.FILE, self.as_dict())

    @classmethod
    def read(cls, run_dir: Path) -> dict[str, Any]:
        return json.loads((Path(run_dir) / cls.FILE).read_text())


def known_sha256(path: Path) -> bool:
    """True when ``path`` lies in a run directory whose manifest records its current sha256.

    Used before unpickling (``torch.load(weights_only=False)``): we only unpickle files we wrote.
    """
    path = Path(path).resolve()
    for run_dir in path.parents:
        manifest = run_dir / Manifest.FILE
        if manifest.is_file():
            try:
                data = json.loads(manifest.read_text())
            except (OSError, ValueError):
                return False
            rel = path.relative_to(run_dir).as_posix()
            recorded = {a["path"]: a.get("sha256") for a in data.get("artifacts", [])}
            return rel in recorded and recorded[rel] == sha256_file(path)
    return False
