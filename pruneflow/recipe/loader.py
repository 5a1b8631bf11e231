"""Load a recipe: YAML with source positions → `extends` → `--set` overrides → validation.

Every validation error is mapped back to the file and line that set the value::

    recipe.yaml:14  stages.0.epochs  'three'  Input should be a valid integer

Reading a file (bounded, safe YAML: ``safe_yaml.py``) and following `extends` (confined to the recipe's
folder, the shipped templates and ``--allow-path``: ``files.py``) come first; a value set in a file
reached through `extends` is never quoted in an error, only its file and line.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml
from pydantic import BaseModel, Tag, ValidationError
from pydantic_core import ErrorDetails

from ..errors import MISSING, ConfigError, InputError, RecipeError, RecipeIssue, UsageError, key_path
from .code import CodeTrust
from .files import Loc, deep_merge, extends_roots, load_with_extends
from .models import ModelSpec, RecipeBase, recipe_model
from .rules import recipe_problems
from .safe_yaml import MAX_DEPTH, YamlRefused, dump_yaml, parse_yaml

__all__ = ["LoadedRecipe", "apply_overrides", "deep_merge", "dump_recipe", "load_recipe", "locate", "validate"]
SET_SOURCE = "--set"


@dataclass
class LoadedRecipe:
    recipe: RecipeBase
    file: Path
    #: key path → (source file or "--set ...", line) for every value and key that was written somewhere.
    positions: dict[Loc, tuple[str, int | None]] = field(default_factory=dict)
    #: The files read, the recipe itself first, then what it extends.
    chain: list[Path] = field(default_factory=list)
    #: What code the recipe may run (``code.py``): its folder tree, its ``trust.code`` and ``--trust-code``.
    trust: CodeTrust | None = None
    #: The code the recipe runs beyond the zoo: (key path, reference, why it may run), in recipe order.
    code: list[tuple[Loc, str, str]] = field(default_factory=list)

    def locate(self, loc: Loc) -> tuple[str, int | None]:
        """FILE and LINE that set the value at ``loc`` (a default: its nearest written parent)."""
        return locate(loc, self.positions, str(self.file))

    def error(self, problems: Iterable[ConfigError]) -> RecipeError:
        """One RecipeError listing every problem at its FILE:LINE, like a validation error.

        The same form whether a rule found the problems at load time or a stage at run time, so the
        CLI prints (and ``--json`` carries) both alike.
        """
        issues = _sorted([RecipeIssue(*self.locate(p.loc), key_path(p.loc), p.value, p.detail, p.hint) for p in problems],
                         str(self.file))
        return RecipeError(_problem_count(str(self.file), issues), issues, hint=_hints(issues))

    @contextlib.contextmanager
    def locating(self) -> Iterator[None]:
        """Turn a ConfigError escaping the block (a rule that needs the model or data) into a located RecipeError."""
        try:
            yield
        except ConfigError as exc:
            raise self.error([exc]) from exc


def _hints(issues: list[RecipeIssue]) -> str | None:
    """The fix of each issue that has one; with several, each on its own line after the key it fixes."""
    hinted = [i for i in issues if i.hint]
    if len({i.hint for i in hinted}) == 1:
        return hinted[0].hint
    return "\n     ".join(f"{i.path}: {i.hint}" for i in hinted) or None


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                allow_paths: Iterable[str | Path] = (), trust_code: Iterable[str] = (), *,
                check_code: bool = True) -> LoadedRecipe:
    """Load, merge, override, validate, resolve paths, then run the rules that need only the recipe
    (``rules.py``). Raises RecipeError (exit 2), with FILE:LINE for each problem, on any problem.

    `extends` reads only under the recipe's folder, the shipped templates and ``allow_paths``; values
    from the files it reads are never echoed in an error (a file named there may hold secrets). Each code
    reference must be the zoo's, the recipe's own file, or listed in its ``trust.code`` or ``trust_code``
    (``--trust-code``; ``code.py``); ``check_code`` False (a run folder's own recipe, which may then name only
    zoo models) leaves that to the caller.
    """
    file = Path(path)
    data, positions, chain = load_with_extends(file, (), extends_roots(file, allow_paths))
    apply_overrides(data, positions, overrides)
    recipe = validate(data, positions, str(file))
    _resolve_paths(recipe, positions, file)
    trust = CodeTrust(file.resolve().parent, tuple(recipe.trust.code), tuple(_code_reference(r, Path.cwd()) for r in trust_code))
    loaded = LoadedRecipe(recipe=recipe, file=file, positions=positions, chain=chain, trust=trust)
    problems = _code_problems(loaded) if check_code else []
    problems += recipe_problems(recipe)
    if problems:
        raise _hide_foreign(loaded.error(problems), str(file))
    return loaded


def _code_problems(loaded: LoadedRecipe) -> list[ConfigError]:
    """Give every ``ModelSpec`` of the recipe its trust, and check each code reference against it before anything is
    imported: ``loaded.code`` lists what may run and why, the problems what may not."""
    problems: list[ConfigError] = []
    for loc, spec in _model_specs(loaded.recipe, ()):
        spec.trusting(loaded.trust)
        if ":" not in spec.factory or loaded.trust is None:
            continue  # a zoo name (an unknown one is refused where the zoo is known: models.py)
        where = key_path((*loc, "factory"))
        try:
            loaded.code.append(((*loc, "factory"), spec.factory, loaded.trust.check(spec.factory, where)))
        except InputError as exc:
            problems.append(ConfigError((*loc, "factory"), exc.message.removeprefix(f"{where} {spec.factory!r}").lstrip(": "),
                                        value=spec.factory, hint=exc.hint))
    for index, metric in enumerate(getattr(loaded.recipe, "metrics", [])):  # a metric of your own is code too
        loc, ref = ("metrics", index, "fn"), metric.fn
        if ":" not in ref or loaded.trust is None:
            continue
        where = key_path(loc)
        try:
            loaded.code.append((loc, ref, loaded.trust.check(ref, where)))
        except InputError as exc:
            problems.append(ConfigError(loc, exc.message.removeprefix(f"{where} {ref!r}").lstrip(": "), value=ref, hint=exc.hint))
    return problems


def _model_specs(obj: Any, loc: Loc) -> Iterator[tuple[Loc, ModelSpec]]:
    """Every ``ModelSpec`` in a validated recipe (``model``, a stage's ``teacher``), with its key path."""
    if isinstance(obj, ModelSpec):
        yield loc, obj
    elif isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            yield from _model_specs(getattr(obj, name), (*loc, name))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from _model_specs(item, (*loc, i))


def _code_reference(ref: str, base: Path) -> str:
    """A code reference as the recipe holds it: ``file.py:fn`` with the file absolute (relative to ``base``)."""
    if ".py:" not in ref:
        return ref
    file_part, fn = ref.rsplit(":", 1)
    return f"{_absolute(file_part, base)}:{fn}"


def dump_recipe(recipe: RecipeBase) -> str:
    """YAML of a validated recipe with every default spelled out (what `recipe.resolved.yaml` holds)."""
    data = recipe.model_dump(mode="json", exclude={"extends"})
    return dump_yaml(data)


# --------------------------------------------------------------------------- --set overrides


def apply_overrides(data: dict, positions: dict, overrides: list[str] | tuple[str, ...]) -> None:
    """Apply ``KEY.PATH=VALUE`` items in place; VALUE is parsed as a YAML scalar (3, 0.1, true, [1, 2]),
    under the same bounds as a recipe file; text that is not YAML (``[1``) is kept as the text it is.

    A part of the path indexes a list when it is ASCII digits and the value there is a list; otherwise
    it is a mapping key, as written (``model.kwargs.007`` sets the key ``'007'``)."""
    for item in overrides:
        parts, value = _parse_override(item)
        cur: Any = data
        loc: list[str | int] = []
        for part in parts[:-1]:
            key = _key_in(cur, part, parts[: len(loc) + 1], item)
            if isinstance(cur, dict) and cur.get(key) is None:
                cur[key] = {}
            cur = cur[key]
            loc.append(key)
        key = _key_in(cur, parts[-1], parts, item)
        cur[key] = value
        _record_override(positions, (*loc, key), item)


def _key_in(cur: Any, part: str, so_far: list[str], item: str) -> str | int:
    """The list index or mapping key ``part`` names in ``cur``; RecipeError when there is none."""
    if isinstance(cur, list):
        if not (part.isascii() and part.isdigit()) or int(part) >= len(cur):
            raise _bad_set(item, so_far, cur)
        return int(part)
    if isinstance(cur, dict):
        return part
    raise _bad_set(item, so_far[:-1], cur)


def _parse_override(item: str) -> tuple[list[str], Any]:
    """The key path and the value of one ``--set KEY.PATH=VALUE``; UsageError when it cannot be one."""
    if "=" not in item:
        raise UsageError(f"--set {item!r} has no '='", hint="write --set KEY.PATH=VALUE, e.g. --set stages.0.epochs=3")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(p == "" for p in parts):
        raise UsageError(f"--set {item!r}: empty key path", hint="e.g. --set stages.0.epochs=3")
    if len(parts) > MAX_DEPTH:
        raise UsageError(f"--set {item[:80]!r}...: a key path of {len(parts)} parts", hint="a recipe key path has a few parts")
    if parts[0] == "extends":
        raise UsageError(f"--set {item!r}: `extends` is read before --set applies",
                         hint="edit the recipe's `extends:` line, or --set the values themselves")
    try:
        # empty (or YAML's own white space alone) is null; str.strip would also take U+00A0 and kin, which YAML
        # reads as text (`--set description=<NBSP>` is that string)
        _, value = parse_yaml(raw) if raw.strip(" \t\r\n") else (None, None)
    except YamlRefused as exc:
        raise UsageError(f"--set {item!r}: the value has {exc.title} ({exc.message})", hint=exc.hint) from None
    except yaml.YAMLError:
        value = raw
    return parts, value


def _record_override(positions: dict, loc: Loc, item: str) -> None:
    """Point the overridden value, and what it replaced or created, at the --set that wrote it."""
    source = f"{SET_SOURCE} {item}"
    for old in [old for old in positions if old[: len(loc)] == loc]:
        del positions[old]
    positions[loc] = (source, None)
    for cut in range(1, len(loc)):  # mappings this --set created: errors there point at it, not the file
        positions.setdefault(loc[:cut], (source, None))


def _bad_set(item: str, parts: list, cur: Any) -> RecipeError:
    where = key_path(parts)
    if isinstance(cur, list):  # ``parts`` ends with the index that is not there; the list is the path before it
        listed = key_path(parts[:-1])
        n = len(cur)
        message = f"{listed!r} is a list of {n} entr{'y' if n == 1 else 'ies'}: use an index 0..{n - 1}" if cur else f"{listed!r} is an empty list"
    else:
        message = f"{where!r} holds a value, not a mapping"
    return RecipeError(
        f"--set {item!r} names a path that does not exist",
        [RecipeIssue(SET_SOURCE, None, where, MISSING, message)],
        hint="`pruneflow validate RECIPE` shows the resolved recipe and its paths",
    )


# --------------------------------------------------------------------------- validation


def validate(data: dict, positions: dict, main_source: str) -> RecipeBase:
    model = recipe_model()
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        issues = _issues(exc, data, positions, main_source, model)
        raise RecipeError(
            _problem_count(main_source, issues),
            issues,
            hint="`pruneflow schema` prints every field with its description",
        ) from None


def _issues(exc: ValidationError, data: dict, positions: dict, main_source: str, model: type) -> list[RecipeIssue]:
    merged: dict[tuple, RecipeIssue] = {}
    for err in exc.errors(include_url=False):
        raw_loc = tuple(err["loc"])
        clean, value = _clean_loc(raw_loc, data, model)
        message = _message(err, raw_loc, model)
        if err["type"] == "missing":
            value = MISSING
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            if isinstance(value, dict):
                key = _discriminator_key(err)
                clean, value = clean + (key,), value.get(key, MISSING)
            elif not isinstance(value, str):  # a bare name (`targets: [onx]`) stays as written
                value = MISSING
        source, line = locate(clean, positions, main_source)
        unknown_key = err["type"] == "extra_forbidden"
        foreign = not _echoes(source, main_source)
        path = key_path(clean[:-1] + ("<key>",) if foreign and unknown_key else clean)
        merge_key = (key_path(clean), unknown_key)
        if merge_key in merged and merged[merge_key].message != message:
            merged[merge_key].message += f"; or {message[:1].lower()}{message[1:]}"
        else:
            merged[merge_key] = RecipeIssue(source, line, path, value, message)
    return _sorted([_hide_value(i) if not _echoes(i.source, main_source) else i for i in merged.values()], main_source)


# --------------------------------------------------------------------------- what an error may show

_NOT_SHOWN = "not shown: it was read through `extends`"


def _echoes(source: str, main_source: str) -> bool:
    """Whether an error may quote what ``source`` holds: the recipe the user named and their --set, yes;
    a file reached through `extends` (it may be a credentials file named by a hostile recipe), no."""
    return source == main_source or source.startswith(SET_SOURCE)


def _hide_value(issue: RecipeIssue) -> RecipeIssue:
    """``issue`` without the value, a "did you mean" guessed from it, or a message that quotes it."""
    message = re.sub(r"; did you mean .*?\?", ".", issue.message)
    if message.startswith("unknown key"):
        message = f"unknown key (its name is {_NOT_SHOWN}){message[len('unknown key'):]}"
    elif issue.value is not MISSING and (repr(issue.value) in message or _quoted(issue.value, message)):
        message = f"invalid value ({_NOT_SHOWN})"
    elif issue.value is not MISSING:
        message = f"{message} (the value is {_NOT_SHOWN})"
    return RecipeIssue(issue.source, issue.line, issue.path, MISSING, message, issue.hint)


def _quoted(value: Any, message: str) -> bool:
    """True when ``message`` holds ``value`` written out (a validator's f-string without repr)."""
    return isinstance(value, str) and len(value) >= 3 and value in message


def _hide_foreign(error: RecipeError, main_source: str) -> RecipeError:
    """``error`` with every issue located in a file reached through `extends` stripped of its value."""
    error.issues = [i if _echoes(i.source, main_source) else _hide_value(i) for i in error.issues]
    return error


def _sorted(issues: Iterable[RecipeIssue], main_source: str) -> list[RecipeIssue]:
    """The recipe's own lines first, top to bottom, then what `extends` and `--set` gave."""
    return sorted(issues, key=lambda i: (i.source != main_source, i.line or 10**9, i.path))


def _problem_count(main_source: str, issues: list[RecipeIssue]) -> str:
    count = len(issues)
    return f"{main_source}: {count} problem{'s' if count != 1 else ''} in the recipe"


def _discriminator_key(err: ErrorDetails) -> str:
    """The key a tagged union reads: ``type``, or the key a callable discriminator is named for
    (``granularity()`` reads ``granularity``)."""
    name = str((err.get("ctx") or {}).get("discriminator", "type")).strip("'")
    return name[:-2] if name.endswith("()") else name


def _clean_loc(raw_loc: tuple, data: Any, model: Any = None) -> tuple[tuple, Any]:
    """Drop pydantic's union tags from a location, returning the path into ``data`` and the value there.

    ``model`` (the annotation the data validates against) tells the tags of callable discriminators
    (e.g. the prune stage's granularity variants) from keys.
    """
    clean: list = []
    cur = data
    ann = model
    for part in raw_loc:
        tags = _union_tags(ann)
        ann = _unwrap(ann, part) if ann is not None else None
        if isinstance(cur, dict) and part in cur:
            clean.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            clean.append(part)
            cur = cur[part]
        elif isinstance(cur, dict) and (cur.get("type") == part or part in tags):
            continue  # discriminator tag
        elif isinstance(cur, dict) and isinstance(part, str) and not _looks_internal(part):
            clean.append(part)  # a missing or unknown key: point at the parent's position
            cur = MISSING
        else:
            break  # a union member's name such as 'list[str]' or 'function-after[...]'
    return tuple(clean), cur


def _looks_internal(part: str) -> bool:
    return any(ch in part for ch in "[]()")


def locate(loc: tuple, positions: dict, main_source: str) -> tuple[str, int | None]:
    """Where the value at ``loc`` was written; a key the recipe does not write (a default, a missing
    key) points at its nearest parent that it does, so every problem gets a line to look at."""
    for cut in range(len(loc), -1, -1):
        if loc[:cut] in positions:
            return positions[loc[:cut]]
    return main_source, None


def _message(err: ErrorDetails, raw_loc: tuple, model: type) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        allowed = _fields_at(model, raw_loc[:-1])
        close = difflib.get_close_matches(str(raw_loc[-1]), allowed, n=1, cutoff=0.6)
        did = f"; did you mean {close[0]!r}?" if close else "."
        known = f" Known keys: {', '.join(allowed)}." if allowed else ""
        return f"unknown key{did}{known}"
    if kind == "literal_error" and raw_loc and raw_loc[-1] == "type":
        # One registered member: pydantic checks the literal instead of a union tag. Same message.
        kind, ctx = "union_tag_invalid", {"tag": err.get("input"), "expected_tags": ctx.get("expected", "")}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = [t.strip().strip("'") for t in str(ctx.get("expected_tags", "")).replace(" or ", ",").split(",") if t.strip()]
        key = _discriminator_key(err)
        what = key if key != "type" else "export target" if "targets" in raw_loc else "stage type"
        if kind == "union_tag_not_found":
            return f"missing `type`: the {what}, one of {', '.join(tags)}"
        close = difflib.get_close_matches(str(ctx.get("tag")), tags, n=1)
        did = f"; did you mean {close[0]!r}?" if close else "."
        return f"unknown {what}{did} Known: {', '.join(tags)}"
    if kind == "missing":
        return "required key is missing"
    msg = err["msg"]
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg


def _fields_at(model: type, raw_loc: tuple) -> list[str]:
    """Field names of the pydantic model found at ``raw_loc`` (union tags included), for "did you mean"."""
    ann: Any = model
    for part in raw_loc:
        ann = _unwrap(ann, part)
        if ann is None:
            return []
    ann = _unwrap(ann, None)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return list(ann.model_fields)
    return []


def _peel(ann: Any) -> tuple[Any, list[Any] | None]:
    """``ann`` without Annotated and Optional wrappers, and the members when it is then a union of several."""
    for _ in range(10):
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann = typing.get_args(ann)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(members) == 1:
                ann = members[0]
                continue
            return ann, members
        break
    return ann, None


def _unwrap(ann: Any, part: Any) -> Any:
    """Step from an annotation through one location part (None: only peel wrappers)."""
    for _ in range(10):
        ann, members = _peel(ann)
        if members is None:
            break
        tagged = [m for m in members if _tag_of(m) == part]
        if tagged:
            return tagged[0]
        models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if part is None or not models:
            return ann
        ann = models[0]
    if part is None:
        return ann
    origin = typing.get_origin(ann)
    if origin is list and isinstance(part, int):
        return typing.get_args(ann)[0]
    if origin is dict:
        return typing.get_args(ann)[1]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        if part in ann.model_fields:
            return ann.model_fields[part].annotation
        if _tag_of(ann) == part:
            return ann
    return None


def _union_tags(ann: Any) -> set:
    """The tags of the tagged union ``ann`` is (Annotated and Optional peeled); empty when it is none."""
    _, members = _peel(ann)
    return {_tag_of(m) for m in members} - {None} if members else set()


def _tag_of(model: Any) -> Any:
    """A union member's tag: its ``Tag(...)`` (callable discriminators), else its ``type`` literal; a nested
    union of one stage type (the prune stage's variants) has that type as its tag."""
    if typing.get_origin(model) is typing.Annotated:
        args = typing.get_args(model)
        tag = next((m.tag for m in args[1:] if isinstance(m, Tag)), None)
        if tag is not None:
            return tag
        if typing.get_origin(args[0]) in (typing.Union, types.UnionType):
            inner = {_type_tag(typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m)
                     for m in typing.get_args(args[0])}
            return inner.pop() if len(inner) == 1 else None
        return _tag_of(args[0])
    return _type_tag(model)


def _type_tag(model: Any) -> Any:
    if isinstance(model, type) and issubclass(model, BaseModel) and "type" in model.model_fields:
        args = typing.get_args(model.model_fields["type"].annotation)
        return args[0] if len(args) == 1 else None
    return None


# --------------------------------------------------------------------------- paths


def _resolve_paths(recipe: BaseModel, positions: dict, main_file: Path) -> None:
    """Make every path field absolute, relative to the file that set it (`--set` values: the CWD); so are a
    factory's ``kwargs`` values written as relative paths (starting ``./`` or ``../``, e.g. a model folder)."""

    def base_dir(loc: Loc) -> Path:
        source, _ = positions.get(loc, (str(main_file), None))
        return Path.cwd() if source.startswith(SET_SOURCE) else Path(source).resolve().parent

    def resolve(value: str, loc: Loc, factory: bool) -> str:
        return _code_reference(value, base_dir(loc)) if factory else _absolute(value, base_dir(loc))

    def walk(obj: Any, loc: Loc) -> None:
        if isinstance(obj, BaseModel):
            for name, info in type(obj).model_fields.items():
                value = getattr(obj, name)
                extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
                if extra.get("x-code") and isinstance(value, list):  # trust.code: references, as a factory is written
                    setattr(obj, name, [resolve(v, loc + (name, i), factory=True) if isinstance(v, str) else v
                                        for i, v in enumerate(value)])
                elif extra.get("x-path") and isinstance(value, str):
                    setattr(obj, name, resolve(value, loc + (name,), factory=name in ("factory", "fn")))
                elif name == "kwargs" and isinstance(value, dict):  # a factory's `folder: ../data/model`, as written
                    for key, item in value.items():
                        if isinstance(item, str) and item.startswith(("./", "../")):
                            value[key] = resolve(item, loc + (name, key), factory=False)
                else:
                    walk(value, loc + (name,))
        elif isinstance(obj, list):
            for i, item in enumerate(obj):
                walk(item, loc + (i,))

    walk(recipe, ())


def _absolute(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())
