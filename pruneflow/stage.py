"""The small types every stage and export target builds on.

A stage is a class with a pydantic ``Config`` and ``run(state, ctx)``; a target likewise with
``build(state, ctx, out_dir)``. Both are registered by entry point (see ``registry.py``)::

    class MyConfig(StageConfig):
        type: Literal["my_stage"] = "my_stage"
        strength: float = Field(0.5, description="How hard to squeeze.")

    class MyStage(Stage[MyConfig]):
        Config = MyConfig

        def run(self, state: RunState, ctx: RunContext) -> StageResult:
            ...  # self.config is a MyConfig
            return StageResult(metrics={"squeezed": 0.98})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Iterable, Iterator, TypeVar

# The config bases live in the kernel module config.py (so recipe/models.py need not import this one);
# re-exported here because stages and plugins import them beside Stage.
from .config import StageConfig as StageConfig, StrictModel as StrictModel, TargetConfig as TargetConfig

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from .artifacts import Artifact
    from .context import RunContext, RunState
    from .errors import ConfigError
    from .handle import ModelHandle
    from .inputs import Inputs
    from .recipe.models import RecipeBase


C = TypeVar("C", bound=StageConfig)
T = TypeVar("T", bound=TargetConfig)


#: What `pruneflow doctor` expects of a step: it will work, it will be skipped here (a toolchain is absent,
#: a bundle is prepared instead), or it will fail.
CHECK_STATUSES = ("ok", "will skip", "will fail")


@dataclass
class Check:
    """One line of `pruneflow doctor`: what was tried on the loaded model and one batch, and what the run will do.

        Check("NNCF quantization", "will fail", why="module 'gate' (Sigmoid) does not trace",
              fix="ignore: ['gate']")
    """

    check: str
    status: str  # one of CHECK_STATUSES
    why: str = ""
    fix: str = ""
    #: What was measured, for --json (e.g. ``{"macs_before": ..., "macs_after": ...}``).
    figures: dict[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in CHECK_STATUSES:
            raise ValueError(f"check {self.check!r}: status {self.status!r} is not one of {', '.join(CHECK_STATUSES)}")

    @classmethod
    def failed(cls, check: str, exc: BaseException, fix: str = "") -> "Check":
        """A ``will fail`` row from an exception: our message and hint, or the type and first line of another's."""
        from .errors import PruneflowError

        if isinstance(exc, PruneflowError):
            return cls(check, "will fail", exc.message, exc.hint or fix)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return cls(check, "will fail", f"{type(exc).__name__}: {first}", fix)


@dataclass
class GateResult:
    """One quality gate's verdict (a recipe gate, or a check a stage made itself); a failed one makes exit code 1."""

    name: str
    passed: bool
    message: str
    value: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StageResult:
    metrics: dict[str, float | int | str] = field(default_factory=dict)
    artifacts: list["Artifact"] = field(default_factory=list)
    # Free-form tables (list of row dicts) that the report renders, e.g. per-round pruning figures.
    tables: dict[str, list[dict]] = field(default_factory=dict)
    # Checks the stage made itself (e.g. export parity); a failed one makes the exit code 1.
    gates: list["GateResult"] = field(default_factory=list)
    #: The model leaving the stage when it is a new one (e.g. quantized); None: the entering handle,
    #: possibly changed in place (training, pruning).
    handle: "ModelHandle | None" = None


