"""The shape of the house, checked from the source: imports go down the layers of docs/architecture.md (its
layer table is read from the doc, so the two cannot drift), no import circles, the core never imports a
plugin, no function over 60 lines, no backslash continuations.

Read with ``ast``/``tokenize`` (nothing is imported), so an import inside a function or under
``TYPE_CHECKING`` counts as much as one at the top: a circle hidden in a function still tangles the layers,
and an annotation naming a type from a layer above makes the lower layer's contract depend on it.
Each ``KNOWN_*`` constant lists the offenders other branches of issue 11 are removing; it must match
exactly (a fixed offender still listed fails too), and is emptied once those branches are merged.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("pruneflow", "qat", "calibrate")
PLUGINS = ("qat", "calibrate", "nncf")  # what the core reaches only through entry points (or not at all)
MAX_FUNCTION_LINES = 60
#: A module longer than this holds more than one room (issue 40 split export/qdq.py, cli.py, data.py, pipeline.py and
#: stages/export.py below it).
MAX_FILE_LINES = 600

# export/onnx.py ↔ export/qdq.py: the export branch of issue 11 breaks it.
KNOWN_IMPORT_CIRCLES: list[set[str]] = []
# The model-handle branch moves the NNCF code behind the `nncf` model kind in qat/.
KNOWN_PLUGIN_IMPORTS: set[str] = set()
# The one-round-loop branch of issue 11 splits these.
KNOWN_LONG_FUNCTIONS: set[str] = set()
KNOWN_BACKSLASH_FILES: set[str] = set()
# Imports against the layer table of docs/architecture.md ("importer → imported"); issue 23 emptied it.
KNOWN_WRONG_WAY: set[str] = set()


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_files(*tops: str) -> list[Path]:
    files: list[Path] = []
    for top in tops:
        path = ROOT / top
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every module an import statement names, absolute (relative ones resolved), with its line.

    ``from a import b`` yields both ``a`` and ``a.b``: ``b`` may be a submodule.
    """
    module = module_name(path, root)
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
    return [(line, source_name(name)) for line, name in found]


#: What the wheel installs as pruneflow.qat, pruneflow.calibrate and pruneflow.cli lives in the tree as qat/,
#: calibrate/ and cli.py (pyproject's package-dir, setup.py): an import of the installed name is an import of that file.
INSTALLED_AS = {"pruneflow.qat": "qat", "pruneflow.calibrate": "calibrate", "pruneflow.cli": "cli"}


def source_name(name: str) -> str:
    for installed, source in INSTALLED_AS.items():
        if name == installed or name.startswith(installed + "."):
            return source + name[len(installed):]
    return name


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


def layer_table(doc: str) -> list[tuple[str, list[str]]]:
    """The layer table of docs/architecture.md, top layer first: ``[(layer, [entry, ...]), ...]``.

    The markdown table whose header starts ``| layer | modules |``; each entry is a backticked path from the
    repository root: ``a/b.py`` names one file, ``a/b/`` every file under that folder.
    """
    lines = doc.splitlines()
    header = next((i for i, line in enumerate(lines) if _cells(line)[:2] == ["layer", "modules"]), None)
    assert header is not None, "no `| layer | modules |` table in docs/architecture.md"
    rows = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        rows.append((cells[0].strip("`*"), re.findall(r"`([^`]+)`", cells[1])))
    return rows


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []


def layers_of(table: list[tuple[str, list[str]]], files: list[Path], root: Path = ROOT) -> dict[str, list[int]]:
    """Module → the level (0 = the bottom row of the table) of every row with an entry naming its file."""
    bottom_first = list(reversed(table))
    found = {}
    for path in files:
        name = path.relative_to(root).as_posix()
        found[module_name(path, root)] = [
            level for level, (_, entries) in enumerate(bottom_first)
            if any(name == entry or (entry.endswith("/") and name.startswith(entry)) for entry in entries)
        ]
    return found


