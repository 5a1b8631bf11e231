"""RunContext (immutable facts of a run) and RunState (what stages hand to each other)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .artifacts import run_subdir

if TYPE_CHECKING:
    import torch

    from .artifacts import Artifact
    from .splits import DataBundle
    from .handle import ModelHandle
    from .recipe.models import RecipeBase as Recipe  # recipe_model() builds the Recipe class at run time on this base
    from .tasks import Task

log = logging.getLogger("pruneflow")


class Reporter:
    """How library code reports progress. The CLI supplies a Rich implementation; this base is silent.

    Libraries never print: they call ``ctx.reporter`` and log through ``logging``.
    """

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[Callable[..., None]]:
        """Yields ``advance(n=1, **fields)``; ``fields`` (e.g. loss=0.3) are shown beside the bar."""
        yield lambda n=1, **fields: None

    def run_started(self, name: str, task: dict) -> None:
        """Before the first stage; ``task``: the run's ``Task.summary`` (its headline metric is what a stage's
        line shows)."""
        log.info("run %s: task %s, headline metric %s", name, task.get("type"), task.get("headline"))

    def stage_started(self, stage_id: str, stage_type: str, index: int, total: int) -> None:
        log.info("stage %s (%s) started", stage_id, stage_type)

    def stage_finished(self, stage_id: str, seconds: float, metrics: dict, skipped: bool = False) -> None:
        log.info("stage %s finished in %.1fs%s: %s", stage_id, seconds, " (resumed)" if skipped else "", metrics)

    def info(self, message: str) -> None:
        log.info(message)

    def warning(self, message: str) -> None:
        log.warning(message)


@dataclass(frozen=True)
class RunContext:
    """Immutable: where the run writes, its seed and device, how it reports."""

    run_dir: Path
    recipe: "Recipe"
    recipe_file: Path | None
    seed: int = 0
    device: str = "cpu"
    reporter: Reporter = field(default_factory=Reporter)
    resume: bool = False

    def stage_dir(self, index: int, stage_id: str) -> Path:
        return run_subdir(self.run_dir, "stages", f"{index + 1:02d}-{stage_id}")

    def subdir(self, *parts: str) -> Path:
        """``run_dir/parts...``, made if missing; a link or another user's object on the way is exit 2 (``run_subdir``)."""
        return run_subdir(self.run_dir, *parts)

    def relpath(self, path: Path) -> str:
        return Path(path).resolve().relative_to(self.run_dir.resolve()).as_posix()


@dataclass
class RunState:
    """Mutable state passed from stage to stage.

    The model travels as a :class:`~pruneflow.handle.ModelHandle` (the module plus its kind and float
    base); a stage that makes a new model returns its handle in ``StageResult.handle`` and the pipeline
    installs it here.
    """

    handle: "ModelHandle"
    task: "Task"
    data: "DataBundle | None" = None
    teacher: "torch.nn.Module | None" = None
    calibration: Any = None
    #: The artifact the current model came from (its checkpoint), for lineage.
    model_artifact: "Artifact | None" = None
    #: A stable description of where the current model came from; input to resume keys.
    model_key: str = ""
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    artifacts: list["Artifact"] = field(default_factory=list)
    example_input: "torch.Tensor | dict[str, torch.Tensor] | None" = None  # pruneflow.inputs.Inputs
    #: The model the run started from (entering its first compressing stage; ``headline.StartPoint``), None before.
    start: Any = None

    @property
    def model(self) -> "torch.nn.Module":
        """The current module, for stages that only read it (read-only: a new model comes as a new handle)."""
        return self.handle.module