class Stage(Generic[C]):
    """Base class of stages, generic over its config: ``class MyStage(Stage[MyConfig])`` types
    ``self.config``. Subclasses set ``Config`` (the pydantic class the recipe validates) and implement ``run``."""

    Config: ClassVar[type[StageConfig]] = StageConfig

    # Capabilities: what the core asks of a stage, declared by its class (never a list of type names in the core).
    #: True when the stage changes the model's weights or structure (training, pruning, quantizing): the pipeline
    #: then checkpoints the model it leaves (structure included, so a reshaped model reloads).
    modifies_model: ClassVar[bool] = False
    #: True when the stage makes the model smaller or cheaper (pruning, quantization): the model entering the first
    #: such stage is the one the run started from, which report.md's headline compares the result with.
    compresses: ClassVar[bool] = False
    #: True when the stage trains under DistributedDataParallel with ``--nproc``: the ranks other than 0 run the
    #: recipe up to the last such stage (``distributed.py``).
    runs_under_ddp: ClassVar[bool] = False
    #: True when what the stage builds depends on the recipe's ``deploy`` (the CPUs it is served on) and is chosen by
    #: timing on this host (export): the pipeline adds both to its resume key (``resume.serving_part``, ``host_part``).
    serves_hosts: ClassVar[bool] = False
    #: True when the stage chooses by measuring and says what it chose in ``choices`` (export): the pipeline keeps
    #: that in manifest.json and, under ``--resume`` with the stage's key unchanged, hands it back as
    #: ``recorded_choices``, so a resumed run writes the bytes the earlier one wrote.
    records_choices: ClassVar[bool] = False
    #: What an earlier run of the stage chose (``records_choices``), or None: choose by measuring.
    recorded_choices: dict[str, Any] | None = None
    #: What this run of the stage chose (``records_choices``), filled as it chooses.
    choices: dict[str, Any] | None = None

    @property
    def times_on_host(self) -> bool:
        """True when the stage's results depend on the host it runs on: it times latency, or chooses by timing
        (``serves_hosts``). The pipeline adds that host to its resume key (``resume.host_part``). A property, so that a
        stage whose timing is a setting (prune's ``latency``) overrides it."""
        return self.serves_hosts

    @property
    def needs_train_split(self) -> bool:
        """True when the stage needs the training split (the pipeline skips loading it otherwise).

        A property, so that a stage whose need depends on its config (``evaluate`` with ``split: train``)
        overrides it as one, and a stage that always needs it sets ``needs_train_split = True``."""
        return False

    def __init__(self, config: C, stage_id: str, index: int):
        self.config: C = config
        self.id = stage_id
        self.index = index
        #: The recipe's stages before this one (set when the pipeline builds the stage list), for preflight checks.
        self.before: tuple["Stage[StageConfig]", ...] = ()

    @classmethod
    def quantizes(cls, config: C) -> bool:
        """True when the model leaving a stage so configured carries INT8 quantizers.

        A class method on the config, not on a running stage, so the recipe rules can tell at load
        time whether an int8 export has a quantized model to write.
        """
        return False

    @classmethod
    def recipe_rules(cls, config: C, index: int, recipe: "RecipeBase") -> Iterable["ConfigError"]:
        """Problems of this stage's settings that the recipe alone shows (other stages, targets, data
        sources), each a ``ConfigError`` at its key path: ``("stages", index, "precisions", 1)``.

        Pydantic checks one field or one stage; a rule here may look across the recipe. ``load_recipe``
        runs every stage's rules right after validation, so `pruneflow validate` and ``--dry-run``
        report them with FILE:LINE in milliseconds, instead of the run failing after the data and
        model load. Yield (or return) every problem: the user sees them all at once. Default: none.
        """
        return ()

    @classmethod
    def gate_metrics(cls, config: C, task: Any) -> list[str] | None:
        """Every metric a stage so configured records for ``task`` (a ``tasks.Task``), when the class can list them
        all: a gate naming another of this stage's metrics is then exit 2 at load time, not a failed gate after the
        run. None (the default): the names are known only when the stage has run."""
        return None

    def loc(self, *keys: str | int) -> tuple:
        """The recipe key path of one of this stage's settings, for ConfigError: ``("stages", 2, *keys)``."""
        return ("stages", self.index, *keys)

    def setup(self, state: "RunState", ctx: "RunContext") -> None:
        """Prepare (load optional libraries, check inputs). Runs right before ``run``."""

    def run(self, state: "RunState", ctx: "RunContext") -> StageResult:  # pragma: no cover
        raise NotImplementedError

    def teardown(self, state: "RunState", ctx: "RunContext") -> None:
        """Release what ``setup`` took. Runs even when ``run`` failed."""

    def restore(self, state: "RunState", ctx: "RunContext") -> None:
        """``--resume`` skipped this stage: put what it leaves on the state back (the model is reloaded already)."""

    def check_model(self, model: "nn.Module", batch: "Inputs") -> list[str]:
        """Checks of this stage's settings against the model the run loads, on one eval batch, before any stage
        runs (so a run does not train for an hour and fail here): raise a ConfigError at ``self.loc(...)``;
        return notes otherwise. Default: none."""
        return []

    def preflight(self, ctx: "RunContext | None") -> list[str]:
        """Checks that need no model or data (files, toolchains). Returns human-readable notes.

        Runs before the run directory exists (``--dry-run`` too), so ``ctx`` is None there."""
        return []

    def doctor(self, state: "RunState", ctx: "RunContext") -> list[Check]:
        """`pruneflow doctor`: try what this stage will do on the loaded model and one batch, in seconds, and
        say whether the run will get through (``Check`` rows). ``ctx.run_dir`` is a temporary folder;
        ``state.data`` holds one batch of each split. A check that makes the model the next stage would get
        (pruned by one round, quantized) may leave it on ``state.handle``, so later checks try that one.
        A ConfigError raised here is reported as a row (the run would stop there with exit 2), and so is any
        other exception (``Check.failed``).

        Default: no check (doctor says there is nothing to try beyond the recipe rules)."""
        return []


