"""`pruneflow doctor RECIPE`: before a long run, try every stage on the loaded model and one batch, in seconds.

Loads the data and the model as a run does (the same checks: a refused input is exit 2), tries the model itself
(MACs, an ONNX export run in onnxruntime), then asks each stage what it will do: ``Stage.doctor(state, ctx)``, each
stage's own (train: one step; evaluate: one batch; prune: one real round of the recipe's strategy on a copy, in
prune/doctor.py; qat/ptq: NNCF on one batch, in qat/doctor.py; export: every target and precision built for real
into a temporary folder and run in its runtime, in stages/export_doctor.py). Each stage hands the next the model
it would leave (pruned by one round, quantized), so the export is tried on the model that will reach it. The
result is a table: stage or target, check, ok / will skip / will fail, why and the fix::

    report = run_doctor(load_recipe("recipe.yaml"))
    report.exit_code  # 0: everything will work; 1: something will fail
"""

from __future__ import annotations

import copy
import functools
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import registry
from .context import Reporter, RunContext, RunState
from .errors import ConfigError, MissingDependencyError
from .handle import ModelHandle
from .inputs import Inputs, as_numpy, describe, take, to
from .prepare import load_inputs, plan_stages, preflight
from .recipe import LoadedRecipe
from .stage import BuildInputs, Check, Stage

#: The fix when an exported file fails in its runtime on a batch (the export traced a batch of 2).
TRACED_SIZES = ("the export traces forward with a batch of 2 and the file runs a batch of 32: a size read with len() or "
                "int() in forward is frozen into the graph (use x.shape[0] or torch ops); else try `exporter: dynamo` "
                "on the onnx target")

#: Samples of each split the checks see (one batch): enough for a training step and an agreement figure.
DOCTOR_BATCH = 32

#: What a doctor run should take: every zoo family's runs in 4-7 s on an idle 2-core machine. A longer one says so
#: in its own report (never a failure): the machine is busy, or the model is large enough that a run will be slow.
DOCTOR_BUDGET_SECONDS = 30.0


@dataclass
class DoctorRow:
    """One row of the table: where (``model``, ``STAGE (type)``), the check, its status, why, the fix, seconds."""

    where: str
    check: str
    status: str
    why: str = ""
    fix: str = ""
    seconds: float = 0.0
    figures: dict[str, float | int] = field(default_factory=dict)


@dataclass
class DoctorReport:
    recipe: str
    rows: list[DoctorRow]
    seconds: float

    @property
    def exit_code(self) -> int:
        """0 when every check says the run will get through (skips included), 1 when one says it will fail."""
        return 1 if any(r.status == "will fail" for r in self.rows) else 0

    @property
    def slow(self) -> str:
        """A note when the checks took longer than :data:`DOCTOR_BUDGET_SECONDS`, else empty."""
        if self.seconds <= DOCTOR_BUDGET_SECONDS:
            return ""
        return (f"took {self.seconds:.0f} s, more than the {DOCTOR_BUDGET_SECONDS:.0f} s it takes on an idle 2-core "
                "machine: this one is busy or the model is large, and the run will be slower than usual")

    def as_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "recipe": self.recipe, "seconds": round(self.seconds, 2),
                "budget_seconds": DOCTOR_BUDGET_SECONDS, "slow": self.slow, "checks": [asdict(r) for r in self.rows]}


def run_doctor(loaded: LoadedRecipe, reporter: Reporter | None = None) -> DoctorReport:
    """Every check of the recipe's stages on its model and one batch; see the module docstring.

    Raises what a run would raise before its first stage (a recipe error, a file or factory that is missing, a
    model that fails on the data: exit 2); everything after that is a row."""
    start = time.perf_counter()
    reporter = reporter or Reporter()
    stages = plan_stages(loaded)
    rows = _toolchain_rows(loaded, stages, preflight)
    reporter.info("doctor: loading the data and the model")
    with loaded.locating():  # it tries one batch: reference targets (an embedding task's) for that batch alone
        inputs = load_inputs(loaded, stages, reporter, probe_rows=DOCTOR_BATCH)
    rows.append(DoctorRow("model", "forward on one batch", "ok",
                          f"{loaded.recipe.model.factory} on a batch of {min(DOCTOR_BATCH, len(inputs.data.eval))} eval samples "
                          f"{_shapes(inputs.data.eval.x)}"))
    with tempfile.TemporaryDirectory(prefix="pruneflow-doctor-") as tmp:
        state, ctx = _probe(loaded, inputs, Path(tmp), reporter)
        rows += _timed("model", lambda: _model_checks(state, ctx))
        for stage in stages:  # progress: one line a stage, as a run prints them
            reporter.stage_started(stage.id, f"doctor: {stage.config.type}", stage.index, len(stages))
            began = time.perf_counter()
            rows += _timed(f"{stage.id} ({stage.config.type})", functools.partial(_stage_checks, stage, state, ctx, loaded))
            reporter.stage_finished(stage.id, time.perf_counter() - began, {})
    return DoctorReport(str(loaded.file), rows, time.perf_counter() - start)


