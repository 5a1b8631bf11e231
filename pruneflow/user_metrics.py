"""A recipe's own metrics (``metrics:``, ``tasks/user.py``): found and checked the way a model factory is.

The function is resolved by the model factory's own resolver (``models.resolve_factory``; ``validate`` uses its static
half, ``models.check_factory_statically``, which parses the file and runs none of it), so whatever rules decide which
code a recipe may run apply to both. ``validate`` also reads the direction from the source (the
``@pruneflow.metric(higher_is_better=...)`` decorator) when the recipe does not give it; the run checks it again on the
function itself, and calls every metric once on the first batch before any stage runs::

    task = recipe_task(loaded.recipe)      # the recipe's task, judging with its metrics too
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, InputError, StageError
from .models import _split_factory, check_factory_statically, resolve_factory
from .recipe.code import module_source
from .recipe.models import MetricSpec
from .tasks import Task, UserMetric, make_task, with_user_metrics

if TYPE_CHECKING:
    import torch

    from .recipe.models import RecipeBase
    from .recipe.code import CodeTrust

DIRECTION_HINT = ("declare it: `@pruneflow.metric(higher_is_better=True)` on the function, or "
                  "`{fn: FILE.py:FUNCTION, higher_is_better: true}` in the recipe")


def recipe_task(recipe: "RecipeBase") -> Task:
    """The task ``recipe.task`` selects, with ``recipe.metrics`` resolved and added (``tasks.with_user_metrics``)."""
    return with_user_metrics(make_task(recipe.task), resolve_metrics(recipe.metrics, recipe.model.code_trust))


def resolve_metrics(specs: list[MetricSpec], trust: "CodeTrust | None" = None) -> list[UserMetric]:
    """Import each metric function (the model factory's resolver) and settle its direction; a problem is a
    ConfigError at ``metrics.N``."""
    found = []
    for index, spec in enumerate(specs):
        loc = ("metrics", index, "fn")
        fn = _located(loc, spec.fn, lambda: resolve_factory(spec.fn, trust, f"metrics.{index}.fn"))
        declared = getattr(fn, "higher_is_better", None)
        if spec.higher_is_better is not None and declared is not None and bool(declared) != spec.higher_is_better:
            raise ConfigError(("metrics", index, "higher_is_better"), f"{spec.fn} declares higher_is_better={declared}",
                              value=spec.higher_is_better, hint="the recipe and the function must agree")
        direction = spec.higher_is_better if spec.higher_is_better is not None else declared
        if direction is None:
            raise ConfigError(loc, "its direction is not declared", value=spec.fn, hint=DIRECTION_HINT)
        found.append(UserMetric(spec.figure, fn, bool(direction), spec.headline, spec.fn))
    return found


def check_metric_statically(spec: MetricSpec, trust: "CodeTrust | None" = None) -> str | None:
    """What ``validate`` checks of a metric without running it: ``file.py:function`` (or ``module:function``) that
    exists and defines the function (``models.check_factory_statically``), and a direction, in the recipe or in the
    function's decorator. Returns a note for what only the run can confirm; raises InputError."""
    if ":" not in spec.fn:
        raise InputError(f"metric {spec.fn!r} is not `path/to/file.py:function` or `package.module:function`",
                         hint="name the function that computes it")
    note = check_factory_statically(spec.fn, trust, "metric")
    if spec.higher_is_better is not None or note:
        return note
    target, name = _split_factory(spec.fn)
    source = Path(target) if target.endswith(".py") else module_source(target, spec.fn, "metric")
    if source is None or source.suffix != ".py":
        return f"metric {spec.fn!r}: its direction is read from the function when the run starts"
    declared = _declared_direction(source, name)
    if declared is False:
        raise InputError(f"metric {spec.fn!r}: its direction is not declared", hint=DIRECTION_HINT)
    return None if declared else f"metric {spec.fn!r}: its direction is read from the function when the run starts"


def _declared_direction(source: Path, name: str) -> bool | None:
    """True: ``name`` is a top-level def decorated ``@metric(higher_is_better=<bool>)`` (any module prefix); False: a def
    without it; None: bound some other way (an import, an assignment), which only the run can read."""
    tree = ast.parse(source.read_bytes(), filename=str(source))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            for deco in node.decorator_list:
                callee = deco.func if isinstance(deco, ast.Call) else None
                called = getattr(callee, "attr", None) or getattr(callee, "id", None)
                if called == "metric" and any(k.arg == "higher_is_better" and isinstance(k.value, ast.Constant)
                                              for k in getattr(deco, "keywords", [])):
                    return True
            return False
    return None


def check_metrics_on_batch(task: Task, output: "torch.Tensor", target: "torch.Tensor") -> None:
    """Each of the recipe's metrics on the first batch, before any stage: one that raises or returns no number is
    a ConfigError at its line, not a failure an hour into the run."""
    from .tasks import MetricState

    for index, metric in enumerate(getattr(task, "user_metrics", ())):
        state = MetricState()
        task.update(state, output, target)
        outputs, labels = state.kept_outputs[0].numpy(), state.kept_targets[0].numpy()
        try:
            metric.compute(outputs, labels)
        except StageError as exc:
            raise ConfigError(("metrics", index, "fn"), f"on the first batch: {exc.message}", value=metric.source,
                              hint=exc.hint) from exc


def _located(loc: tuple, fn: str, resolve):
    """``resolve()``; its InputError (the factory resolver's, worded for ``model.factory``) at ``loc`` instead."""
    try:
        return resolve()
    except InputError as exc:
        message = exc.message.removeprefix(f"model.factory {fn!r}").lstrip(": ")
        raise ConfigError(loc, message, value=fn, hint=exc.hint) from exc
