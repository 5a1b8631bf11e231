"""Registries of what varies: stages, export targets, model kinds, pruning criteria, artifact formats and runtimes,
rebuildable modules (and what the modules below add).

Built-ins and third-party plugins arrive the same way, through entry points::

    [project.entry-points."pruneflow.stages"]
    my_stage = "my_pkg.stages:MyStage"

A plugin that fails to import is an error naming it, never silently skipped.
"""

from __future__ import annotations

import contextlib
import difflib
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Generic, Iterator, TypeVar

from .errors import PluginError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, group: str, plural: str | None = None, built_in: dict[str, str] | None = None):
        """``built_in``: name -> ``module:attribute`` of the kinds pruneflow ships, found under ``group`` like any
        plugin's; listed here too so that an install made before the group existed (an editable install whose
        metadata predates it) still has them. An entry point of the same name wins."""
        self.kind = kind
        self.group = group
        self.plural = plural or f"{kind}s"
        self._items: dict[str, T] = {}
        self._entry_points: dict[str, EntryPoint] | None = None
        self._built_in = {name: EntryPoint(name, value, group) for name, value in (built_in or {}).items()}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name`` (for code that is not an installed plugin)::

            @registry.stages.register("my_stage")
            class MyStage(Stage): ...
        """

        def deco(obj: T) -> T:
            self._items[name] = obj
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Forget what ``register`` added under ``name`` (tests clean up with this); an entry point of
        that name is found again on the next ``get``."""
        self._items.pop(name, None)

    @contextlib.contextmanager
    def registered(self, name: str, obj: T) -> Iterator[T]:
        """``obj`` registered under ``name`` for the ``with`` block only."""
        self.register(name)(obj)
        try:
            yield obj
        finally:
            self.unregister(name)

    def _eps(self) -> dict[str, EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {**self._built_in, **{ep.name: _moved(ep) for ep in entry_points(group=self.group)}}
        return self._entry_points

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._eps()))

    def get(self, name: str) -> T:
        if name in self._items:
            return self._items[name]
        ep = self._eps().get(name)
        if ep is None:
            known = self.names()
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; {hint}known {self.plural}: {', '.join(known) or '(none)'}",
                hint=f"use one of the known names, or install the plugin that provides {name!r}",
            )
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - re-raised with the plugin named
            raise PluginError(
                f"the {self.kind} plugin {name!r} ({ep.value}) failed to import: {exc}",
                hint="reinstall the package that provides it, or remove it",
            ) from exc
        self._items[name] = obj
        return obj

    def all(self) -> dict[str, T]:
        return {name: self.get(name) for name in self.names()}


#: The built-in plugins that an install of pruneflow made before they moved under its namespace (issue 42) names at the
#: top level (``qat.stage:QatStage``): until it is reinstalled, its entry points are read as ``pruneflow.qat...``.
MOVED_PLUGINS = tuple(f"{top}." for top in "qat calibrate".split())


def _moved(ep: EntryPoint) -> EntryPoint:
    dist = getattr(ep, "dist", None)
    if ep.value.startswith(MOVED_PLUGINS) and dist is not None and dist.name == "pruneflow":
        return EntryPoint(ep.name, f"pruneflow.{ep.value}", ep.group)
    return ep


stages: Registry = Registry("stage type", "pruneflow.stages")
targets: Registry = Registry("export target", "pruneflow.targets")
#: Tasks (pruneflow/tasks.py): what a model's output means, its loss, metrics and parity.
tasks: Registry = Registry("task", "pruneflow.tasks")
#: Kinds of model handle (pruneflow/handle.py): how a model is checkpointed, restored and exported.
model_kinds: Registry = Registry("model kind", "pruneflow.model_kinds")
#: Pruning criteria (pruneflow/prune/criteria.py): how important a channel, head or FFN neuron is.
criteria: Registry = Registry("pruning criterion", "pruneflow.criteria", plural="pruning criteria")
#: Artifact formats (pruneflow/formats/): a file's suffixes, its deployment record, input spec, runtimes and INT8 forms.
formats: Registry = Registry("artifact format", "pruneflow.formats", built_in={
    "onnx": "pruneflow.formats.onnx:OnnxFormat", "openvino": "pruneflow.formats.openvino:IrFormat",
    "tensorrt": "pruneflow.formats.tensorrt:EngineFormat", "ascend": "pruneflow.formats.ascend:OmFormat"})
#: Runtimes that load artifacts (pruneflow/formats/runtimes.py): their devices, precision hints and loaders.
runtimes: Registry = Registry("runtime", "pruneflow.runtimes", built_in={
    "onnxruntime": "pruneflow.formats.runtimes:OnnxRuntime", "openvino": "pruneflow.formats.runtimes:OpenVinoRuntime",
    "tensorrt": "pruneflow.formats.runtimes:TensorRtRuntime"})
#: Module classes a checkpoint may rebuild where the recipe's model has another (pruneflow/checkpoint.py):
#: class name -> a zero-argument callable making a blank one (its sizes come from the checkpoint).
rebuildable_modules: Registry = Registry("rebuildable module", "pruneflow.rebuildable_modules")
