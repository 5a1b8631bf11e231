"""Model sources: zoo names, ``pkg.module:fn``, ``path/file.py:fn``; checkpoints (weights only)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pickle
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .errors import ConfigError, InputError
from .preflight import check_dtypes, check_finite_weights
from .recipe.code import CodeTrust, module_source, refuse_standard_library, split_reference, top_level_bindings
from .recipe.models import ModelSpec
from .zoo import ZOO

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".th", ".bin", ".safetensors")


def resolve_factory(factory: str, trust: CodeTrust | None = None, field: str = "model.factory") -> Callable[..., Any]:
    """Find the callable a code reference names (``model.factory``, or another ``field`` that names one). With the
    recipe's ``trust`` (``recipe/code.py``), code that is neither the zoo's nor the recipe's own is refused before it
    is imported, and a callable it gives from elsewhere after. Raises InputError (exit 2) when it can't, or may not."""
    if factory in ZOO:
        return ZOO[factory].factory
    target, name = _split_factory(factory, field)
    if trust is not None:
        trust.check(factory, field)
    if target.endswith(".py"):
        module = _import_file(Path(target), factory, field)
    else:
        try:
            module = importlib.import_module(target)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - ImportError, or whatever the module raises (or exits) while importing
            raise InputError(
                f"{field} {factory!r}: cannot import module {target!r} ({exc})",
                hint="install the package that provides it, or point at a file: `path/to/file.py:function`",
            ) from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise InputError(f"{field} {factory!r}: {target!r} has no attribute {name!r}",
                         hint=f"callables there: {', '.join(sorted(public)[:12]) or '(none)'}")
    if not callable(fn):
        raise InputError(f"{field} {factory!r}: {name!r} is a {type(fn).__name__}, not a callable",
                         hint="point at a function or class that returns a torch.nn.Module")
    refuse_standard_library(factory, str(getattr(fn, "__module__", "") or "").split(".")[0], field)
    if trust is not None:
        trust.check_callable(factory, fn, field)
    return fn


def _split_factory(factory: str, field: str = "model.factory") -> tuple[str, str]:
    """``module:function`` or ``file.py:function`` as (target, name); neither, or a target of Python's standard
    library, is an InputError."""
    if ":" not in factory:
        raise InputError(
            f"{field} {factory!r} is neither a zoo model nor `module:function`",
            hint=f"use a zoo name ({', '.join(ZOO)}), `package.module:function` or `path/to/file.py:function`",
        )
    return split_reference(factory, field)


#: A factory file larger than this is not parsed by `validate` (a source file is kilobytes; a planted one may be a device).
MAX_FACTORY_SOURCE = 16 * 1024 * 1024


def check_factory_statically(factory: str, trust: CodeTrust | None = None, field: str = "model.factory") -> str | None:
    """What `validate` and ``--dry-run`` check of a code reference (``model.factory``) without running any of its
    code (issue 27): a zoo name, or ``file.py:fn`` / ``package.module:fn`` whose file exists, parses, and binds ``fn``
    at top level (a def, a class, an assignment or an import that is not from the standard library). The file is
    found the way Python would find it, but not imported: its top-level code runs only when `optimize` builds the
    model. With the recipe's ``trust``, the code must be the recipe's own or listed (``recipe/code.py``).

    Returns a note when the binding could not be confirmed from the source (a ``from x import *``, a module
    ``__getattr__``, a compiled extension); raises InputError (exit 2) for what is certainly wrong.
    """
    if factory in ZOO:
        return None
    target, name = _split_factory(factory, field)
    if trust is not None:
        trust.check(factory, field)
    if not target.endswith(".py") and target in sys.modules:  # already imported (torch, pruneflow.zoo): no new code runs
        fn = getattr(sys.modules[target], name, None)
        if not callable(fn):
            raise InputError(f"{field} {factory!r}: {target!r} has no callable {name!r}",
                             hint="point at a function or class that returns a torch.nn.Module")
        refuse_standard_library(factory, str(getattr(fn, "__module__", "") or "").split(".")[0], field)
        if trust is not None:
            trust.check_callable(factory, fn, field)
        return None
    source = Path(target) if target.endswith(".py") else module_source(target, factory, field)
    if source is None or source.suffix != ".py":
        return f"{field} {factory!r}: {target} is not Python source here, so {name!r} is checked when the model is built"
    if not source.is_file():
        raise InputError(f"{field} {factory!r}: file not found: {source}", hint="the path is relative to the recipe file")
    return _check_binding(factory, source, name, trust, field)


