"""The export stage's recipe settings (``ExportConfig`` and its parts) and the rules that check them against the
recipe when it loads (``recipe_rules``: precisions each target writes, a quantized model for int8, pinned forms
against the serving CPUs, gates that can be checked)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .. import registry
from ..artifacts import Precision
from ..errors import ConfigError
from ..export import deploy_hosts
from ..gates import ArtifactGates
from ..recipe.models import normalise_target_list
from ..recipe.rules import quantized_before
from ..runtime.timing import DEFAULT_RUNS, DEFAULT_THREADS, DEFAULT_WARMUP
from ..stage import StageConfig, StrictModel
from ..tasks import Task
from .export_choice import MARGIN
from .measure import ParityLimits, default_limits


class ParitySpec(StrictModel):
    samples: int = Field(default=256, ge=1, description="Eval samples compared between torch and the artifact.")
    max_abs_diff: float | None = Field(default=None, gt=0, description="Largest allowed absolute difference of any output (default: 1e-3 for fp32, 0.05 for fp16, none for int8).")
    min_cosine: float | None = Field(default=None, ge=0, le=1, description="Smallest allowed mean per-sample cosine similarity of outputs (of the whole arrays for one or two outputs per "
                                      "sample; default: 0.9999 fp32, 0.999 fp16, 0.99 int8; an OpenVINO artifact run in the plugin's default "
                                      "bf16 is held to at most 0.999, an INT8 one to 0.989: both errors add).")
    agreement: float | None = Field(
        default=None, ge=0,
        description="Limit on the task's agreement figure between torch's outputs and the artifact's (its `agreement`: "
        "classification's is the share of equal top-1 predictions, a minimum; default: 0.99 fp32, 0.98 fp16, 0.95 int8, "
        "in OpenVINO's default bf16 at most 0.98, 0.93 for INT8). A minimum where the figure's higher is better, a maximum "
        "where lower is.")
    min_top1_agreement: float | None = Field(default=None, ge=0, le=1, description="Classification's name for `agreement`: "
                                             "the smallest allowed share of equal top-1 predictions.")

    def limits(self, precision: str, computed_in: str | None = None, task: Task | None = None) -> ParityLimits:
        """Limits for an artifact's precision, run with inference precision ``computed_in`` (OpenVINO's
        ``bf16`` default, say; see ``measure.default_limits``), on ``task``'s outputs; a value set in the recipe wins."""
        default = default_limits(precision, computed_in, task)
        set_here = self.model_dump(include={"max_abs_diff", "min_cosine"}, exclude_none=True)
        agreement = self.agreement if self.agreement is not None else self.min_top1_agreement
        if agreement is not None:
            set_here["agreement"] = agreement
        return default._replace(**set_here)


class LatencySpec(StrictModel):
    batch_sizes: list[int] = Field(default=[1, 32], min_length=1, description="Batch sizes to time (a static-batch artifact is timed at batch 1 only).")
    runs: int = Field(default=DEFAULT_RUNS, ge=1, le=10_000, description="Timed repetitions per batch size (after warm-up); each runs every artifact of the stage once, in turn. "
                      "Median, p90 and p99 come from them (with fewer than 100 runs p99 is close to the slowest run).")
    warmup: int = Field(default=DEFAULT_WARMUP, ge=0, description="Untimed runs of each artifact first.")
    threads: int | None = Field(default=DEFAULT_THREADS, ge=1, description="Runtime threads while timing (1 gives stable numbers; null: the runtime's default). `pruneflow bench` has the same defaults.")


class ChoiceSpec(StrictModel):
    """How a target that delivers one artifact chooses it (``export_choice.py``)."""

    margin: float = Field(
        default=MARGIN, ge=0, lt=1,
        description="An INT8 artifact is delivered only when it is at least this much faster (0.02: 2 %) than the best float "
        "artifact of its target at every served batch size, both timed interleaved as deployed; otherwise the float one "
        "(fp32, which OpenVINO runs in bf16 by default where the CPU has it, or a bf16 IR) is delivered. 0: the fastest.")
    batch_sizes: list[int] | None = Field(
        default=None, min_length=1,
        description="The batch sizes the artifacts are served at, where the choice compares them (default: every batch size "
        "`latency` times). Each must be timed by `latency.batch_sizes`.")


