"""Bounded, safe YAML for recipes: what a file handed to us may cost to read, and what it may hold.

A recipe is read with PyYAML's safe constructor (no ``!!python/...`` tag builds anything) through a
composer that bounds the work a short file can demand:

- ``MAX_BYTES`` of text; binary files and text that is not UTF-8 are refused before parsing;
- ``MAX_NODES`` values in all, counting what each alias (``*name``) repeats, so a 15-line alias bomb
  (a billion values) stops after a few thousand;
- ``MAX_DEPTH`` levels of nesting, aliases included; an alias inside the collection it names (``&a [*a]``,
  an endless structure) is refused;
- a key written twice in one mapping is refused (YAML says keys are unique; PyYAML keeps the last);
- keys are text: ``1:``, ``on:`` or ``[a, b]:`` would become a number, a boolean or a tuple;
- no number that YAML 1.1 reads in another base than it looks (``010`` is 8, ``1:30`` is 90);
- no tag but ``!!str`` on a value and ``!!seq``/``!!map`` on a collection (``!!python/...``, ``!!binary``,
  ``!!set``, ``!foo`` and ``!!int x`` are refused); a date-like value stays the text it is (YAML 1.1
  would make it a ``datetime.date``).

:func:`dump_yaml` writes what :func:`parse_yaml` reads back unchanged (``recipe.resolved.yaml``).

Each refusal is a :class:`YamlRefused` with the line and a message that names no content; ``detail``
adds what was written (a key, a tag), which the loader shows only for the recipe the user named::

    node, data = parse_yaml("seed: 1\\nseed: 2\\n")   # YamlRefused: line 2, "a key set twice"
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent, MappingEndEvent, SequenceEndEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

MAX_BYTES = 1_000_000
MAX_NODES = 20_000
MAX_DEPTH = 64

_CORE = "tag:yaml.org,2002:"
PLAIN_TAGS = frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map"))
_MERGE = _CORE + "merge"
# What YAML 1.1 (PyYAML) reads as a number other than the decimal one it looks like: 010 is 8, 1:30 is 90.
_AMBIGUOUS_NUMBER = re.compile(r"^[-+]?(0[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?)$")
_KIND = {_CORE + "int": "a number", _CORE + "float": "a number", _CORE + "bool": "a boolean",
         _CORE + "null": "null", _CORE + "seq": "a list", _CORE + "map": "a mapping"}


class YamlRefused(Exception):
    """A YAML text this loader will not read: ``title`` (what, in a few words), ``message`` (the rule broken
    at ``line``) and ``hint`` (the fix) name no content of the file; ``detail`` and ``path`` (a tag, the
    key path) do, and are shown only where echoing the file is harmless."""

    def __init__(self, title: str, message: str, line: int | None = None, *, hint: str, detail: str | None = None,
                 path: tuple = ()):
        super().__init__(f"{title}: {message}")
        self.title, self.message, self.line, self.hint, self.detail, self.path = title, message, line, hint, detail, path


def read_recipe_text(file: Path) -> str:
    """The text of ``file``: at most ``MAX_BYTES``, no NUL byte, UTF-8 (a BOM is allowed)."""
    with open(file, "rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise YamlRefused("too large for a recipe", f"the file is larger than {MAX_BYTES:,} bytes; a recipe is a few kilobytes", None,
                          hint="name the recipe file itself; data and weights go in files the recipe points to")
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise YamlRefused("not UTF-8 text", "the file is UTF-16 text (it starts with a UTF-16 byte order mark)", 1,
                          hint="save the recipe as UTF-8")
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise YamlRefused("a binary file, not a YAML recipe", "a NUL byte (binary data) on this line", line,
                          hint="name a YAML recipe file (`pruneflow init` writes one)")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlRefused("not UTF-8 text", f"byte {exc.start} of the file cannot be decoded as UTF-8", line,
                          hint="save the recipe as UTF-8") from None


class _Resolver(Resolver):
    """PyYAML's resolver without the implicit timestamp: ``2024-01-01`` stays text, as in YAML 1.2."""


_Resolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _CORE + "timestamp"]
    for first, resolvers in Resolver.yaml_implicit_resolvers.items()
}


