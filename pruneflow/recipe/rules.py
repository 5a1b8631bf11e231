"""Rules that need only the recipe: run by ``load_recipe`` right after pydantic validation.

Pydantic checks each field and each stage on its own; the rules here look across the recipe (two
stages with one name, an int8 export with no quantizing stage before it, a gate naming a stage that
does not exist). They run in milliseconds, so `pruneflow validate` and ``--dry-run`` catch what
would otherwise fail a run after the data and model load. Each problem is a ``ConfigError`` at its
key path; the loader turns them all, at once, into one ``RecipeError`` with FILE:LINE per problem.

A stage contributes its own rules through ``Stage.recipe_rules`` (see ``pruneflow/stage.py``)::

    @classmethod
    def recipe_rules(cls, config, index, recipe):
        if config.split == "train" and not has_train_split(recipe.data):
            yield ConfigError(("stages", index, "split"), "the recipe's data has no train split")
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Iterator, Sequence

from .. import registry
from ..errors import ConfigError, key_path

if TYPE_CHECKING:
    from ..stage import StageConfig
    from .models import DataSpec, RecipeBase


def recipe_problems(recipe: RecipeBase) -> list[ConfigError]:
    """Every problem the recipe alone shows: the recipe-wide rules, then each stage's own, in order."""
    problems = [*_duplicate_names(recipe.stages), *_gate_metrics(recipe), *_user_metrics(recipe)]
    for index, config in enumerate(recipe.stages):
        problems += registry.stages.get(config.type).recipe_rules(config, index, recipe)
    return problems


def stage_ids(stages: Sequence[StageConfig]) -> list[str]:
    """Each stage's id: its `name`, else its type, numbered when the type repeats (``evaluate-2``).

    One function for the pipeline (folders, metric names) and the rules (duplicate names, gate
    metrics), so a gate is checked against exactly the names the run will use.
    """
    ids: list[str] = []
    seen: dict[str, int] = {}
    for config in stages:
        if config.name:
            ids.append(config.name)
            continue
        seen[config.type] = seen.get(config.type, 0) + 1
        ids.append(config.type if seen[config.type] == 1 else f"{config.type}-{seen[config.type]}")
    return ids


def has_train_split(data: DataSpec) -> bool:
    """True when the data gives a training split: the built-in and generated sets and `path` are split, else `train`
    must be set (what ``pruneflow.data.load_data`` does; an `eval`-only recipe has no train split)."""
    return data.format in ("digits", "clicklog", "seqlog") or bool(data.path) or bool(data.train)


def quantized_before(recipe: RecipeBase, index: int) -> bool:
    """True when a stage before ``index`` leaves an INT8-quantized model (what an int8 export writes)."""
    return any(registry.stages.get(c.type).quantizes(c) for c in recipe.stages[:index])


def _duplicate_names(stages: Sequence[StageConfig]) -> Iterator[ConfigError]:
    """A stage id names the stage's folder and its metrics: two stages with one id would overwrite each other."""
    first: dict[str, int] = {}
    for index, stage_id in enumerate(stage_ids(stages)):
        if stage_id in first:
            yield ConfigError(("stages", index, "name"),
                              f"{stage_id!r} is used by two stages ({key_path(('stages', first[stage_id]))} and this one)",
                              hint="give each stage its own `name`")
        first.setdefault(stage_id, index)


def _gate_metrics(recipe: RecipeBase) -> Iterator[ConfigError]:
    """A gate's metric (and baseline) must start with a stage id or a target of the `export` stage, and name a metric
    that stage records: a typo there would otherwise surface only after the whole run, as a failed gate (exit 1)."""
    prefixes = _metric_prefixes(recipe)
    for index, gate in enumerate(recipe.gates):
        for key in ("metric", "baseline"):
            name = getattr(gate, key)
            if name is None:
                continue
            prefix = max((p for p in prefixes if name.startswith(f"{p}.") and len(name) > len(p) + 1), key=len, default=None)
            if prefix is None:
                close = difflib.get_close_matches(name.split(".")[0], prefixes, n=1)
                did = f"; did you mean {close[0]!r}?" if close else ""
                yield ConfigError(("gates", index, key), f"names no stage or export target of this recipe{did}", value=name,
                                  hint=f"write STAGE.METRIC or TARGET.PRECISION.METRIC; stages and targets: {', '.join(prefixes)}")
                continue
            problem = _unknown_metric(recipe, prefix, name[len(prefix) + 1:])
            if problem:
                yield ConfigError(("gates", index, key), problem[0], value=name, hint=problem[1])


#: Words the built-in stages and targets name their figures with (``macs_reduction``, ``latency_b32_speedup``,
#: ``size_ratio_fp32``, ...), beside the task's metrics: a gate word close to one of these but not one is a typo.
_STAGE_WORDS = frozenset((
    "macs params latency speedup size ratio reduction before after median ms runtime inference precision slower "
    "than form hint fused ops smooth quant inputs channels fitted weights batchnorms folded ort integer float "
    "matmuls onnx count fingerprint train epochs samples eval parity agreement rounds importance seconds fallback "
    "chosen loses threads sequence emulated drop heads kept pruned sparsity top1 f32 fp32 fp16 int8 bf16 max abs diff "
    "probability cosine block blocks removed columns ffn neurons rows never read table bytes shortcuts rewritten units "
    "width loss increase kept layers cost snr db sensitivity groups duplicates most sensitive metric quantizers "
    "tokens features histogram").split())


