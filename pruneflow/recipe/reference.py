"""Generate docs/recipe-reference.md from the recipe models, so the reference cannot drift.

    python -m pruneflow.recipe.reference > docs/recipe-reference.md

A test compares the committed file with this output.
"""

from __future__ import annotations

import inspect
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .. import registry
from ..stage import TargetConfig
from .models import RecipeBase, stage_config_model


def _type_name(ann) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:  # a validated scalar (`deploy.cpu`'s names) reads as its type
        return _type_name(typing.get_args(ann)[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", "`") for a in typing.get_args(ann))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return " \\| ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is list:
        return f"list[{_type_name(typing.get_args(ann)[0])}]"
    if origin is dict:
        return "mapping"
    if ann is type(None):
        return "null"
    if isinstance(ann, type):
        return ann.__name__ if not issubclass(ann, BaseModel) else f"[{ann.__name__}](#{ann.__name__.lower()})"
    return str(ann).replace("typing.", "")


def _default(info) -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        value = info.default_factory()
        return "(see below)" if isinstance(value, BaseModel) else f"`{value!r}`"
    return "" if info.default is PydanticUndefined else f"`{info.default!r}`"


def _table(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        desc = (info.description or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{name}` | {_type_name(info.annotation)} | {_default(info)} | {desc} |")
    return lines


def _nested(model: type[BaseModel], seen: set) -> list[type[BaseModel]]:
    out = []
    for info in model.model_fields.values():
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            stack.extend(typing.get_args(ann))
            if isinstance(ann, type) and issubclass(ann, BaseModel) and ann not in seen:
                seen.add(ann)
                out.append(ann)
                out.extend(_nested(ann, seen))
    return out


def _variants(config) -> list[type[BaseModel]]:
    """The config models of a stage: the members of a union (Annotated and Tag peeled), or the one model."""
    while typing.get_origin(config) is typing.Annotated:
        config = typing.get_args(config)[0]
    if typing.get_origin(config) in (typing.Union, getattr(__import__("types"), "UnionType")):
        return [m for a in typing.get_args(config) for m in _variants(a)]
    return [config]


def render() -> str:
    seen: set = set()
    out = [
        "# Recipe reference",
        "",
        "Generated from the recipe models by `python -m pruneflow.recipe.reference` (a test keeps it current).",
        "`pruneflow schema` prints the same as JSON schema for editors. Paths are relative to the recipe file",
        "that sets them (`--set` values: relative to the working directory).",
        "",
        "## Top level",
        "",
        *_table(RecipeBase),
        "| `stages` | list of stages | **required** | Stages run in order on one model (see below). |",
        "",
    ]
    for model in _nested(RecipeBase, seen):
        out += [f"### {model.__name__}", "", *_table(model), ""]
    out += ["## Stages", "", "Every stage also takes `name` (its id in metrics, gates and folders).", ""]
    for name in registry.stages.names():
        variants = _variants(stage_config_model(registry.stages.get(name)))
        out += [f"### `type: {name}`", "", (variants[0].model_fields["type"].description or ""), ""]
        if len(variants) == 1:
            out += [*_table(variants[0], ("type", "name")), ""]
        for model in variants if len(variants) > 1 else ():
            # A stage whose config is a union (prune: one variant per granularity): each with its own keys.
            out += [f"#### {model.__name__}", "", inspect.cleandoc(model.__doc__ or ""), "", *_table(model, ("type", "name")), ""]
        for sub in [sub for model in variants for sub in _nested(model, seen)]:
            if not issubclass(sub, TargetConfig):  # targets get their own section
                out += [f"#### {sub.__name__}", "", *_table(sub), ""]
    out += ["## Tasks", "", "Selected by the recipe's `task`: a name (`task: classification`) or a mapping with options "
            "(`task: {type: NAME, output: logits}`). A task sets the loss, the metrics and their direction (which way a "
            "gate's `max_drop` counts), the label checks, what parity between torch and an artifact means, and distillation.", ""]
    for name in registry.tasks.names():
        task = registry.tasks.get(name)
        model = task.Config
        metrics = ", ".join(f"`{m.name}` ({'higher' if m.higher_is_better else 'lower'} is better)" for m in task.metrics)
        out += [f"### `{name}`", "", (model.model_fields["type"].description or ""), "",
                f"Metrics: {metrics}; headline: `{task.headline_name}`. Parity: `{task.agreement.name}` "
                f"({'higher' if task.agreement.higher_is_better else 'lower'} is better).", "",
                *_table(model, ("type",)), ""]
    out += ["## Export targets", "", "Written in an export stage's `targets` list as a name or a mapping with options.", ""]
    for name in registry.targets.names():
        model = registry.targets.get(name).Config
        out += [f"### `{name}`", "", (model.model_fields["type"].description or ""), "", *_table(model, ("type",)), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