def _check_binding(factory: str, source: Path, name: str, trust: CodeTrust | None, field: str) -> str | None:
    import ast

    if source.stat().st_size > MAX_FACTORY_SOURCE or not source.is_file():
        raise InputError(f"{field} {factory!r}: {source} is not a Python source file of a sane size",
                         hint="point at the .py file that defines the factory")
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (SyntaxError, ValueError) as exc:
        where = f"{source}:{exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else str(source)
        raise InputError(f"{field} {factory!r}: {where} does not parse as Python ({exc.msg if isinstance(exc, SyntaxError) else exc})",
                         hint=f"fix {source}") from None
    bindings, opaque = top_level_bindings(tree.body)
    if name in bindings:
        origin = bindings[name]
        if origin is not None:
            refuse_standard_library(factory, origin.split(".")[0].split(":")[0], field)
            if trust is not None:
                trust.check_binding(factory, origin, field)
        return None
    if opaque:
        return f"{field} {factory!r}: {source} may define {name!r} through {opaque}; it is checked when the model is built"
    import difflib

    defined = sorted(n for n, origin in bindings.items() if origin is None and not n.startswith("_"))
    close = difflib.get_close_matches(name, defined, n=1)
    raise InputError(f"{field} {factory!r}: {source} defines no {name!r} at top level",
                     hint=(f"did you mean {close[0]!r}? " if close else "") + f"names defined there: {', '.join(defined[:12]) or '(none)'}")


def _import_file(path: Path, factory: str, field: str = "model.factory"):
    if not path.is_file():
        raise InputError(f"{field} {factory!r}: file not found: {path}", hint="the path is relative to the recipe file")
    # A stable module name, so pickled modules that reference it can find it again.
    name = "pruneflow_user_" + path.stem + "_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code: report it with the file named
        del sys.modules[name]
        raise InputError(f"{field} {factory!r}: importing {path} failed: {_what_failed(exc)}",
                         hint=f"fix {path}: importing it must define the factory, not exit or fail") from exc
    return module


#: Factory arguments that tabular data fills in (``data.features``) when the factory takes them and ``model.kwargs``
#: does not set them: the tables' row counts follow from the vocabularies, which only the data knows.
DATA_KWARGS = ("cardinalities", "num_dense", "bag_cardinalities", "bag_length")


def with_data_kwargs(spec: ModelSpec, schema: Any) -> tuple[ModelSpec, dict[str, Any]]:
    """``spec`` with ``cardinalities`` (each categorical field's table rows) and ``num_dense`` (numeric fields)
    taken from tabular data's ``schema`` (``tabular.TabularSchema``), where the factory takes them and the recipe
    does not give them; and what was filled in."""
    import inspect as pyinspect

    entry = ZOO.get(spec.factory)
    fn = entry.factory if entry is not None else resolve_factory(spec.factory, spec.code_trust)
    try:
        params = pyinspect.signature(fn).parameters
    except (TypeError, ValueError):
        return spec, {}
    values = {"cardinalities": schema.cardinalities, "num_dense": len(schema.numeric),
              "bag_cardinalities": [f.size for f in schema.multi_hot], "bag_length": schema.bag_length}
    filled = {k: values[k] for k in DATA_KWARGS if k in params and k not in spec.kwargs}
    return spec.model_copy(update={"kwargs": {**spec.kwargs, **filled}}), filled


def build_model(spec: ModelSpec) -> nn.Module:
    """Build the model a recipe describes and load its checkpoint, if any."""
    return build_model_with_new_parameters(spec)[0]


