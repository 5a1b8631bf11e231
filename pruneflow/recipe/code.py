"""What code a recipe may run (issue 41): a recipe names a model, not a program.

A recipe's code references (``model.factory``, a stage's ``teacher.factory``, and any later field that names a
callable) run without asking only when they are the zoo's (a name without ``:``, checked by ``models.py``) or
the recipe's own files: a ``file.py:fn`` or ``package.module:fn`` whose source lies inside the folder tree of
the recipe file, symbolic links followed, and not inside an installed package. Anything else (``torch.hub:load``,
``numpy:load``, ``pandas:read_pickle``, a file elsewhere) runs only when it is listed, exactly as the reference is
written, in the recipe's ``trust.code`` or given with ``--trust-code``. Python's standard library and builtins are
refused whatever the list says: they build no model.

One object answers for every field: :class:`CodeTrust`, made by ``load_recipe`` and carried on each ``ModelSpec``
(``ModelSpec.code_trust``). Before anything is imported, :meth:`CodeTrust.check` (where the code lives, who
allowed it); after the import, :meth:`CodeTrust.check_callable` (where the callable it gave was defined: an own
file that re-exports ``torch.hub.load`` is ``torch.hub.load``)::

    trust = CodeTrust(root=Path("proj"), recipe=("numpy:load",))
    trust.check("numpy:load", "model.factory")            # 'allowed by the recipe's trust.code'
    trust.check("proj/models.py:build", "model.factory")   # 'a file in the recipe's folder'
"""

from __future__ import annotations

import ast
import importlib.machinery
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import InputError

__all__ = ["CodeTrust", "module_source", "refuse_standard_library", "split_reference", "top_level_bindings"]

#: What the recipe's own fields are called in messages and `validate`'s lines.
OWN_FILE = "a file in the recipe's folder"
BY_RECIPE = "allowed by the recipe's trust.code"
BY_COMMAND_LINE = "allowed by --trust-code"


def split_reference(ref: str, field: str) -> tuple[str, str]:
    """``module:function`` or ``file.py:function`` as (target, name); a target of Python's standard library is refused."""
    if ":" not in ref:
        raise InputError(f"{field} {ref!r} is neither a zoo model nor `module:function`",
                         hint="use a zoo name, `package.module:function` or `path/to/file.py:function`")
    target, name = ref.rsplit(":", 1)
    refuse_standard_library(ref, target.split(".")[0], field)
    return target, name


def refuse_standard_library(ref: str, package: str, field: str = "model.factory") -> None:
    """A callable of Python's standard library or builtins (`os:system`, `subprocess:run`, a user module's
    `from os import system`) builds no model and would run whatever the kwargs say: refused, trusted or not."""
    if package in sys.stdlib_module_names or package == "builtins":
        raise InputError(f"{field} {ref!r} names a callable of Python's standard library ({package}), which "
                         "builds no model", hint="point at a function of your own module (`path/to/file.py:build`) "
                         "in the recipe's folder, or a zoo model")


def module_source(target: str, ref: str, field: str = "model.factory") -> Path | None:
    """The file of module ``target``, found without importing it or its parent packages (whose ``__init__`` is code)."""
    parts = target.split(".")
    try:
        spec = _find_top_level(parts[0])  # a top-level name: the finders locate it, nothing is executed
        for i in range(1, len(parts)):
            if spec is None or not spec.submodule_search_locations:
                break
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    except (ImportError, ValueError) as exc:
        raise InputError(f"{field} {ref!r}: cannot find module {target!r} ({exc})",
                         hint="point at a file in the recipe's folder: `path/to/file.py:function`") from None
    if spec is None or (len(parts) > 1 and spec.name != target):
        raise InputError(f"{field} {ref!r}: no module {target!r} is installed",
                         hint="point at a file in the recipe's folder: `path/to/file.py:function`")
    return Path(spec.origin) if spec.origin and spec.has_location else None


