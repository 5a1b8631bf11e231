"""The pydantic base types of every config: the kernel that the recipe models and the stage classes share.

It imports nothing of ours, so ``recipe/models.py`` (which builds the recipe from stage configs) and
``stage.py`` (whose classes take a run context) can both depend on it without depending on each other.
A plugin's config subclasses these::

    class Config(StageConfig):
        type: Literal["my_stage"] = "my_stage"
        strength: float = Field(default=0.5, description="How hard to squeeze.")
"""

from __future__ import annotations

from pathlib import Path
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

    def metric_prefixes(self) -> list[str]:
        """What else than the stage's id its figures' names may start with (the export stage's: its targets,
        ``onnx.fp32.accuracy``), for the check of a gate's metric name."""
        return []

    def gate_precisions(self, prefix: str, quantized: bool) -> list[str] | None:
        """The precisions a gate may name after ``prefix`` (one of ``metric_prefixes``: ``onnx`` in
        ``onnx.int8.accuracy``), the model entering the stage being ``quantized`` or not; None: not known here."""
        return None


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

    def static_batch(self) -> bool:
        """True when this target's artifacts take one fixed batch size (``dynamic_batch: false``): parity and
        latency then run them one sample at a time."""
        return False

    def left_to_host(self) -> frozenset[str]:
        """This target's settings left `auto` that the serving CPUs (``deploy.cpu``) can decide without timing, and
        that a resumed run takes from the record of the run it resumes: ``form`` (the INT8 ONNX form), ``int8_hint``
        (OpenVINO's INT8 precision hint). ``export_hosts.pinned`` pins them."""
        return frozenset()

    def pinned_cpu_form(self) -> str | None:
        """The INT8 form the recipe pins this target's CPU artifact to (None: `auto`, or no CPU INT8 artifact), which
        ``export_config.host_rules`` holds against the serving CPUs."""
        return None

    def onnx_export(self) -> dict[str, Any]:
        """What this target asks of every ONNX its stage exports (``opset``, ``exporter``; {}: nothing), the ones
        other targets export for themselves included."""
        return {}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else every logical CPU)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: Where the kernel describes this process's control groups, and where their files are mounted (tests point these
#: at a fake tree).
SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: A cgroup v1 limit at or above this is "no limit" (the kernel writes 2**63 rounded down to a page).
_V1_UNLIMITED = 2**60


def machine_memory() -> int | None:
    """Bytes the machine has available (the kernel's MemAvailable, else free pages); None where neither can be read."""
    import os

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
    except (OSError, ValueError):
        return None


def available_memory(self_cgroup: Path | None = None, root: Path | None = None) -> int | None:
    """Bytes this process can still allocate: the machine's (``machine_memory``), lowered to what this process's own
    control group leaves (``cgroup_memory_left``: v2 or v1, every level up to the mount, as a container's limit is
    enforced); None where neither can be read. ``self_cgroup`` and ``root`` point at a fake tree in tests."""
    found = [m for m in (machine_memory(), cgroup_memory_left(self_cgroup, root)) if m is not None]
    return max(0, min(found)) if found else None


def memory_left() -> tuple[int | None, str]:
    """``(available_memory(), where the figure comes from)``: "under this container's memory limit (cgroup)" when the
    process's control group leaves less than the machine has, else "available on this machine"."""
    machine, group = machine_memory(), cgroup_memory_left()
    if group is not None and (machine is None or group < machine):
        return max(0, group), "under this container's memory limit (cgroup)"
    return machine, "available on this machine"


def cgroup_memory_left(self_cgroup: Path | None = None, root: Path | None = None) -> int | None:
    """Bytes left under the tightest memory limit of this process's control group and its ancestors (v2 or v1), the
    reclaimable page cache (``inactive_file``) counted as free; None where no limit is set or none can be read."""
    try:
        lines = (self_cgroup or SELF_CGROUP).read_text().splitlines()
    except OSError:
        return None
    root = root or CGROUP_ROOT
    left = []
    for line in lines:
        hierarchy, controllers, group = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: one tree, memory.max / memory.current
            left += _limits(root, group, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own tree
            left += _limits(root / "memory", group, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    return max(0, min(left)) if left else None


def _limits(mount: Path, group: str, limit_file: str, usage_file: str, cache_key: str) -> list[int]:
    """``limit - (usage - inactive page cache)`` for the group's folder and each folder above it up to ``mount`` (a
    container whose cgroup namespace hides the host's path sees its own group at the mount itself)."""
    folder = mount / group.strip("/") if group.strip("/") else mount
    found = []
    while True:
        try:
            raw = (folder / limit_file).read_text().strip()
            if raw != "max" and int(raw) < _V1_UNLIMITED:
                used = int((folder / usage_file).read_text())
                found.append(int(raw) - max(0, used - _stat(folder / "memory.stat", cache_key)))
        except (OSError, ValueError):
            pass
        if folder == mount or mount not in folder.parents:
            return found
        folder = folder.parent


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
