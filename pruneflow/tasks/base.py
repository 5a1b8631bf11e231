"""Tasks: what a model's output means and how it is judged.

A task is a registered kind (``registry.tasks``, entry point group ``pruneflow.tasks``), like a stage or
an export target. It owns everything that depends on what the model does:

- ``output(out)``: which part of the model's output it reads (a tensor, a tuple, a dict, an HF-style output);
- ``loss`` for training and ``distill_loss`` between a student's and a teacher's outputs;
- ``metrics``: each a ``Metric`` with a name and a direction (higher or lower is better); ``headline`` is
  the one tables, logs and default gates show; ``update``/``compute`` measure them over batches;
- ``read_targets`` (labels as the data gives them) and ``check_targets``/``check_output`` (labels against
  the model's output, before any training); a task whose targets are the given model's own outputs (an
  embedding model's vectors: ``targets_from_model``) gets them once, before any stage, through
  ``reference_targets``;
- ``agree(ref, got)``: what parity means between two executors' outputs, with ``agreement`` its figure
  and ``agreement_limits`` its default limit per precision.

Everything that judges a model (training's log line, evaluate, prune's rounds, the qat phases, export parity,
gates, report.md, bench) reads the task, so a new task is one file and a registration::

    class Regression(Task):
        Config = RegressionConfig                      # type: Literal["regression"], options
        metrics = (Metric("mse", higher_is_better=False, perfect=0.0), Metric("mae", higher_is_better=False))
        ...

    [project.entry-points."pruneflow.tasks"]
    regression = "my_pkg.tasks:Regression"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import registry
from ..config import TaskConfig
from ..errors import ConfigError, InputError


@dataclass(frozen=True)
class Metric:
    """A figure a task measures: its name, its direction, and its perfect value where it has one."""

    name: str
    higher_is_better: bool = True
    #: The best value it can take (1.0 for a share of agreeing predictions, 0.0 for an error); None: unbounded.
    perfect: float | None = None
    description: str = ""
    #: How messages and tables name it (default: the name with spaces).
    label: str = ""

    @property
    def shown(self) -> str:
        return self.label or self.name.replace("_", " ")

    @property
    def direction(self) -> str:
        return "higher is better" if self.higher_is_better else "lower is better"

    def worsening(self, base: float, value: float) -> float:
        """How much worse ``value`` is than ``base`` in this metric's direction (negative: better)."""
        return base - value if self.higher_is_better else value - base

    def at_least_as_good(self, value: float, bound: float) -> bool:
        """``value`` meets ``bound`` (a minimum for higher-is-better figures, a maximum otherwise)."""
        return value >= bound if self.higher_is_better else value <= bound

    def looser(self, a: float, b: float) -> float:
        """The looser of two limits on this figure."""
        return min(a, b) if self.higher_is_better else max(a, b)

    def compounded(self, a: float, b: float) -> float:
        """The limit of two approximations applied together: their shortfalls from ``perfect`` add."""
        perfect = 0.0 if self.perfect is None else self.perfect
        return round(a + b - perfect, 10)

    def bound_word(self) -> str:
        return "min" if self.higher_is_better else "max"

    def format(self, value: float) -> str:
        """A share (perfect at 1) as a percentage, anything else with four significant digits."""
        return f"{value:.2%}" if self.perfect == 1.0 else f"{value:.4g}"


#: Figures that are not a task's, by name: their direction is the same for every task.
COMMON_METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("loss", higher_is_better=False),
    Metric("max_abs_diff", higher_is_better=False, perfect=0.0),
    Metric("cosine", perfect=1.0),
    Metric("size_mb", higher_is_better=False),
    Metric("latency", higher_is_better=False),
    Metric("drop", higher_is_better=False),
)}