def _find_top_level(name: str) -> Any:
    """``importlib.util.find_spec(name)`` for a top-level name, without setuptools' ``_distutils_hack`` finder: asked
    for ``pip``, that finder switches setuptools' distutils off for the rest of the process (it takes it for pip
    running), and NNCF's build then failed in a process that had only checked a recipe naming ``pip:main``."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__spec__", None)
    for finder in sys.meta_path:
        if type(finder).__module__.startswith("_distutils_hack") or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, None)
        if spec is not None:
            return spec
    return None


def top_level_bindings(body: list) -> tuple[dict[str, str | None], str]:
    """Names a module body binds (in ``if``/``try``/``with`` blocks too) -> where an import took them from
    (``module:name`` for ``from module import name``, ``module`` for ``import module``; None for a def, a class,
    an assignment or a relative import); and what makes the list incomplete (``import *``, ``__getattr__``)."""
    names: dict[str, str | None] = {}
    opaque = ""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = None
            opaque = opaque or ("a module __getattr__" if node.name == "__getattr__" else "")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update({n.id: None for n in ast.walk(target) if isinstance(n, ast.Name)})
        elif isinstance(node, ast.Import):
            names.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            opaque = opaque or (f"`from {module} import *`" if any(a.name == "*" for a in node.names) else "")
            names.update({a.asname or a.name: None if node.level else f"{module}:{a.name}" for a in node.names if a.name != "*"})
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler, getattr(ast, "TryStar", ast.Try))):
            blocks = [getattr(node, block, []) for block in ("body", "orelse", "finalbody", "handlers")]
            for inner, more in (top_level_bindings(block) for block in blocks if block):
                names.update(inner)
                opaque = opaque or more
    return names, opaque


def _installed_roots() -> tuple[Path, ...]:
    """Where installed code lives: a recipe folder that holds a virtual environment does not make torch its own."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages()}
    paths |= {p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
    paths.add(str(Path(__file__).resolve().parents[1]))  # pruneflow itself: its zoo is named by zoo name
    return tuple(Path(p).resolve() for p in paths if p)


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


@dataclass(frozen=True)
class CodeTrust:
    """What code the recipe at ``root`` may run: its own files, and the references listed in its ``trust.code``
    (``recipe``) or given with ``--trust-code`` (``command_line``), each as the recipe writes it (files absolute)."""

    root: Path
    recipe: tuple[str, ...] = ()
    command_line: tuple[str, ...] = ()

    def allowed_by(self, ref: str) -> str | None:
        """Which list names ``ref``, in words; None when neither does."""
        return BY_COMMAND_LINE if ref in self.command_line else BY_RECIPE if ref in self.recipe else None

    def own_file(self, path: Path | str | None) -> bool:
        """Whether ``path`` (links followed) lies inside the recipe's folder tree and outside any installed package."""
        if path is None:
            return False
        resolved = Path(path).resolve()
        parts = set(resolved.parts)
        if "site-packages" in parts or "dist-packages" in parts:
            return False
        return _within(resolved, self.root.resolve()) and not any(_within(resolved, p) for p in _installed_roots())

    def check(self, ref: str, field: str) -> str:
        """Before any import: why ``ref`` may run (own file, or which list allows it); InputError when nothing does."""
        target, name = split_reference(ref, field)
        allowed = self.allowed_by(ref)
        if allowed:
            return allowed
        source = Path(target) if target.endswith(".py") else module_source(target, ref, field)
        if self.own_file(source):
            return OWN_FILE
        raise self.refusal(ref, field, f"its code lies outside the recipe's folder ({source or target})")

    def check_binding(self, ref: str, origin: str, field: str) -> None:
        """``ref`` is an own file's ``from module import name`` (``origin`` = ``module:name``): the callable is that
        module's, so it needs what ``origin`` itself would (an own module, or a list naming ``ref`` or ``origin``)."""
        module = origin.split(":")[0]
        refuse_standard_library(ref, module.split(".")[0], field)
        if self.allowed_by(ref) or self.allowed_by(origin):
            return
        try:
            source = module_source(module, ref, field)
        except InputError:
            return  # not found without importing it: the callable is checked when the model is built
        if not self.own_file(source):
            raise self.refusal(ref, field, f"it is {origin}, imported from outside the recipe's folder ({source or module})",
                               name=origin)

    def check_callable(self, ref: str, fn: Callable[..., Any], field: str) -> None:
        """After the import: the callable ``ref`` gave must be defined in an own file, unless a list allows ``ref`` or
        the callable's own name (``torch.hub:load``)."""
        module_name = str(getattr(fn, "__module__", "") or "")
        refuse_standard_library(ref, module_name.split(".")[0], field)
        file = getattr(sys.modules.get(module_name), "__file__", None)
        qualified = f"{module_name}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        if self.own_file(file) or self.allowed_by(ref) or self.allowed_by(qualified):
            return
        raise self.refusal(ref, field, f"it is {qualified}, defined outside the recipe's folder ({file or 'no file'})",
                           name=qualified)

    def refusal(self, ref: str, field: str, why: str, name: str | None = None) -> InputError:
        listed = name or ref
        return InputError(
            f"{field} {ref!r} would run code that is not the recipe's: {why}. A recipe names a model, not a program: "
            f"it runs the zoo's models and its own files (under {self.root}) without asking, anything else only when "
            "its owner lists it",
            hint=f"if you trust {listed} to run with the recipe's arguments, list it in the recipe (`trust: {{code: "
            f"[\"{listed}\"]}}`) or pass `--trust-code {listed}`; else use a zoo model or a factory file in the "
            "recipe's folder")