def _toolchain_rows(loaded: LoadedRecipe, stages: list[Stage], preflight: Callable) -> list[DoctorRow]:
    """The run's own preflight (files, toolchains): a required toolchain that is absent is a row, not a stop."""
    try:
        notes = preflight(loaded, stages, None)
    except MissingDependencyError as exc:
        return [DoctorRow("recipe", "toolchains", "will fail", exc.message, exc.hint or "")]
    rows = [DoctorRow("recipe", "files and toolchains", "ok", f"{len(stages)} stages resolved")]
    skip_fix = ("none needed here: the run prepares a bundle to build where the toolchain exists; `required: true` "
                "on the target makes its absence an error instead")
    return rows + [DoctorRow("recipe", "toolchain note", "will skip" if "prepared" in n else "ok", n,
                             skip_fix if "prepared" in n else "") for n in notes]


def _probe(loaded: LoadedRecipe, inputs: Any, tmp: Path, reporter: Reporter) -> tuple[RunState, RunContext]:
    """The state a run starts from, with one batch of each split, and a context writing under ``tmp``."""
    from .data import DataBundle, Split
    from .user_metrics import recipe_task

    data = inputs.data
    head = slice(0, DOCTOR_BATCH)
    small = DataBundle(**{**data.__dict__, "eval": Split(take(data.eval.x, head), data.eval.y[head]),
                          "train": Split(take(data.train.x, head), data.train.y[head]) if data.train is not None else None})
    recipe = loaded.recipe
    ctx = RunContext(run_dir=tmp, recipe=recipe, recipe_file=loaded.file, seed=recipe.seed, device=inputs.device,
                     reporter=reporter)
    state = RunState(handle=ModelHandle(copy.deepcopy(inputs.model).to(inputs.device)), task=recipe_task(recipe),
                     data=small, model_key="doctor", example_input=to(inputs.example, inputs.device))
    return state, ctx


def _shapes(x: Inputs) -> str:
    """One sample's shape, or each named input's (``input_ids [sequence] int64``)."""
    if isinstance(x, torch.Tensor):
        return str(list(x.shape[1:]))
    return ", ".join(f"{k} {d['shape']} {d['dtype']}" for k, d in describe(x).items())


def _example(state: RunState) -> Inputs:
    assert state.example_input is not None  # set by _probe
    return state.example_input


def _timed(where: str, checks: Callable[[], list[Check]]) -> list[DoctorRow]:
    start = time.perf_counter()
    found = checks()
    seconds = (time.perf_counter() - start) / max(len(found), 1)
    return [DoctorRow(where, c.check, c.status, c.why, c.fix, round(seconds, 2), c.figures) for c in found]


def _stage_checks(stage: Stage, state: RunState, ctx: RunContext, loaded: LoadedRecipe) -> list[Check]:
    """The stage's own checks (``Stage.doctor``); whatever they raise becomes a row."""
    try:
        return stage.doctor(state, ctx) or [Check("preflight", "ok", "nothing to try beyond the recipe rules for this stage type")]
    except ConfigError as exc:  # the run would stop here with exit 2, at the setting's line
        located = loaded.error([exc])
        return [Check("settings on this model", "will fail", "; ".join(i.format().strip() for i in located.issues),
                      exc.hint or "")]
    except Exception as exc:  # noqa: BLE001 - a check that breaks says so; doctor itself goes on
        return [Check.failed("preflight", exc)]


#: The export target the model check writes its FP32 ONNX file with (found in the registry like any target).
MODEL_CHECK_TARGET = "onnx"


def _model_checks(state: RunState, ctx: RunContext) -> list[Check]:
    """MACs and parameters through torch-pruning's counter, and the FP32 ONNX export (the registered ``onnx``
    target's, with its defaults) loaded and run in onnxruntime."""
    from .evaluate import count_macs_params
    from .runtime import open_artifact

    try:
        macs, params = count_macs_params(state.model, _example(state))
        rows = [Check("MACs and parameters", "ok", f"{macs:,} MACs, {params:,} parameters a sample")]
    except Exception as exc:  # noqa: BLE001
        rows = [Check.failed("MACs and parameters", exc, "train, evaluate and prune count MACs with torch-pruning's op counter")]
    out_dir = ctx.run_dir / "doctor-model"
    out_dir.mkdir(parents=True, exist_ok=True)
    assert state.data is not None
    try:
        target_class = registry.targets.get(MODEL_CHECK_TARGET)
        made = target_class(target_class.Config(type=MODEL_CHECK_TARGET)).build(state, ctx, out_dir, "fp32", BuildInputs())
        artifact = made[0] if isinstance(made, list) else made
        open_artifact(ctx.run_dir / artifact.path, runtime="onnxruntime")(as_numpy(state.data.eval.x))
    except Exception as exc:  # noqa: BLE001
        return rows + [Check.failed("ONNX export (torch.onnx) and onnxruntime", exc, TRACED_SIZES)]
    return rows + [Check("ONNX export (torch.onnx) and onnxruntime", "ok", "exported, loaded and run on one batch")]