def wrong_way_imports(table: list[tuple[str, list[str]]], files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """``"importer → imported"`` → its ``file:line`` list, for every import of one of ``files`` from a layer
    below the imported one (a name resolves to its longest prefix that is one of ``files``' modules)."""
    levels = {module: found[0] for module, found in layers_of(table, files, root).items() if len(found) == 1}
    paths = {module_name(path, root): path for path in files}
    wrong: dict[str, list[str]] = {}
    for module, path in paths.items():
        for line, name in imported_names(path, root):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            where = f"{path.relative_to(root).as_posix()}:{line}"
            if name in levels and module in levels and levels[name] > levels[module]:
                if where not in wrong.setdefault(f"{module} → {name}", []):
                    wrong[f"{module} → {name}"].append(where)
    return wrong


def test_the_layer_table_is_read_from_the_doc():
    """Each row names its layer and files or folders that exist; cli.py on top, errors.py at the bottom."""
    table = layer_table(ARCHITECTURE_DOC.read_text())
    assert len(table) >= 2 and all(layer and entries for layer, entries in table), table
    missing = [e for _, entries in table for e in entries if not (ROOT / e).exists() or e.endswith("/") != (ROOT / e).is_dir()]
    assert not missing, f"layer table entries that name no file or folder: {missing}"
    assert "cli.py" in table[0][1] and "pruneflow/errors.py" in table[-1][1]


def test_every_module_is_in_exactly_one_layer():
    found = layers_of(layer_table(ARCHITECTURE_DOC.read_text()), python_files(*PACKAGES, "cli.py"))
    unplaced = sorted(m for m, levels in found.items() if not levels)
    doubled = sorted(m for m, levels in found.items() if len(levels) > 1)
    assert not unplaced and not doubled, (
        f"modules in no layer: {unplaced}; in more than one: {doubled}. Place each in the layer table of "
        "docs/architecture.md (## Layers)."
    )


def test_imports_go_down_the_layers():
    """Each module imports only from its own layer or below (function-level and TYPE_CHECKING imports too)."""
    wrong = wrong_way_imports(layer_table(ARCHITECTURE_DOC.read_text()), python_files(*PACKAGES, "cli.py"))
    assert set(wrong) == KNOWN_WRONG_WAY, (
        f"imports against the layer table of docs/architecture.md: {wrong}; known: {sorted(KNOWN_WRONG_WAY)}. "
        "Move what is needed down a layer, or invert the dependency (the lower layer takes a callable or a "
        "registry entry); drop a fixed one from KNOWN_WRONG_WAY."
    )


PLANTED_DOC = """
| layer | modules | what |
|---|---|---|
| top | `app/` | the front |
| bottom | `base.py`, `util/` | below everything |
"""


def test_the_layer_check_fails_on_a_planted_wrong_way_import(tmp_path):
    """An import up the table is found wherever it hides: at the top, in a function, under TYPE_CHECKING."""
    files = {
        "app/__init__.py": "",
        "app/main.py": "from base import thing\nfrom util.deep import other\n",
        "base.py": "import app.main\n\ndef thing():\n    from app import main\n",
        "util/__init__.py": "",
        "util/deep.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.main import x\nfrom base import thing\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    table = layer_table(PLANTED_DOC)
    assert table == [("top", ["app/"]), ("bottom", ["base.py", "util/"])]
    found = wrong_way_imports(table, sorted(tmp_path.rglob("*.py")), tmp_path)
    assert found == {"base → app.main": ["base.py:1", "base.py:4"], "base → app": ["base.py:4"],
                     "util.deep → app.main": ["util/deep.py:3"]}


def test_the_real_table_catches_a_kernel_module_importing_the_pipeline(tmp_path):
    """The doc's own table, with a function-level import of the pipeline planted in errors.py."""
    for name in ("pruneflow/__init__.py", "pruneflow/pipeline.py", "pruneflow/errors.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text() if name != "pruneflow/pipeline.py" else "")
    planted = tmp_path / "pruneflow" / "errors.py"
    planted.write_text(planted.read_text() + "\n\ndef planted():\n    from .pipeline import run_recipe\n")
    table = layer_table(ARCHITECTURE_DOC.read_text())
    found = wrong_way_imports(table, sorted(tmp_path.rglob("*.py")), tmp_path)
    assert list(found) == ["pruneflow.errors → pruneflow.pipeline"], found


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
    """qat/ and calibrate/ arrive through entry points; nncf only behind the model kind that qat/ registers. The
    command line (cli.py and its commands, the top layer) may call a plugin's own command: `pruneflow calibrate`."""
    offenders: dict[str, list[str]] = {}
    for path in [p for p in python_files("pruneflow") if not rel(p).startswith("pruneflow/commands/")]:
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


def test_no_module_over_600_lines():
    """A module that long holds several rooms: split it by reason to change, as issue 40 did."""
    long = {str(p.relative_to(ROOT)): n for p in python_files(*PACKAGES, "cli.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"modules over {MAX_FILE_LINES} lines: {long}"


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
