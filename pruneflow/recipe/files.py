"""Recipe files: one read with its source positions (under ``safe_yaml``'s bounds), and the `extends`
chain, confined to the folders it may read.

`extends` reads under the recipe's own folder tree, the shipped templates and each ``--allow-path``
(symlinks resolved before the check, so neither ``..`` nor a link escapes). Only the recipe the user
named has what it holds quoted in an error; a file reached through `extends` (it may be a credentials
file a hostile recipe points at) is named by file and line only::

    data, positions, chain = load_with_extends(Path("r.yaml"), (), extends_roots(Path("r.yaml"), []))
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..errors import MISSING, InputError, RecipeError, RecipeIssue, UsageError, key_path
from .safe_yaml import YamlRefused, parse_yaml, read_recipe_text
from .templates import PACKAGE as TEMPLATES

Loc = tuple  # a key path: str keys and int list indices


def _read_yaml(file: Path, echo: bool = True) -> tuple[Any, dict[Loc, tuple[str, int | None]]]:
    """The data and source positions of one recipe file, read with ``safe_yaml``'s bounds.

    ``echo`` False (a file reached through `extends`): errors name the file and line, never what it holds.
    """
    text = _recipe_text(file, echo)
    try:
        node, data = parse_yaml(text)
    except YamlRefused as exc:
        raise _refused(file, exc, echo) from None
    except yaml.YAMLError as exc:
        raise _syntax_error(file, exc, text, echo) from None
    if data is None:
        raise RecipeError(f"{file} is empty", hint="start from `pruneflow init`")
    if not isinstance(data, dict):
        raise RecipeError(
            f"{file} must hold a mapping (key: value lines) at the top, not {_KIND_OF.get(type(data), 'a value')}",
            [RecipeIssue(str(file), 1, "", MISSING, "expected a mapping")],
            hint="a recipe starts with `name:`, `model:`, `data:` and `stages:` lines (`pruneflow init` writes one)",
        )
    assert node is not None  # the document holds a mapping (checked above), so it has a node
    positions: dict[Loc, tuple[str, int | None]] = {}
    _walk_positions(node, (), str(file), positions)
    return data, positions


_KIND_OF = {str: "text", int: "a number", float: "a number", bool: "a boolean", list: "a list"}


def _recipe_text(file: Path, echo: bool) -> str:
    try:
        if not file.exists():
            raise InputError(f"recipe file not found: {file}",
                             hint="check the path; `pruneflow init` writes a starting recipe")
        if not file.is_file():
            raise InputError(f"{file} is {'a folder, not a recipe file' if file.is_dir() else 'not a regular file'}",
                             hint="name the recipe's YAML file")
        return read_recipe_text(file)
    except YamlRefused as exc:
        raise _refused(file, exc, echo) from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the recipe {file}: {getattr(exc, 'strerror', None) or type(exc).__name__}",
                         hint="check the path and its permissions") from None


def _refused(file: Path, exc: YamlRefused, echo: bool) -> RecipeError:
    """A RecipeError for what ``safe_yaml`` refused: file, line and the rule; what was written only if ``echo``."""
    message = f"{exc.message} (here: {exc.detail!r})" if echo and exc.detail is not None else exc.message
    path = _short_path(exc.path) if echo else ""
    return RecipeError(f"{file}: {exc.title}", [RecipeIssue(str(file), exc.line, path, MISSING, message)], hint=exc.hint)


def _short_path(loc: tuple) -> str:
    """A key path for a message: a deep one (a nesting bomb) cut after a few levels."""
    return key_path(loc if len(loc) <= 8 else loc[:8] + ("...",))


def _syntax_error(file: Path, exc: yaml.YAMLError, text: str, echo: bool) -> RecipeError:
    """YAML that does not parse: the line and PyYAML's reason (with the text it quotes only if ``echo``)."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark else None
    problem = "; ".join(filter(None, [getattr(exc, "context", None), getattr(exc, "problem", None)]))
    opened = getattr(exc, "context_mark", None)  # where the unclosed `{`, `[` or quote began: the line to fix
    if opened is not None and line is not None and opened.line + 1 < line:
        problem += f" (opened on line {opened.line + 1}: fix it there; noticed on line {line})"
        line = opened.line + 1
    if isinstance(exc, yaml.reader.ReaderError):
        line = text[: exc.position].count("\n") + 1
        char = exc.character
        problem = f"a control character (#x{char:04x}) that YAML does not allow" if isinstance(char, int) else ""
    problem = problem or "not valid YAML"
    if not echo:
        problem = re.sub(r"(['\"]).*?\1", "'...'", problem)
    return RecipeError(
        f"{file} is not valid YAML",
        [RecipeIssue(str(file), line, "", MISSING, problem)],
        hint="fix the YAML syntax at that line (indentation, a missing colon, an unclosed quote)",
    )


