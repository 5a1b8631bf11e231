"""The shape of the house, checked from the source: no import circles, the core never imports a plugin,
no function over 60 lines, no backslash continuations.

Read with ``ast``/``tokenize`` (nothing is imported), so an import inside a function or under
``TYPE_CHECKING`` counts as much as one at the top: a circle hidden in a function still tangles the layers.
Each ``KNOWN_*`` constant lists the offenders other branches of issue 11 are removing; it must match
exactly (a fixed offender still listed fails too), and is emptied once those branches are merged.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pruneflow", "qat", "calibrate")
PLUGINS = ("qat", "calibrate", "nncf")  # what the core reaches only through entry points (or not at all)
MAX_FUNCTION_LINES = 60

# export/onnx.py ↔ export/qdq.py: the export branch of issue 11 breaks it.
KNOWN_IMPORT_CIRCLES: list[set[str]] = []
# The model-handle branch moves the NNCF code behind the `nncf` model kind in qat/.
KNOWN_PLUGIN_IMPORTS: set[str] = set()
# The one-round-loop branch of issue 11 splits these.
KNOWN_LONG_FUNCTIONS: set[str] = set()
KNOWN_BACKSLASH_FILES: set[str] = set()


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_files(*tops: str) -> list[Path]:
    files: list[Path] = []
    for top in tops:
        path = ROOT / top
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement names, absolute (relative ones resolved), with its line.

    ``from a import b`` yields both ``a`` and ``a.b``: ``b`` may be a submodule.
    """
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of ours it imports (a name resolves to its longest prefix that is one of ours)."""
    paths = {module_name(p): p for p in python_files(*PACKAGES, "cli.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for _, name in imported_names(path):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
            elif nxt in index:
                low[node] = min(low[node], index[nxt])
            else:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
    return found


def test_circle_finder_finds_a_circle_and_ignores_a_chain():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    """cli → pipeline → stages → services → kernel: a circle makes two layers one."""
    found = sorted(sorted(c) for c in circles(import_graph()))
    assert found == sorted(sorted(c) for c in KNOWN_IMPORT_CIRCLES), (
        "import circles (AST, every import): " + "; ".join(" ↔ ".join(c) for c in found)
        + ". Break a new one with a kernel module both sides import; drop a fixed one from KNOWN_IMPORT_CIRCLES."
    )


def test_the_core_never_imports_a_plugin():
    """qat/ and calibrate/ arrive through entry points; nncf only behind the model kind that qat/ registers."""
    offenders: dict[str, list[str]] = {}
    for path in python_files("pruneflow"):
        for line, name in imported_names(path):
            if name.split(".")[0] in PLUGINS:
                offenders.setdefault(rel(path), []).append(f"{line}: {name}")
    assert set(offenders) == KNOWN_PLUGIN_IMPORTS, (
        f"imports of {', '.join(PLUGINS)} under pruneflow/: {offenders}; known: {sorted(KNOWN_PLUGIN_IMPORTS)}"
    )


def long_functions() -> dict[str, int]:
    """``file:Qualified.name`` → lines, for every function or method longer than MAX_FUNCTION_LINES."""
    found = {}
    for path in python_files(*PACKAGES, "cli.py", "benchmarks"):
        tree = ast.parse(path.read_text(), str(path))
        for node, qualname in _functions(tree, ""):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found[f"{rel(path)}:{qualname}"] = length
    return found


def _functions(node: ast.AST, prefix: str):
    """Every function under ``node`` with its dotted name (classes and enclosing functions included)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                yield child, name
            yield from _functions(child, name + ".")
        else:
            yield from _functions(child, prefix)


def test_no_function_over_60_lines():
    """A function that long does several things; split it along them (def line to last line counted)."""
    found = long_functions()
    assert set(found) == KNOWN_LONG_FUNCTIONS, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def backslash_continuations(source: str) -> list[int]:
    """Lines joined to the next by a trailing backslash (one inside a string or a comment does not count).

    The tokenizer ends every other line with an NL or NEWLINE token; a continued line has none.
    """
    ended: set[int] = set()
    spans: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE):
            ended.add(tok.start[0])
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            spans.append((tok.start, tok.end))
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        at = (number, len(line) - 1)
        if line.endswith("\\") and number not in ended and not any(start <= at < end for start, end in spans):
            found.append(number)
    return found


@pytest.mark.parametrize(("source", "lines"), [
    ("x = 1 + \\\n    2\n", [1]),
    ('s = """a \\\nb"""\n', []),
    ("s = 'a\\\\'\n# ends in a backslash \\\n", []),
    ("y = (1 +\n     2)\n", []),
])
def test_backslash_finder(source, lines):
    assert backslash_continuations(source) == lines


def test_no_backslash_continuations():
    """Brackets say where an expression continues; a backslash breaks on trailing whitespace."""
    found = {}
    for path in python_files(*PACKAGES, "cli.py", "benchmarks", "tests"):
        lines = backslash_continuations(path.read_text())
        if lines:
            found[rel(path)] = lines
    assert set(found) == KNOWN_BACKSLASH_FILES, f"backslash continuations (file: lines): {found}"