@dataclass
class MetricState:
    """What ``Task.update`` accumulates over batches: sums (which add across DDP ranks) and, for metrics that
    need every sample at once (an AUC), the outputs and targets themselves."""

    sums: dict[str, float] = field(default_factory=dict)
    count: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    #: A multi-head task's state per head (``tasks.multi``).
    parts: dict[str, "MetricState"] = field(default_factory=dict)
    #: Every output and label seen, for the recipe's own metrics (``tasks.user``), which read the whole split.
    kept_outputs: list[torch.Tensor] = field(default_factory=list)
    kept_targets: list[torch.Tensor] = field(default_factory=list)

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)


class Task:
    """Base of every task (see the module docstring); a subclass sets the class attributes and the methods
    marked so."""

    Config: ClassVar[type[TaskConfig]] = TaskConfig
    #: Every metric ``compute`` returns (besides ``samples``), the headline among them.
    metrics: ClassVar[tuple[Metric, ...]] = ()
    headline_name: ClassVar[str] = ""
    #: The figure of ``agree`` that parity is judged by, and its default limit per precision (``bf16``: what a
    #: runtime computing in bf16 holds to; OpenVINO's CPU default where the CPU has it).
    agreement: ClassVar[Metric] = Metric("cosine", perfect=1.0)
    agreement_limits: ClassVar[Mapping[str, float]] = {"fp32": 0.9999, "fp16": 0.999, "int8": 0.99, "bf16": 0.999}
    #: Labels can be stratified by (class ids); a continuous target cannot.
    stratify: ClassVar[bool] = False
    #: The output's name in every artifact when ``output`` names no part of it (a model returning a tensor).
    default_output_name: ClassVar[str] = "logits"
    #: Figures ``compute`` returns beside the metrics, with no better direction, that each artifact reports too
    #: (binary: the mean predicted CTR, which a quantized ranker can move while its AUC holds).
    figures: ClassVar[tuple[str, ...]] = ()
    #: The targets are the outputs of the model the recipe gives (its reference), computed once over every split
    #: before any stage changes the model (``prepare.load_inputs``), not the data's labels: what an embedding model
    #: is judged against is the vectors it gave before it was pruned and quantized, and no label column holds them.
    targets_from_model: ClassVar[bool] = False
    def ranges(self) -> str:
        """How INT8 activation ranges are set from the calibration set under `ranges: auto` (qat/settings.py):
        ``mean_minmax`` (NNCF's default: a finer grid, rare tails clipped), or ``minmax`` where an output is a value
        whose tails count as much as its middle (regression: a clipped input or hidden activation moves that
        sample's prediction by the clipped amount)."""
        return "mean_minmax"

    def __init__(self, config: TaskConfig | None = None):
        self.config = config if config is not None else self.Config.model_validate({})

    @property
    def name(self) -> str:
        return self.config.type

    @property
    def headline(self) -> Metric:
        return self.metric(self.headline_name)

    @property
    def headline_names(self) -> list[str]:
        """Every figure a stage records as this task's headline: the headline, and for a multi-head task each head's
        (a stage's metrics judge every head it serves, not the first one alone)."""
        return [self.headline_name]

    @property
    def recorded_names(self) -> list[str]:
        """What train, prune, ptq and qat record of the eval split: the headline figures (``headline_names``); with
        metrics of the recipe's own (``tasks/user.py``), those too, and the task's own headline when one of them took
        its place (a gate counting from ``train.accuracy`` or ``train.f1_score`` finds it)."""
        return self.headline_names

    def metric(self, name: str) -> Metric:
        """The metric a figure's name stands for: one of this task's, a common one (loss, cosine, latency...),
        or, for a derived name (``accuracy_fp32``, ``onnx.int8.mse_f32``, ``qat.accuracy_drop``), the metric
        it is derived from. Unknown figures count as higher-is-better (a MACs reduction, a speed-up)."""
        leaf = name.rpartition(".")[2]
        if leaf.endswith("_drop"):  # a worsening, whatever it is of
            return COMMON_METRICS["drop"]
        known = {m.name: m for m in (*COMMON_METRICS.values(), *self.metrics, self.agreement)}
        for candidate in sorted(known, key=len, reverse=True):
            if leaf == candidate or leaf.startswith(candidate + "_"):
                return known[candidate]
        return Metric(leaf)

    # ---------------------------------------------------------------- reading outputs

    @property
    def output_name(self) -> str:
        """The name every artifact gives the output: the part the task reads (``output: logits``), else the
        task's own (binary ``logit``, regression ``prediction``; classification ``logits``)."""
        part = self.config.output
        return part if isinstance(part, str) and part.isidentifier() else self.default_output_name

    @property
    def output_names(self) -> list[str]:
        """Every output an artifact has, in order (several for a multi-head task, whose runtime outputs are read back
        concatenated in this order)."""
        return [self.output_name]

    def export_output(self, out: Any) -> Any:
        """What an exported artifact outputs of the model's output ``out``: the part the task reads (a multi-head task:
        one tensor a head, each its own named output)."""
        return self.output(out)

    def output(self, out: Any) -> torch.Tensor:
        """The tensor this task reads from a model's output: ``config.output`` names it (a key or attribute,
        or a tuple index); by default the output itself, its ``logits``, or its first element."""
        key = self.config.output
        if isinstance(out, torch.Tensor):  # already the part read (an artifact's output, a ReadOutput's)
            return out
        try:
            if key is None:
                return _default_output(out)
            if isinstance(key, int):
                return _tensor(out[key])
            return _tensor(out[key] if isinstance(out, Mapping) else getattr(out, key))
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            what = f"a model output of type {type(out).__name__}" + (f" with keys {', '.join(map(str, out))}"
                                                                     if isinstance(out, Mapping) else "")
            message = f"cannot read {'a tensor' if key is None else repr(key)} from {what} ({exc})"
            hint = "set task.output to the key, attribute or tuple index of the tensor the task reads"
            if key is None:
                raise InputError(f"task.output: {message}", hint=hint) from exc
            raise ConfigError(("task", "output"), message, value=key, hint=hint) from exc

    # ---------------------------------------------------------------- training

    def loss(self, out: Any, target: torch.Tensor) -> torch.Tensor:  # pragma: no cover - each task's own
        raise NotImplementedError

    def importance_loss(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        """The loss whose gradients (Taylor, Hessian) or measured increase (blocks) rank what pruning removes.
        Default: ``loss``. A task whose targets are the model's own outputs overrides it: there the loss of the
        unpruned model is at its minimum, every gradient is zero and every unit would score alike."""
        return self.loss(out, target)

    def distill_loss(self, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        """The KD term between a student's and a teacher's outputs (``output`` of each). Default: mean squared
        difference; a task with class scores matches softened distributions instead."""
        return F.mse_loss(student.float(), teacher.float())

    def for_training(self, label_smoothing: float) -> "Task":
        """The task to train with under a training run's settings (classification applies label smoothing)."""
        return self

    # ---------------------------------------------------------------- metrics

    def update(self, state: MetricState, output: torch.Tensor, target: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError

    def compute(self, state: MetricState) -> dict[str, float]:  # pragma: no cover
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        """What a run records of its task (manifest.json, metrics.json, ``--json``): its type, its headline, each
        metric's direction, its agreement figure; what ``bench`` and the report read to judge without the task."""
        return {"type": self.name, "headline": self.headline_name,
                "metrics": {m.name: "higher" if m.higher_is_better else "lower" for m in self.metrics},
                "agreement": self.agreement.name, "agreement_label": self.agreement.shown}

    def data_summary(self, data: Any) -> str:
        """A few words on the labels, for the report's data line (classification: the class count)."""
        return ""

    def describe(self, figures: Mapping[str, Any]) -> str:
        """``name value`` of the headline, for log lines and progress (``figures``: what ``compute`` returned)."""
        value = figures.get(self.headline_name)
        return f"{self.headline_name} {value:.4f}" if isinstance(value, (int, float)) else f"{self.headline_name} –"

    # ---------------------------------------------------------------- labels

    def read_targets(self, values: Any, column: Any) -> np.ndarray:  # pragma: no cover
        """The data's label column as this task trains on it (checked; e.g. int64 class ids, float32 values)."""
        raise NotImplementedError

    def check_targets(self, targets: Mapping[str, torch.Tensor], data: Any, column: Any) -> None:
        """Every split's labels make sense for this task (``targets``: split name → labels; ``data``: the
        ``DataBundle``); raises ``InputError``. Default: every split holds samples."""
        for role, y in targets.items():
            if not len(y):
                raise InputError(f"data: the {role} split holds 0 samples",
                                 hint="use more data, or a smaller or larger data.eval_fraction")

    def check_output(self, output: torch.Tensor, targets: torch.Tensor, data: Any, factory: str) -> None:
        """The model's output (``output`` of one real batch) fits the labels; raises ``InputError``."""

    def reference_targets(self, outputs: torch.Tensor, role: str, factory: str) -> torch.Tensor:
        """A split's targets made from the reference model's outputs on it (``output`` of every row, in the split's
        order), for a task with ``targets_from_model``; raises ``InputError`` where nothing could be judged against
        them (``role``: the split, ``factory``: the model, for the message)."""
        return outputs

    # ---------------------------------------------------------------- agreement between executors

    def agree(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        """How far ``got`` (an artifact's outputs) agrees with ``ref`` (torch's) on the same samples: the largest
        difference, the cosine and this task's ``agreement`` figure."""
        a, b = output_rows(ref, got)
        return {**closeness(a, b), "parity_samples": int(len(a))}


# ---------------------------------------------------------------------------- helpers


def make_task(spec: "TaskConfig | Mapping[str, Any] | str | None") -> Task:
    """The task a recipe's ``task`` section selects: its validated config, its mapping (a resolved recipe read
    back as YAML), or a bare name taking the task's defaults; None is classification."""
    if isinstance(spec, TaskConfig):
        return registry.tasks.get(spec.type)(spec)
    mapping = {"type": spec or "classification"} if spec is None or isinstance(spec, str) else dict(spec)
    cls = registry.tasks.get(str(mapping.get("type")))
    return cls(cls.Config.model_validate(mapping))


def _tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"it is a {type(value).__name__}, not a tensor")
    return value


def _default_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if "logits" in out:
            return _tensor(out["logits"])
        if len(out) == 1:
            return _tensor(next(iter(out.values())))
        raise KeyError(f"a dict with keys {', '.join(map(str, out))} and no 'logits'")
    if hasattr(out, "logits"):
        return _tensor(out.logits)
    if isinstance(out, Sequence) and len(out):
        return _tensor(out[0])
    raise TypeError(f"cannot read a tensor from a model output of type {type(out).__name__}")


class ReadOutput(nn.Module):
    """``model`` returning only what ``task`` reads of its output: what an export traces when the model returns
    a tuple, a dict or an HF-style output, so every artifact has one output, the task's. ``forward`` takes what
    the model's forward takes (``inputs.forward_names`` reads the model's own signature through ``reads``)."""

    def __init__(self, model: nn.Module, task: "Task"):
        super().__init__()
        self.reads = model
        self.task = task

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.task.export_output(self.reads(*args, **kwargs))


def output_rows(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two executors' outputs as (samples, values) float64 arrays; outputs of different shapes are an ExportError."""
    from ..errors import ExportError

    if ref.shape != got.shape:
        raise ExportError(f"the artifact's output shape {got.shape} differs from torch's {ref.shape}")
    return ref.reshape(len(ref), -1).astype(np.float64), got.reshape(len(got), -1).astype(np.float64)


def closeness(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Max abs diff and cosine similarity of two (samples, values) arrays.

    Cosine is the mean per-sample cosine, except for outputs of one or two values per sample (a binary
    classifier, a regressor): there a sample's cosine is +-1 by the signs alone, so a near-tie flipped by
    rounding counts -1 and the cosine of the whole arrays is taken instead."""
    if a.shape[1] <= 2:
        cosine = float((a * b).sum() / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
    else:
        cosine = float(((a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)).mean())
    return {"max_abs_diff": float(np.abs(a - b).max()) if a.size else 0.0, "cosine": cosine}