def _walk_positions(node: yaml.Node, loc: Loc, source: str, out: dict) -> None:
    out.setdefault(loc, (source, node.start_mark.line + 1))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            out[loc + (key,)] = (source, key_node.start_mark.line + 1)
            _walk_positions(value_node, loc + (key,), source, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk_positions(item, loc + (i,), source, out)


def load_with_extends(file: Path, seen: tuple[Path, ...], roots: tuple[Path, ...]):
    """Read ``file`` and, depth first, what it extends. Only ``file`` at the top (the recipe named on the
    command line, ``seen`` empty) has its values echoed in errors; an extended one is named by file and line."""
    data, positions = _read_yaml(file, echo=not seen)
    parent = data.pop("extends", None)
    if parent is None:
        return data, positions, [file]
    parent_file = _extended_file(file, parent, positions, seen, roots)
    base, base_positions, base_chain = load_with_extends(parent_file, seen + (file.resolve(),), roots)
    merged = deep_merge(base, data)
    kept = {loc: pos for loc, pos in base_positions.items() if not _replaced_by(loc, data)}
    kept.update(positions)
    return merged, kept, [file] + base_chain


def _extended_file(file: Path, parent: Any, positions: dict, seen: tuple[Path, ...], roots: tuple[Path, ...]) -> Path:
    """The file ``extends: parent`` names (symlinks resolved), checked: a path, inside ``roots``, no
    cycle, a file. Confinement comes before existence, so `extends` cannot probe for files elsewhere."""
    source, line = positions.get(("extends",), (str(file), None))
    shown = parent if not seen else MISSING  # a file reached through `extends` is named, its text never shown

    def named(path: Path) -> str:
        return str(path) if not seen else "the file it names"

    def refuse(what: str, message: str, hint: str) -> RecipeError:
        return RecipeError(f"{source}:{line}: {what}", [RecipeIssue(source, line, "extends", shown, message)], hint=hint)

    if not isinstance(parent, str) or not parent.strip():
        raise refuse("`extends` must be a path", "expected the path of a recipe file",
                     "write `extends: base.yaml`, relative to the recipe that contains it")
    try:
        parent_file = (file.parent / parent).resolve()
    except (OSError, ValueError, RuntimeError):
        raise refuse("`extends` is not a usable path", "the path cannot be resolved (a NUL byte, a symlink loop, "
                     "or too long)", "write the relative path of a recipe file") from None
    if not any(parent_file.is_relative_to(root) for root in roots):
        raise refuse("`extends` names a file outside the recipe's folder",
                     f"{named(parent_file)} is outside the folders `extends` may read: {', '.join(map(str, roots))}",
                     f"`extends` reads recipes under {roots[0]} (the recipe's folder) and the shipped templates; "
                     "move the base recipe there, or pass --allow-path DIR to allow the folder that holds it")
    chain = seen + (file.resolve(),)
    if parent_file in chain:
        cycle = " -> ".join(str(p) for p in chain + (parent_file,))
        raise refuse("`extends` forms a cycle", f"cycle: {cycle}",
                     "remove the `extends` that points back to a recipe already in the chain")
    try:
        exists, is_file = parent_file.exists(), parent_file.is_file()
    except (OSError, ValueError):
        exists = is_file = False
    if not is_file:
        raise refuse("the recipe named by `extends` does not exist",
                     f"{named(parent_file)} is not a file" if exists else f"no such file: {named(parent_file)}",
                     "`extends` is relative to the recipe that contains it")
    return parent_file


def extends_roots(file: Path, allow_paths: Iterable[str | Path]) -> tuple[Path, ...]:
    """Where `extends` may read: the recipe's folder tree, the shipped templates, and each --allow-path."""
    roots = [file.parent.resolve()]
    templates = resources.files(TEMPLATES)
    if isinstance(templates, Path):  # an unpacked install; templates inside a zip are not files to extend
        roots.append(templates.resolve())
    for folder in allow_paths:
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise UsageError(f"--allow-path {str(folder)!r} is not a folder",
                             hint="name an existing folder that holds the recipes `extends` should read")
        roots.append(path.resolve())
    return tuple(roots)


def deep_merge(base: Any, over: Any) -> Any:
    """Mappings merge key by key; anything else (lists included) is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = deep_merge(base[key], value) if key in base else value
        return out
    return over


def _replaced_by(loc: Loc, data: Any) -> bool:
    """True when ``data`` (the child recipe) sets a non-mapping value at ``loc`` or above it."""
    cur = data
    for part in loc:
        if not isinstance(cur, dict) or part not in cur:
            return False
        cur = cur[part]
        if not isinstance(cur, dict):
            return True
    return False