def _unknown_metric(recipe: RecipeBase, prefix: str, metric: str) -> tuple[str, str] | None:
    """(message, fix) when ``metric`` (after its stage's or target's prefix) is not one that stage records: checked
    exactly against a stage class that lists its metrics (``Stage.gate_metrics``), else for a near miss of the
    task's metrics and the stages' words (``accuracyy``, ``mcas_reduction``); None when it may be produced."""
    from ..tasks import COMMON_METRICS, make_task
    from ..tasks.user import UserMetric, with_user_metrics

    # the recipe's own metrics by name and headline only (validate imports none of their code): what stages record
    named = [UserMetric(spec.figure, lambda outputs, labels: 0.0, spec.higher_is_better is not False, spec.headline)
             for spec in recipe.metrics]
    task = with_user_metrics(make_task(recipe.task), named)
    ids = stage_ids(recipe.stages)
    if prefix not in ids and "export" in ids:  # TARGET.PRECISION[_FORM].METRIC
        index = ids.index("export")
        written = recipe.stages[index].gate_precisions(prefix, quantized_before(recipe, index))
        precision = metric.partition(".")[0].partition("_")[0]
        if written is not None and precision not in written:
            close = difflib.get_close_matches(precision, written, n=1)
            return (f"target {prefix!r} writes no {precision} artifact in this recipe{f'; did you mean {close[0]!r}?' if close else ''}",
                    f"write {prefix}.PRECISION.METRIC with a precision it writes here: {', '.join(written)}")
    if prefix in ids:
        config = recipe.stages[ids.index(prefix)]
        known = registry.stages.get(config.type).gate_metrics(config, task)
        if known is not None:
            if metric in known:
                return None
            close = difflib.get_close_matches(metric, known, n=1)
            return (f"stage {prefix!r} records no metric {metric!r}{f'; did you mean {close[0]!r}?' if close else ''}",
                    f"the {config.type} stage records: {', '.join(known)}")
    names = list(dict.fromkeys([m.name for m in task.metrics] + list(task.figures) + [task.agreement.name, *COMMON_METRICS]))
    words = {w for n in names for w in n.replace(".", "_").replace("@", "_").split("_") if w} | _STAGE_WORDS
    first = metric.rpartition(".")[2].replace("@", "_").split("_")[0]
    if metric.split(".")[0] in ("fp32", "fp16", "int8", "bf16"):
        first = metric.split(".", 1)[1].rpartition(".")[2].replace("@", "_").split("_")[0] if "." in metric else ""
    close = difflib.get_close_matches(first, sorted(words), n=1, cutoff=0.75)
    if not first or first in words or not close:
        return None
    return (f"{first!r} looks like a misspelt metric: it is none of the words this recipe's task and stages "
            f"name their figures with; did you mean {close[0]!r}?",
            f"the task's metrics: {', '.join(names[:12])}; `pruneflow optimize --json` lists every figure a run records")


def _user_metrics(recipe: RecipeBase) -> Iterator[ConfigError]:
    """The recipe's own metrics (``tasks/user.py``) each have a name of their own, none the task's or a common figure's
    (it would shadow it in every table and gate), and one at most is the headline."""
    from ..tasks.base import COMMON_METRICS

    task = registry.tasks.get(recipe.task.type)(recipe.task)
    taken = {m.name for m in task.metrics} | set(COMMON_METRICS) | {task.agreement.name, "samples"}
    seen: dict[str, int] = {}
    for index, spec in enumerate(recipe.metrics):
        name = spec.figure
        if name in taken:
            yield ConfigError(("metrics", index), f"{name!r} is a figure the {task.name} task already records",
                              value=spec.fn, hint="give it another `name`: `{fn: ..., name: my_" + name + "}`")
        elif name in seen:
            yield ConfigError(("metrics", index), f"{name!r} is the name of metrics.{seen[name]} too", value=spec.fn,
                              hint="give one of them another `name`")
        seen.setdefault(name, index)
    headlines = [i for i, spec in enumerate(recipe.metrics) if spec.headline]
    for index in headlines[1:]:
        yield ConfigError(("metrics", index, "headline"), f"metrics.{headlines[0]} is the headline already",
                          value=True, hint="mark one metric `headline: true`")


def _metric_prefixes(recipe: RecipeBase) -> list[str]:
    """What a gate's metric may start with (``pruneflow.pipeline.flat_metrics``): a stage id, or, for
    the stage with id ``export``, one of its targets (``onnx.fp32.<metric>``)."""
    ids = stage_ids(recipe.stages)
    prefixes = list(ids)
    if "export" in ids:
        prefixes += recipe.stages[ids.index("export")].metric_prefixes()
    return list(dict.fromkeys(prefixes))