def build_model_with_new_parameters(spec: ModelSpec) -> tuple[nn.Module, list[str]]:
    """``build_model``, and the names of the parameters that neither pretrained weights nor ``model.checkpoint`` set
    (randomly initialised, e.g. a pretrained transformer's new classifier head), as a zoo builder reports them
    (``ZooEntry.build``); none for other factories."""
    entry = ZOO.get(spec.factory)
    builder = entry.build if entry is not None else None
    fn = builder or resolve_factory(spec.factory, spec.code_trust)
    takes = entry.factory if entry is not None else fn  # a zoo builder passes its kwargs on to the factory
    _bind_kwargs(spec, takes)
    try:
        made = fn(**spec.kwargs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code; sys.exit there must not end the run silently
        raise _factory_raised(spec, takes, exc) from exc
    model, new = made if builder is not None else (made, [])
    if not isinstance(model, nn.Module):
        raise InputError(
            f"model.factory {spec.factory!r} returned a {type(model).__name__}, not a torch.nn.Module",
            hint="the factory must return the model itself",
        )
    if spec.checkpoint:
        load_weights(model, read_state_dict(spec.checkpoint), spec.checkpoint)
        new = []  # a pretrained model's new head (zoo/hf.py): the checkpoint holds it
    return model, new


def _bind_kwargs(spec: ModelSpec, fn: Any) -> None:
    """``model.kwargs`` bound to the factory's signature before it runs: one it does not take is the recipe's error,
    at its line, with the name meant (``widht``: did you mean ``width``?), not a TypeError from inside."""
    import inspect as pyinspect

    try:
        signature = pyinspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension without one: the call itself tells
        return
    try:
        signature.bind(**spec.kwargs)
    except TypeError as exc:
        raise ConfigError(("model", "kwargs"), f"model.factory {spec.factory!r} rejected model.kwargs {spec.kwargs}: {exc}",
                          value=spec.kwargs, hint=_signature_hint(fn, spec.kwargs)) from exc


def _factory_raised(spec: ModelSpec, fn: Any, exc: BaseException) -> ConfigError:
    """The factory's own error (or sys.exit), at ``model.factory``'s recipe line, with where in its code it happened."""
    how = _what_failed(exc) if isinstance(exc, SystemExit) else f"raised {_what_failed(exc)}"
    frames = traceback.extract_tb(exc.__traceback__)
    code = getattr(getattr(fn, "__code__", None), "co_filename", None)
    own = [f for f in frames if f.filename == code] or frames[1:] or frames
    where = f" at {own[-1].filename}:{own[-1].lineno}" if own else ""
    fix = ("raise an exception instead of calling sys.exit" if isinstance(exc, SystemExit) else
           f"it is the factory's own error{where}, called with model.kwargs {spec.kwargs}: fix those or the factory "
           "(-v shows the traceback)")
    return ConfigError(("model", "factory"), f"model.factory {spec.factory!r} {how}", value=spec.factory, hint=fix)


def _signature_hint(fn: Any, kwargs: dict[str, Any]) -> str:
    """What the factory takes, and the name meant for each one it does not (``widht``: did you mean ``width``?)."""
    import difflib
    import inspect as pyinspect

    try:
        params = pyinspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "check the factory's signature"
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [] if takes_any else [k for k in kwargs if k not in names]
    guesses = [f"{k!r}: did you mean {c[0]!r}?" for k in unknown if (c := difflib.get_close_matches(k, names, n=1))]
    return "; ".join([*guesses, f"the factory takes: {', '.join(names) or 'no keyword arguments'}"])


def _what_failed(exc: BaseException) -> str:
    """``called sys.exit(0)`` for an exit, else ``TYPE: message``."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def input_shape_for(spec: ModelSpec, data_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    if spec.input_shape:
        return tuple(spec.input_shape)
    if spec.factory in ZOO and ZOO[spec.factory].input_shape:
        return ZOO[spec.factory].input_shape  # type: ignore[return-value]
    if data_shape:
        return tuple(data_shape)
    raise InputError(
        "the model's input shape is unknown", hint="set model.input_shape, e.g. [3, 32, 32] (no batch dimension)"
    )


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state_dict without unpickling code: safetensors, or torch.load(weights_only=True)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"model.checkpoint not found: {path}", hint="the path is relative to the recipe file")
    if path.suffix == ".safetensors":
        from .deps import require

        load_file = require("safetensors.torch", "pip install safetensors", "reading .safetensors checkpoints").load_file

        try:
            state = load_file(str(path))
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"model.checkpoint {path} is not a readable safetensors file: {exc}",
                             hint="save it again with safetensors.torch.save_file(model.state_dict(), path), or pass a "
                             "torch state_dict (.pt)") from exc
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a text file raises KeyError, a truncated zip RuntimeError, ...
            found = re.search(r"GLOBAL ([\w.]+)", str(exc)) if isinstance(exc, pickle.UnpicklingError) else None
            what = (f"it holds pickled Python objects ({found.group(1)}), which pruneflow never unpickles" if found
                    else f"{_labelled(exc)} (not a torch checkpoint, or damaged)")
            raise InputError(
                f"model.checkpoint {path} could not be read as a weights-only state_dict: {what}",
                hint="save weights with torch.save(model.state_dict(), path) or as .safetensors; "
                "pickled whole models are never loaded",
            ) from exc
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(
            f"model.checkpoint {path} holds no state_dict (a mapping of names to tensors)",
            hint="save it with torch.save(model.state_dict(), path)",
        )
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def _first_line(exc: BaseException) -> str:
    """The first line of an error message; the type name when the message is empty (EOFError on an empty file)."""
    return next(iter(str(exc).splitlines()), "") or type(exc).__name__


def _labelled(exc: BaseException) -> str:
    """``KeyError: 101``; just ``EOFError`` when the message is empty."""
    first = _first_line(exc)
    return first if first == type(exc).__name__ else f"{type(exc).__name__}: {first}"


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Load ``state`` into ``model``; name the first mismatches when keys or shapes do not fit."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in state if k in own and state[k].shape != own[k].shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    if mismatched:
        problems.append(f"{len(mismatched)} with other shapes (e.g. {'; '.join(mismatched[:3])})")
    if problems:
        raise InputError(
            f"model.checkpoint {source} does not fit the model: " + "; ".join(problems),
            hint="check model.factory and model.kwargs (depth, width, num_classes) against the checkpoint",
        )
    check_dtypes(own, state, source)  # load_state_dict would cast int32/bool into float weights silently
    check_finite_weights(state, source)
    model.load_state_dict(state, strict=False)