class _BoundedComposer(Parser, Composer, _Resolver):
    """PyYAML's composer, counting the values each alias repeats and the nesting each one adds (the parser
    and resolver are bases only so the type checker sees the methods the composer calls)."""

    def __init__(self) -> None:
        Composer.__init__(self)
        self._open: list[Node] = []  # the collections being composed: an alias to one is endless
        self._path: list[Any] = []  # the key path of the value being composed (for messages)
        self._size: dict[int, int] = {}  # id(node) -> values it expands to, its aliases included
        self._height: dict[int, int] = {}  # id(node) -> nesting levels it holds (a scalar: 0)
        self._total = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            line = event.start_mark.line + 1
            if target is not None:
                if any(target is node for node in self._open):
                    raise YamlRefused("an alias inside the collection it names",
                                      "an alias refers to the collection that contains it (an endless structure)",
                                      line, hint="copy the values instead of the alias", path=tuple(self._path))
                self._count(self._size[id(target)], line)
                self._check_depth(len(self._open) + self._height[id(target)], line)
            return super().compose_node(parent, index)  # an undefined alias: PyYAML's own error
        node = super().compose_node(parent, index)
        if node is not None:
            self._check_tag(node)
        return node

    def compose_scalar_node(self, anchor: Any) -> ScalarNode:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if event.tag not in (None, "!", _CORE + "str"):  # `!!int x`, `!!bool x` would make PyYAML raise a bare error
            raise YamlRefused("a YAML tag", "a YAML tag on a value; write the value plainly (`3`, `true`), or "
                              "quote it as text", line, detail=event.tag, path=tuple(self._path),
                              hint="remove the `!tag` (a recipe never builds Python objects)")
        self._count(1, line)
        node = super().compose_scalar_node(anchor)
        self._size[id(node)], self._height[id(node)] = 1, 0
        if node.style is None and node.tag in (_CORE + "int", _CORE + "float") and _AMBIGUOUS_NUMBER.match(node.value):
            raise YamlRefused("a number in base 8 or 60", "YAML 1.1 reads a number with a leading 0 in base 8 (010 is 8) "
                              "and one with ':' in base 60 (1:30 is 90)", line, detail=node.value,
                              path=tuple(self._path), hint="write the number without the leading 0 or ':', or quote it as text")
        return node

    def compose_sequence_node(self, anchor: Any) -> SequenceNode:
        start = self.get_event()
        node = SequenceNode(self._tag_of(start, SequenceNode), [], start.start_mark, None, flow_style=start.flow_style)
        first = self._open_collection(node, anchor)
        while not self.check_event(SequenceEndEvent):
            self._path.append(len(node.value))
            node.value.append(self.compose_node(node, len(node.value)))
            self._path.pop()
        self._close_collection(node, first, [node.value])
        return node

    def compose_mapping_node(self, anchor: Any) -> MappingNode:
        start = self.get_event()
        node = MappingNode(self._tag_of(start, MappingNode), [], start.start_mark, None, flow_style=start.flow_style)
        first = self._open_collection(node, anchor)
        seen: dict[str, int] = {}
        while not self.check_event(MappingEndEvent):
            key = self.compose_node(node, None)
            assert key is not None  # a mapping key is a node (PyYAML's composer returns None only at stream end)
            name = self._check_key(key, seen)
            self._path.append(name)
            value = self.compose_node(node, key)
            self._path.pop()
            node.value.append((key, value))
        self._close_collection(node, first, [[k for k, _ in node.value], [v for _, v in node.value]])
        return node

    # ------------------------------------------------------------------ helpers

    def _tag_of(self, event: Any, kind: type) -> str:
        tag = event.tag
        return self.resolve(kind, None, event.implicit) if tag is None or tag == "!" else tag

    def _open_collection(self, node: Node, anchor: Any) -> int:
        line = node.start_mark.line + 1
        self._check_depth(len(self._open) + 1, line)
        self._count(1, line)
        if anchor is not None:
            self.anchors[anchor] = node
        self._open.append(node)
        return self._total - 1

    def _close_collection(self, node: Node, first: int, children: list[list[Node]]) -> None:
        node.end_mark = self.get_event().end_mark
        self._open.pop()
        self._size[id(node)] = self._total - first
        self._height[id(node)] = 1 + max((self._height[id(c)] for group in children for c in group), default=0)

    def _count(self, values: int, line: int) -> None:
        self._total += values
        if self._total > MAX_NODES:
            raise YamlRefused("aliases expand to too many values", f"the recipe expands to more than {MAX_NODES:,} values (an alias `*name` repeats everything its "
                              "anchor holds)", line, hint="write the recipe without aliases that repeat large parts",
                              path=tuple(self._path))

    def _check_depth(self, depth: int, line: int) -> None:
        if depth > MAX_DEPTH:
            raise YamlRefused("nested too deeply", f"nests more than {MAX_DEPTH} levels deep (aliases included)", line,
                              hint="a recipe needs a few levels; remove the extra nesting", path=tuple(self._path))

    def _check_tag(self, node: Node) -> None:
        if node.tag not in PLAIN_TAGS and node.tag != _MERGE:
            raise YamlRefused("a YAML tag", "a YAML tag; a recipe holds only plain text, numbers, booleans, lists and "
                              "mappings", node.start_mark.line + 1, detail=node.tag, path=tuple(self._path),
                              hint="remove the `!tag` (a recipe never builds Python objects)")

    def _check_key(self, key: Node, seen: dict[str, int]) -> str:
        line = key.start_mark.line + 1
        if key.tag == _MERGE:
            return "<<"
        if not isinstance(key, ScalarNode) or key.tag != _CORE + "str":
            kind = _KIND.get(key.tag, "not text") if isinstance(key, ScalarNode) else "a list or mapping"
            raise YamlRefused("a key that is not text", f"a key that YAML reads as {kind}; recipe keys are text", line,
                              detail=key.value if isinstance(key, ScalarNode) else None, path=tuple(self._path),
                              hint="quote the key (`'1': ...`, `'on': ...`) or write it as a name")
        if key.value in seen:
            raise YamlRefused("a key set twice", f"the key is set at line {seen[key.value]} and again at line {line} "
                              "(YAML would silently keep only the last)", line,
                              path=tuple(self._path) + (key.value,), hint="delete one of the two lines")
        seen[key.value] = line
        return key.value