class ExportConfig(StageConfig):
    type: Literal["export"] = Field(default="export", description="Export the model to deployable formats.")
    targets: list[Any] = Field(
        description="Targets to build: names (`onnx`) or mappings with options (`{type: onnx, opset: 17}`).", min_length=1
    )
    precisions: list[Precision] | None = Field(
        default=None, min_length=1,
        description="Numeric precisions to write. Left out (the default): `fp32`, and `int8` where a `ptq` stage, or a `qat` "
        "stage ending in int8, comes before and `latency` times the artifacts; each target then delivers one artifact, the "
        "fastest that holds the gates on this host at the batch sizes served, never slower than the runtime's default float "
        "(INT8 only where it is `choice.margin` faster at every served batch, else FP32; see `choice`); the others stay "
        "in the run folder, and report.md (table `precision chosen`, headline) says what decided it. Named: each is written "
        "and delivered (a target's `precision: auto` still chooses), and where INT8 loses to float on this host, report.md "
        "and its headline say so. `int8` needs a `ptq` stage, or a `qat` stage ending in int8, before export; "
        "its artifacts hold that stage's quantization parameters and are compared with the quantized torch model. `bf16`: "
        "the openvino target's IR with fp16-stored weights whose deployment record pins OpenVINO's bf16 inference "
        "precision (computed in bf16 where the CPU has AVX-512 BF16 or AMX, in f32 elsewhere); onnxruntime's CPU "
        "provider has no bf16 kernels, so the onnx target does not write it.",
    )
    evaluate: bool = Field(default=True, description="Measure each artifact's task metrics (classification: accuracy) on the eval "
                           "split in its own runtime.")
    parity: ParitySpec = Field(default_factory=ParitySpec, description="Torch-vs-artifact parity check and its limits.")
    latency: LatencySpec | None = Field(
        default_factory=LatencySpec,
        description="Latency timing (null = skip): after every artifact is built and checked, all of them are timed together, "
        "interleaved, per batch size; OpenVINO artifacts both with the plugin's default inference precision and with f32 forced.",
    )
    choice: ChoiceSpec = Field(
        default_factory=ChoiceSpec,
        description="How a target delivering one artifact (precisions left out, or `precision: auto`) chooses it: the margin "
        "INT8 must win by and the batch sizes served. The choice (precision, INT8 form, OpenVINO hint) is recorded in "
        "manifest.json (`choices`) and `optimize --resume` reuses it, so a resumed run writes the same bytes; "
        "`--resume --retime` measures again.")
    gates: ArtifactGates = Field(
        default_factory=ArtifactGates,
        description="Gates on every artifact of the stage: speed-up against the fp32 artifact of its target, size on disk. "
        "A failed one exits 1, names the gate, the artifact and the value, and marks the artifact (kept on disk).",
    )

    @field_validator("targets", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return normalise_target_list(value)

    @field_validator("targets", mode="after")
    @classmethod
    def _unique(cls, value: list) -> list:
        names = [getattr(t, "type", t.get("type") if isinstance(t, dict) else t) for t in value]
        twice = sorted({n for n in names if names.count(n) > 1}, key=str)  # a mapping without `type` gives None
        if twice:
            raise ValueError(f"target {', '.join(map(repr, twice))} is listed twice")
        return value

    @field_validator("precisions", mode="after")
    @classmethod
    def _unique_precisions(cls, value: list | None) -> list | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("a precision is listed twice")
        return value

    def written(self, quantized: bool) -> list[str]:
        """The stage's precisions: as named, else fp32 and (a quantized model, timed artifacts) int8."""
        if self.precisions is not None:
            return list(self.precisions)
        return ["fp32", "int8"] if quantized and self.latency is not None else ["fp32"]

    def of_target(self, target, writes: tuple[str, ...], quantized: bool) -> list[str]:
        """What ``target`` (its config) writes: its own list, else the stage's (left out: those it can write)."""
        if self.precisions is None:
            return list(target.precisions) if target.precisions else [p for p in self.written(quantized) if p in writes]
        return [p for p in self.precisions if p in (target.precisions or self.precisions)]

    def delivers_one(self, target) -> bool:
        """Whether ``target`` (its config) delivers one chosen artifact: `precision: auto`, or nothing named."""
        return target.precision == "auto" or (self.precisions is None and not target.precisions)

    def metric_prefixes(self) -> list[str]:
        return [t.type for t in self.targets]

    def gate_precisions(self, prefix: str, quantized: bool) -> list[str] | None:
        """What target ``prefix`` writes in this stage (``of_target``): a gate on another precision would only fail
        after the whole run."""
        target = next((t for t in self.targets if t.type == prefix), None)
        if target is None:
            return None
        return self.of_target(target, registry.targets.get(target.type).precisions, quantized)

    def resolved(self, quantized: bool) -> "ExportConfig":
        """A copy with the precisions left out filled in (what doctor builds)."""
        if self.precisions is not None:
            return self
        named = [p for t in self.targets for p in (getattr(t, "precisions", None) or [])]
        return self.model_copy(update={"precisions": list(dict.fromkeys(self.written(quantized) + named))})


def recipe_rules(config, index, recipe):
    """Each target writes each precision asked for (``Target.precisions``), and int8 has a quantized
    model to write: a `ptq` stage, or a `qat` stage ending in int8, before this export (unless every target
    writing it quantizes itself, ``Target.quantizes_itself``); then each target's own ``recipe_rules``."""
    quantized = quantized_before(recipe, index)
    named = config.precisions is not None
    for t, target in enumerate(config.targets):
        cls_ = registry.targets.get(target.type)
        writes = cls_.precisions
        yield from cls_.recipe_rules(target, config.of_target(target, writes, quantized), recipe, index,
                                     ("stages", index, "targets", t))
        own = target.precisions is not None
        loc = ("stages", index, "targets", t, "precisions") if own else ("stages", index, "precisions")
        for i, precision in enumerate(target.precisions or config.precisions or []):
            if named and precision not in config.precisions:
                yield ConfigError((*loc, i), f"{precision} is not among the stage's precisions", value=precision,
                                  hint=f"a target writes some of the stage's precisions ({', '.join(config.precisions)}); add it there")
            elif precision not in writes:
                yield ConfigError((*loc, i), f"target {target.type!r} cannot write {precision}", value=precision,
                                  hint=f"{target.type} writes {', '.join(writes)}" + ("" if own else
                                       f"; give it its own list: `{{type: {target.type}, precisions: [{', '.join(w for w in writes if w in config.precisions)}]}}`"))
    int8_from_model = [t for t in config.targets if "int8" in (t.precisions or config.precisions or [])
                       and not registry.targets.get(t.type).quantizes_itself]
    if int8_from_model and not quantized:
        t = int8_from_model[0]
        loc = (("stages", index, "precisions", config.precisions.index("int8")) if named and not t.precisions else
               ("stages", index, "targets", config.targets.index(t), "precisions", t.precisions.index("int8")))
        yield ConfigError(
            loc, "int8 needs a quantized model, and no stage before this export quantizes it", value="int8",
            hint="add a `ptq` stage (no training) or a `qat` stage whose schedule ends in an int8 phase before `export`",
        )
    for t, target in enumerate(config.targets):
        if target.precision == "auto" and config.latency is None:
            yield ConfigError(("stages", index, "targets", t, "precision"), "precision: auto picks the fastest artifact "
                              "by the stage's timing, and `latency` is null", value="auto",
                              hint="remove `latency: null`, or pin the precisions with `precisions:`")
    yield from host_rules(config, index, recipe)
    timed = config.latency.batch_sizes if config.latency else []
    for i, bs in enumerate(config.choice.batch_sizes or []):
        if bs not in timed:
            yield ConfigError(("stages", index, "choice", "batch_sizes", i), f"batch size {bs} is not timed by this "
                              "stage", value=bs, hint=f"add it to latency.batch_sizes ({', '.join(map(str, timed)) or 'none'})")
    yield from gate_rules(config, index, quantized)


def host_rules(config, index, recipe):
    """A pinned INT8 form that needs VNNI, for serving CPUs of which one has none (``deploy.cpu``, ``--for``): the
    file would compute another model there, so the recipe is refused rather than warned about."""
    hosts = recipe.deploy.cpu
    for t, target in enumerate(config.targets):
        form = target.pinned_cpu_form()
        if form is None:
            continue
        wrong = deploy_hosts.form_conflict(form, hosts)
        if wrong:
            yield ConfigError(("stages", index, "targets", t, "form"), f"the {form} INT8 form needs VNNI or AMX on x86, "
                              f"and `deploy.cpu` names {', '.join(wrong)} (no VNNI: its int8 kernels add u8 x s8 products "
                              "in int16 pairs, which this form can saturate)", value=form,
                              hint="pin `form: u8s8` (exact on every CPU) or leave `form: auto`, or serve on CPUs with "
                              "VNNI only (`deploy.cpu`, `optimize --for`)")


def gate_rules(config, index, quantized: bool = False):
    """The stage's `gates:` can be checked: a speed-up needs fp32 and latency, names known targets and batch sizes."""
    gates, loc = config.gates, ("stages", index, "gates")
    if gates.min_speedup is not None and "fp32" not in config.written(quantized):
        yield ConfigError((*loc, "min_speedup"), "min_speedup compares each artifact with the fp32 artifact of its target, "
                          "and this stage writes no fp32", value=gates.min_speedup, hint="add fp32 to the stage's precisions")
    if gates.min_speedup is not None and config.latency is None:
        yield ConfigError((*loc, "min_speedup"), "min_speedup needs latency timing, and `latency` is null",
                          value=gates.min_speedup, hint="remove `latency: null` (or the gate)")
    names = [t.type for t in config.targets]
    for i, name in enumerate(gates.targets or []):
        if name not in names:
            yield ConfigError((*loc, "targets", i), f"{name!r} is not a target of this stage", value=name,
                              hint=f"targets here: {', '.join(names)}")
    timed = config.latency.batch_sizes if config.latency else []
    for i, bs in enumerate(gates.batch_sizes or []):
        if bs not in timed:
            yield ConfigError((*loc, "batch_sizes", i), f"batch size {bs} is not timed by this stage", value=bs,
                              hint=f"add it to latency.batch_sizes ({', '.join(map(str, timed)) or 'none'})")
