"""Starting recipes for `pruneflow init`: the example recipes shipped in the wheel as ``pruneflow.templates``.

Here rather than in the CLI so the command only parses, calls and renders, and so the listing and the
writing can be tested (or reused by another front end) without Typer::

    written = write_template("quickstart", Path("mine.yaml"))
    written.path, written.notes
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifacts import write_text_atomic
from ..errors import InputError, UnknownNameError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # Python 3.11+; annotations only, so 3.10 imports this module

PACKAGE = "pruneflow.templates"  # recipes/ in the source tree (pyproject's package-dir)


@dataclass(frozen=True)
class WrittenTemplate:
    """Where a template went, and what its user should know before running it."""

    path: Path
    notes: tuple[str, ...] = ()


def templates() -> dict[str, Traversable]:
    """Every shipped template by name (its file name without .yaml), read from the installed package."""
    root = resources.files(PACKAGE)
    return {p.name[: -len(".yaml")]: p for p in root.iterdir() if p.name.endswith(".yaml")}


def template_summaries() -> dict[str, str]:
    """Name → the template's first comment line, sorted by name: what `init --list` shows."""
    return {name: _first_comment(file.read_text()) for name, file in sorted(templates().items())}


def _first_comment(text: str) -> str:
    """A recipe's first `#` line without the mark: each template opens with a one-line summary."""
    return next((ln[1:].strip() for ln in text.splitlines() if ln.startswith("#")), "")


def write_template(name: str, path: Path | None = None, *, force: bool = False) -> WrittenTemplate:
    """Copy template ``name`` to ``path`` (default NAME.yaml), refusing to overwrite a file unless ``force``."""
    known = templates()
    if name not in known:
        raise UnknownNameError(f"unknown template {name!r}; known: {', '.join(sorted(known))}")
    target = path or Path(f"{name}.yaml")
    if target.exists() and not force:
        raise InputError(f"{target} exists", hint="pass --force to overwrite it, or give another PATH")
    text = known[name].read_text()
    write_text_atomic(target, text)
    notes = ["this template refers to files by relative path; edit them to point at your data."] if "../" in text else []
    notes += _write_bases(text, target.parent, known, force)
    return WrittenTemplate(target, tuple(notes))


def _write_bases(text: str, folder: Path, known: dict[str, Traversable], force: bool) -> list[str]:
    """The shipped recipes a template `extends`, written beside it under their own names, so the copy
    validates where it lands (an existing file of that name is kept unless ``force``)."""
    import yaml

    base = (yaml.safe_load(text) or {}).get("extends")
    if not isinstance(base, str) or Path(base).name != base or Path(base).stem not in known:
        return []
    stem, dest = Path(base).stem, folder / base
    if dest.exists() and not force:
        return [f"kept the existing {dest} this recipe extends (pass --force to replace it with the template)"]
    base_text = known[stem].read_text()
    write_text_atomic(dest, base_text)
    return [f"also wrote {dest}, the recipe it extends", *_write_bases(base_text, folder, known, force)]