class _Loader(Reader, Scanner, _BoundedComposer, SafeConstructor):
    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self)
        SafeConstructor.__init__(self)
        _Resolver.__init__(self)


def parse_yaml(text: str) -> tuple[Node | None, Any]:
    """The node tree (for source positions) and the data of one YAML document, bounded as described above.

    Raises YamlRefused, or yaml.YAMLError for a syntax error. The data holds no shared objects: a
    value an alias repeated is a copy, so changing one place (``--set``) changes only that place.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        try:
            data = loader.construct_document(node) if node is not None else None
        except (ArithmeticError, LookupError, TypeError, ValueError) as exc:  # PyYAML's own bare errors
            raise YamlRefused("a value YAML cannot build", f"{type(exc).__name__} while building the data", None,
                              hint="write plain text, numbers, booleans, lists and mappings") from None
    finally:
        loader.dispose()
    return node, unshare(data)


def unshare(data: Any) -> Any:
    """A copy of plain data with every mapping and list its own object (``copy.deepcopy`` keeps sharing)."""
    if isinstance(data, dict):
        return {k: unshare(v) for k, v in data.items()}
    if isinstance(data, list):
        return [unshare(v) for v in data]
    return data


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, except that text holding a Unicode line break (NEL, LS, PS) is double-quoted:
    with ``allow_unicode`` PyYAML writes them raw in single quotes, and its reader folds them into a space."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = '"' if any(ch in value for ch in "\x85\u2028\u2029") else None
    return dumper.represent_scalar(_CORE + "str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Any, **options: Any) -> str:
    """YAML that :func:`parse_yaml` reads back as ``data`` (what ``recipe.resolved.yaml`` is written with);
    ``options`` go to ``yaml.dump`` (e.g. ``default_flow_style=True`` for one line)."""
    return yaml.dump(data, Dumper=_Dumper, **{"sort_keys": False, "allow_unicode": True, **options})