@dataclass(frozen=True)
class BuildInputs:
    """What the export stage gives each target's ``build`` beside the run's state, one typed value.

        target.build(state, ctx, out_dir, "int8", BuildInputs(upstream=built, latency=stage.config.latency))
    """

    #: The artifacts this export stage built before this target (those of ``depends_on`` among them): a target reuses
    #: them instead of exporting again (the OpenVINO INT8 IR from the onnx target's INT8 ONNX).
    upstream: "list[Artifact]" = field(default_factory=list)
    #: The stage's onnx target's ``opset`` and ``exporter`` ({} when it has none): a target that exports an ONNX of its
    #: own exports it alike.
    onnx_export: dict[str, Any] = field(default_factory=dict)
    #: The export stage's ``latency`` settings (``batch_sizes``, ``runs``, ``threads``; None when it times nothing): a
    #: target that chooses between forms by measuring times them alike.
    latency: Any = None

    def onnx_opset(self) -> dict[str, Any]:
        """``onnx_export``'s ``opset`` alone, for the int8 QDQ exports (written by the legacy exporter whatever it says)."""
        return {k: v for k, v in self.onnx_export.items() if k == "opset"}


class Target(Generic[T]):
    """Base class of export targets, generic over its config: one folder, one or more artifacts."""

    Config: ClassVar[type[TargetConfig]] = TargetConfig
    #: Targets that must be built first (their artifacts are inputs here), e.g. ["onnx"].
    depends_on: ClassVar[list[str]] = []

    def __init__(self, config: T):
        self.config: T = config
        #: Tables for the report (list of row dicts by name), e.g. the INT8 forms a target measured to choose one;
        #: the export stage adds them to its own.
        self.tables: dict[str, list[dict]] = {}

    def preflight(self) -> list[str]:
        """Raise MissingDependencyError when the toolchain is absent; return notes otherwise."""
        return []

    #: Precisions this target can write.
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    #: Its int8 is quantized by its own toolchain from the run's calibration set (Ascend's AMCT), not written from
    #: the model a ptq/qat stage quantized: an int8 export of such targets alone needs no quantizing stage.
    quantizes_itself: ClassVar[bool] = False

    @classmethod
    def recipe_rules(cls, config: Any, precisions: list[str], recipe: Any, index: int,
                     loc: tuple) -> "Iterator[ConfigError]":
        """What this target needs of the rest of the recipe (``config``: its settings, ``precisions``: those it
        writes, ``index``: its export stage's, ``loc``: its key path), as ConfigErrors; nothing by default."""
        return iter(())

    def build(self, state: "RunState", ctx: "RunContext", out_dir: Path, precision: str,
              given: "BuildInputs") -> "Artifact | list[Artifact]":  # pragma: no cover
        """Write the artifact(s) under ``out_dir`` (atomically) and return them; ``given``: what the export stage
        hands every target (what it built before this one, how it exports ONNX and how it times).

        One precision may give several artifacts (e.g. ONNX INT8 in the CPU and the TensorRT form);
        each has its own ``precision`` label, which names it in metrics and gates.
        """
        raise NotImplementedError

    #: Whether the model the run started from (``headline.py``) is timed in this target's format beside its artifacts
    #: (``start_file`` makes it), so the headline's latency ratios compare like with like.
    times_start: ClassVar[bool] = False

    def start_file(self, onnx: Path, tmp: Path) -> Path:
        """The starting model in this target's format, made in ``tmp`` from its FP32 ONNX ``onnx`` (``times_start``)."""
        raise NotImplementedError

    def runner(self, path: Path, threads: int | None = None) -> "Callable[[np.ndarray], np.ndarray] | None":
        """A function running the artifact on this machine, or None when its runtime is absent here."""
        return None
