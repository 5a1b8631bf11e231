"""Starting recipes for `pruneflow init`: the example recipes shipped in the wheel as ``pruneflow.templates``.

Here rather than in the CLI so the command only parses, calls and renders, and so the listing and the
writing can be tested (or reused by another front end) without Typer::

    written = write_template("quickstart", Path("mine.yaml"))
    written.path, written.notes
"""

from __future__ import annotations

import difflib
import os
import re
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
    """Name → the template's opening comment, whole, sorted by name: what `init --list` shows."""
    return {name: _first_comment(file.read_text()) for name, file in sorted(templates().items())}


def _first_comment(text: str) -> str:
    """A recipe's opening comment paragraph without the marks (up to an empty `#` line or the first key): each
    template opens with what it does and what it needs, in a sentence or a few."""
    lines: list[str] = []
    for ln in text.splitlines():
        if not ln.startswith("#") or (lines and not ln[1:].strip()) or ln.startswith("#  "):  # an indented command
            break
        lines.append(ln[1:].strip())
    paragraph = " ".join(part for part in lines if part)
    if paragraph.endswith(":") and ". " in paragraph:  # the sentence leading into a command: what it does ends before
        paragraph = paragraph[: paragraph.rfind(". ") + 1]
    if len(paragraph) <= SUMMARY_CHARS:
        return paragraph
    ends, depth = [], 0
    for i, ch in enumerate(paragraph[:SUMMARY_CHARS]):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "." and depth == 0 and paragraph[i + 1: i + 2] in (" ", ""):
            ends.append(i + 1)
    return paragraph[: ends[-1]] if ends else paragraph  # whole sentences, never one cut in the middle


#: `init --list` shows a template's opening sentences up to about this many characters (the recipe file has the rest).
SUMMARY_CHARS = 420


def write_template(name: str, path: str | Path | None = None, *, force: bool = False) -> WrittenTemplate:
    """Copy template ``name`` to ``path`` (default NAME.yaml), refusing to overwrite a file unless ``force``.

    A relative path in the template (``../../shared/data/adult/train.csv``) is rewritten to reach the same file
    from where the copy lands; a path that reaches no file from the template's own folder (an installed wheel has
    no data beside it) is kept, and the note names its key so the user knows what to edit."""
    known = templates()
    if name not in known:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        raise UnknownNameError(f"unknown template {name!r}{f'; did you mean {close[0]!r}?' if close else ''}; known: "
                               f"{', '.join(sorted(known))}", hint="`pruneflow init --list` says what each one builds")
    target = Path(path) if path is not None else Path(f"{name}.yaml")
    if path is not None and (target.is_dir() or str(path).endswith(("/", os.sep))):  # a folder: NAME.yaml inside it
        target = target / f"{name}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not force:
        raise InputError(f"{target} exists", hint="pass --force to overwrite it, or give another PATH")
    text, notes = relocate_paths(known[name].read_text(), _folder_of(known[name]), target.parent)
    write_text_atomic(target, text)
    notes += _write_bases(text, target.parent, known, force)
    return WrittenTemplate(target, tuple(notes))


def _folder_of(file: Traversable) -> Path | None:
    """The template's folder on disk (recipes/ in a checkout, site-packages/pruneflow/templates in a wheel), or None
    when the package is not on a file system (a zip)."""
    return Path(str(file)).parent if isinstance(file, Path) else None


#: A relative path as a recipe writes it: a YAML value that starts with ./ or ../ (comments are not values).
_RELATIVE = re.compile(r"(?<![\w./-])(\.\.?/[\w./-]+)")


def relocate_paths(text: str, source: Path | None, dest: Path) -> tuple[str, list[str]]:
    """``text`` with every relative path value that reaches a file from ``source`` rewritten to reach it from
    ``dest``; and notes: what was rewritten, and the keys whose files do not exist here (to edit)."""
    import yaml

    values = _relative_values(yaml.safe_load(text) or {})
    moved, missing = {}, []
    for key, value in values:
        # absolute, with `..` folded but links kept: data reached through a link (../shared -> /work/shared) stays
        # reached through it, as the template wrote it
        found = Path(os.path.normpath(os.path.abspath(source / value))) if source is not None else None
        if found is not None and found.exists():
            moved[value] = _relative(found, Path(os.path.abspath(dest)))
        else:
            missing.append(f"{key} ({value})")
    lines = [_RELATIVE.sub(lambda m: moved.get(m.group(1), m.group(1)), ln) if not ln.lstrip().startswith("#") else ln
             for ln in text.splitlines(keepends=True)]
    notes = [f"rewrote {len(moved)} relative path(s) to reach the same files from {dest.resolve()}"] if moved and any(
        old != new for old, new in moved.items()) else []
    if missing:
        notes.append("edit these keys to point at your files (they do not exist from here): " + ", ".join(dict.fromkeys(missing)))
    return "".join(lines), notes


def _relative(found: Path, folder: Path) -> str:
    """``found`` as a path relative to ``folder``, as the loader reads it (against the recipe's own folder): a copy that
    can be committed and used from another checkout laid out alike. Absolute only where no relative path exists (two
    Windows drives)."""
    try:
        return os.path.relpath(found, folder)
    except ValueError:
        return str(found)


def _relative_values(node: object, key: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every string in a recipe tree that is a relative path."""
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _relative_values(v, f"{key}.{k}" if key else str(k))]
    if isinstance(node, list):
        return [kv for i, v in enumerate(node) for kv in _relative_values(v, f"{key}.{i}")]
    if isinstance(node, str) and (node.startswith("./") or node.startswith("../")):
        return [(key, node.split(".py:")[0] + ".py" if ".py:" in node else node)]  # a factory file: its path
    return []


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
    base_text, notes = relocate_paths(known[stem].read_text(), _folder_of(known[stem]), folder)
    write_text_atomic(dest, base_text)
    return [f"also wrote {dest}, the recipe it extends", *notes, *_write_bases(base_text, folder, known, force)]
