"""The pydantic base types of every config: the kernel that the recipe models and the stage classes share.

It imports nothing of ours, so ``recipe/models.py`` (which builds the recipe from stage configs) and
``stage.py`` (whose classes take a run context) can both depend on it without depending on each other.
A plugin's config subclasses these::

    class Config(StageConfig):
        type: Literal["my_stage"] = "my_stage"
        strength: float = Field(default=0.5, description="How hard to squeeze.")
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .artifacts import Precision


class StrictModel(BaseModel):
    """Base for every config: unknown keys are errors, every field carries a description.

    A default is written ``Field(default=...)``: mypy reads these models as dataclasses (pydantic's
    dataclass_transform) and takes only the keyword for a default, so with a positional one the field
    looks required, and a config used as another's ``default_factory`` looks uncallable without arguments.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True)


class StageConfig(StrictModel):
    type: str = Field(description="Stage type, one of the registered stages (see `pruneflow schema`).")
    name: str | None = Field(
        default=None,
        description="Name used for this stage's metrics and folder; defaults to its type "
        "(with a number when the type repeats).",
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        max_length=100,  # the stage folder is stages/NN-NAME: file names stop at 255 bytes
    )


class TaskConfig(StrictModel):
    """A task's options (``tasks.py``); a task's own Config narrows ``type`` to its name and adds its options."""

    type: str = Field(description="Task type, one of the registered tasks (`classification` built in; see `pruneflow schema`).")
    output: str | int | None = Field(
        default=None,
        description="Which part of the model's output the task reads: a dict key or attribute name (`logits`), or a tuple "
        "index. Default: the output itself when it is a tensor, else its `logits`, else its first element.",
    )


class TargetConfig(StrictModel):
    type: str = Field(description="Export target, one of the registered targets.")
    required: bool = Field(
        default=False,
        description="Fail the run (exit 3, before any training) when this target's toolchain is absent here. "
        "By default such a target is prepared (everything its vendor tool needs, with the commands) and "
        "reported as `prepared, not built`.",
    )
    precisions: list[Precision] | None = Field(
        default=None, min_length=1,
        description="Precisions this target writes, when not all of the stage's (e.g. `{type: ascend, precisions: [fp32, fp16]}` "
        "beside targets that also write int8). Default: the stage's `precisions`.",
    )
    precision: Literal["auto"] | None = Field(
        default=None,
        description="`auto`: of the precisions this target writes, the run's result is the fastest artifact that holds every "
        "gate of the stage on this host: timed as deployed (its record's precision hint, else the runtime's default) at the "
        "stage's `latency` batch sizes, compared by geometric mean; INT8 where it wins, bf16 or fp32 where it does not. "
        "The others stay in the run folder marked `precision_chosen: 0`, their failed gates moved into their notes; "
        "report.md's `precision chosen` table shows what decided it. Needs the stage's `latency`.",
    )

    def onnx_export(self) -> dict[str, Any]:
        """What this target asks of every ONNX its stage exports (``opset``, ``exporter``; {}: nothing), the ones
        other targets export for themselves included."""
        return {}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else every logical CPU)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, lowered to what is left under a cgroup
    (container) limit; None where neither can be read."""
    import os
    from pathlib import Path

    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit, used = (Path("/sys/fs/cgroup") / n for n in ("memory.max", "memory.current"))
        if limit.read_text().strip() != "max":
            found.append(int(limit.read_text()) - int(used.read_text()))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return max(0, min(found)) if found else None
