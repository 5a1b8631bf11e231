"""`pruneflow doctor RECIPE`: before a long run, try every stage on the loaded model and one batch, in seconds.

Loads the data and the model as a run does (the same checks: a refused input is exit 2), then asks each stage
what it will do: its own ``Stage.doctor(state, ctx)`` (a plugin's, e.g. qat/doctor.py through NNCF), else a
built-in check here (train: one step; evaluate: one batch; prune: one real round of the recipe's strategy on
a copy; export: every target and precision built for real into a temporary folder and run in its runtime).
Each stage hands the next the model it would leave (pruned by one round, quantized), so the export is tried on
the model that will reach it. The result is a table: stage or target, check, ok / will skip / will fail, why
and the fix::

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

import numpy as np
import torch

from .context import Reporter, RunContext, RunState
from .errors import ConfigError, MissingDependencyError, PruneflowError
from .handle import ModelHandle
from .inputs import Inputs, as_numpy, call, describe, take, to
from .recipe import LoadedRecipe
from .stage import Check, Stage

#: The fix when an exported file fails in its runtime on a batch (the export traced a batch of 2).
TRACED_SIZES = ("the export traces forward with a batch of 2 and the file runs a batch of 32: a size read with len() or "
                "int() in forward is frozen into the graph (use x.shape[0] or torch ops); else try `exporter: dynamo` "
                "on the onnx target")

#: Samples of each split the checks see (one batch): enough for a training step and an agreement figure.
DOCTOR_BATCH = 32


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

    def as_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "recipe": self.recipe, "seconds": round(self.seconds, 2),
                "checks": [asdict(r) for r in self.rows]}


def run_doctor(loaded: LoadedRecipe, reporter: Reporter | None = None) -> DoctorReport:
    """Every check of the recipe's stages on its model and one batch; see the module docstring.

    Raises what a run would raise before its first stage (a recipe error, a file or factory that is missing, a
    model that fails on the data: exit 2); everything after that is a row."""
    from .pipeline import check_factory, load_inputs, plan_stages, preflight

    start = time.perf_counter()
    reporter = reporter or Reporter()
    stages = plan_stages(loaded)
    check_factory(loaded)
    rows = _toolchain_rows(loaded, stages, preflight)
    reporter.info("doctor: loading the data and the model")
    with loaded.locating():
        inputs = load_inputs(loaded, stages, reporter)
    rows.append(DoctorRow("model", "forward on one batch", "ok",
                          f"{loaded.recipe.model.factory} on a batch of {min(DOCTOR_BATCH, len(inputs.data.eval))} eval samples "
                          f"{_shapes(inputs.data.eval.x)}"))
    with tempfile.TemporaryDirectory(prefix="pruneflow-doctor-") as tmp:
        state, ctx = _probe(loaded, inputs, Path(tmp), reporter)
        rows += _timed("model", lambda: _model_checks(state, Path(tmp)))
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
    return rows + [DoctorRow("recipe", "toolchain note", "will skip" if "prepared" in n else "ok", n) for n in notes]


def _probe(loaded: LoadedRecipe, inputs: Any, tmp: Path, reporter: Reporter) -> tuple[RunState, RunContext]:
    """The state a run starts from, with one batch of each split, and a context writing under ``tmp``."""
    from .data import DataBundle, Split
    from .tasks import make_task

    data = inputs.data
    head = slice(0, DOCTOR_BATCH)
    small = DataBundle(**{**data.__dict__, "eval": Split(take(data.eval.x, head), data.eval.y[head]),
                          "train": Split(take(data.train.x, head), data.train.y[head]) if data.train is not None else None})
    recipe = loaded.recipe
    ctx = RunContext(run_dir=tmp, recipe=recipe, recipe_file=loaded.file, seed=recipe.seed, device=inputs.device,
                     reporter=reporter)
    state = RunState(handle=ModelHandle(copy.deepcopy(inputs.model).to(inputs.device)), task=make_task(recipe.task),
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
    """The stage's own checks, else the built-in ones for its type; whatever they raise becomes a row."""
    try:
        checks = stage.doctor(state, ctx)
        if checks is None:
            builtin = BUILTIN.get(stage.config.type)
            checks = builtin(stage, state, ctx) if builtin else [
                Check("preflight", "ok", "nothing to try beyond the recipe rules for this stage type")]
        return checks
    except ConfigError as exc:  # the run would stop here with exit 2, at the setting's line
        located = loaded.error([exc])
        return [Check("settings on this model", "will fail", "; ".join(i.format().strip() for i in located.issues),
                      exc.hint or "")]
    except Exception as exc:  # noqa: BLE001 - a check that breaks says so; doctor itself goes on
        return [failed("preflight", exc)]


def failed(check: str, exc: BaseException, fix: str = "") -> Check:
    """A ``will fail`` row from an exception: our message and hint, or the type and first line of another's."""
    if isinstance(exc, PruneflowError):
        return Check(check, "will fail", exc.message, exc.hint or fix)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return Check(check, "will fail", f"{type(exc).__name__}: {first}", fix)


def _model_checks(state: RunState, tmp: Path) -> list[Check]:
    """MACs and parameters through torch-pruning's counter, and the FP32 ONNX export loaded and run in onnxruntime."""
    from .evaluate import count_macs_params
    from .export.onnx import export_onnx
    from .runtime import open_artifact

    try:
        macs, params = count_macs_params(state.model, _example(state))
        rows = [Check("MACs and parameters", "ok", f"{macs:,} MACs, {params:,} parameters a sample")]
    except Exception as exc:  # noqa: BLE001
        rows = [failed("MACs and parameters", exc, "train, evaluate and prune count MACs with torch-pruning's op counter")]
    path = tmp / "doctor.fp32.onnx"
    assert state.data is not None
    try:
        export_onnx(state.model, _example(state), path)
        open_artifact(path, runtime="onnxruntime")(as_numpy(state.data.eval.x))
    except Exception as exc:  # noqa: BLE001
        return rows + [failed("ONNX export (torch.onnx) and onnxruntime", exc, TRACED_SIZES)]
    return rows + [Check("ONNX export (torch.onnx) and onnxruntime", "ok", "exported, loaded and run on one batch")]


def _train_checks(stage: Stage, state: RunState, ctx: RunContext) -> list[Check]:
    """One optimizer step on a copy: forward, the task's loss, backward, finite gradients."""
    data = state.data
    split = data.train if data is not None and data.train is not None else None
    if split is None:
        return [Check("training split", "will fail", "the recipe's data has no training split",
                      "set data.path or data.train")]
    model = copy.deepcopy(state.model).train()
    loss = state.task.loss(call(model, to(split.x, ctx.device)), split.y.to(ctx.device))
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if bad:
        return [Check("one training step", "will fail", f"non-finite gradients in {', '.join(bad[:3])}",
                      "check the data's scale and the model's initialisation")]
    return [Check("one training step", "ok", f"loss {float(loss.detach()):.4f} on {len(split)} samples, finite gradients")]


def _evaluate_checks(stage: Stage, state: RunState, ctx: RunContext) -> list[Check]:
    from .evaluate import evaluate_model

    assert state.data is not None
    result = evaluate_model(state.model, state.data.eval, state.task, device=ctx.device)
    return [Check("evaluate one batch", "ok", f"accuracy {result['accuracy']:.4f} on {len(state.data.eval)} eval samples "
                  "(doctor trains nothing: the figure is not the run's)")]


def _prune_checks(stage: Stage, state: RunState, ctx: RunContext) -> list[Check]:
    """One real round of the stage's strategy on a copy (importance from one batch, the round's goal, the
    removal), then a forward pass of the pruned copy; plus torch-pruning's coupling groups and the attention
    modules it will meet. The pruned copy goes on to the next stage's checks."""
    from .prune.stage import _STRATEGIES  # the strategy the stage's own run builds, so the round is the stage's

    rows = _coupling_rows(state.model, _example(state))
    model = copy.deepcopy(state.model)
    cfg = stage.config
    scored = getattr(cfg, "importance", None)
    if scored not in (None, "magnitude", "taylor"):  # which channels go does not change what traces; Hessian scores are slow
        cfg = cfg.model_copy(update={"importance": "taylor"})
    strategy = _STRATEGIES[type(cfg)](cfg, model, _example(state), state.task.loss, stage.loc)
    before = strategy.entering()
    strategy.prepare()
    split = state.data.train if state.data is not None and state.data.train is not None else state.data.eval  # type: ignore[union-attr]
    batches = [(to(split.x, ctx.device), split.y.to(ctx.device))]
    try:
        rounds = strategy.rounds()  # the whole target in one round: the structure the run's last round reaches
        plan = strategy.plan(strategy.score(lambda: batches), strategy.goal(rounds, rounds))
        plan.apply()
        model.eval()
        with torch.no_grad():
            call(model, to(split.x, ctx.device))
    except PruneflowError:
        raise
    except Exception as exc:  # noqa: BLE001
        return rows + [failed("pruning to the target in one round", exc, "`ignore` the module named (its class is in `pruneflow inspect`), "
                              "or prune attention by whole heads")]
    after = strategy.measure()
    state.handle = ModelHandle(model)
    return rows + [Check("pruning to the target in one round", "ok", f"MACs {before['macs']:,} -> {after['macs']:,}, "
                         f"parameters {before['params']:,} -> {after['params']:,} (the run takes {rounds} rounds"
                         f"{f'; channels scored by taylor here, {scored} in the run' if scored != cfg.importance else ''}); "
                         "the pruned model runs on one batch",
                         figures={"macs_before": before["macs"], "macs_after": after["macs"], "params_before": before["params"],
                                  "params_after": after["params"], "rounds": rounds})]


def _coupling_rows(model: torch.nn.Module, example: Inputs) -> list[Check]:
    """torch-pruning's dependency graph of the model: how many coupled groups, and the attention modules in it."""
    import torch_pruning as tp

    attention = [f"{n} ({type(m).__name__}, {getattr(m, 'num_heads', getattr(m, 'num_attention_heads', '?'))} heads)"
                 for n, m in model.named_modules()
                 if n and (isinstance(m, torch.nn.MultiheadAttention) or hasattr(m, "num_attention_heads"))]
    try:
        graph = tp.DependencyGraph().build_dependency(copy.deepcopy(model).eval(), example_inputs=example)
        groups = list(graph.get_all_groups(root_module_types=[torch.nn.Conv2d, torch.nn.Conv1d, torch.nn.Linear]))
    except Exception as exc:  # noqa: BLE001 - torch-pruning traces the forward pass
        return [failed("torch-pruning dependency graph", exc, "a forward pass torch-pruning cannot trace cannot be pruned; "
                       "`ignore` the module that fails or drop the prune stage")]
    rows = [Check("torch-pruning dependency graph", "ok", f"{len(groups)} coupled channel groups")]
    if attention:
        rows.append(Check("attention modules", "ok", f"{len(attention)}: {', '.join(attention[:4])}"
                          f"{' ...' if len(attention) > 4 else ''}; their widths are coupled through the heads"))
    return rows


def _export_checks(stage: Stage, state: RunState, ctx: RunContext) -> list[Check]:
    """Every target and precision built for real into the temporary folder, then run in its runtime on one batch."""
    cfg = stage.config
    rows: list[Check] = []
    built: list = []
    for name, target in stage._targets():  # type: ignore[attr-defined]
        try:
            target.preflight()
        except MissingDependencyError as exc:
            rows.append(Check(f"{name}: toolchain", "will fail", exc.message, exc.hint or ""))
            continue
        out_dir = ctx.run_dir / "export" / name
        out_dir.mkdir(parents=True, exist_ok=True)
        precisions = [p for p in cfg.precisions if p in (target.config.precisions or cfg.precisions)]
        for precision in precisions:
            if precision == "fp16" and "fp32" in precisions:  # the same graph, converted: tried as fp32 (below)
                continue
            target.upstream = list(built)
            try:
                made = target.build(state, ctx, out_dir, precision)
            except Exception as exc:  # noqa: BLE001
                rows.append(failed(f"{name}.{precision}", exc))
                continue
            for artifact in made if isinstance(made, list) else [made]:
                built.append(artifact)
                rows.append(_artifact_check(artifact, target, state, ctx))
        if "fp16" in precisions and "fp32" in precisions:
            fp32 = next((r for r in rows if r.check == f"{name}.fp32"), None)
            rows.append(Check(f"{name}.fp16", fp32.status if fp32 else "ok", "not built here: the fp32 graph, converted to "
                              f"fp16; as {name}.fp32" + (f" ({fp32.status})" if fp32 else "")))
    return rows


STATUS_OF = {"built": "ok", "prepared": "will skip", "failed": "will fail"}


def _artifact_check(artifact: Any, target: Any, state: RunState, ctx: RunContext) -> Check:
    """A built artifact run in its runtime on the batch, its top-1 agreement with the torch model it came from."""
    notes = "; ".join(artifact.notes[:2])
    if artifact.status != "built":
        return Check(artifact.label, STATUS_OF.get(artifact.status, "will fail"), notes or artifact.status)
    from .runtime import open_artifact, runtimes_for

    path = ctx.run_dir / artifact.path
    if not runtimes_for(path):
        return Check(artifact.label, "ok", f"built; no runtime here to run it{'; ' + notes if notes else ''}")
    assert state.data is not None
    x = state.data.eval.x
    try:
        got = np.asarray(open_artifact(path)(as_numpy(x)))
    except Exception as exc:  # noqa: BLE001
        return failed(artifact.label, exc, TRACED_SIZES)
    module = state.handle.module if artifact.precision == "int8" else state.handle.float_module()
    with torch.no_grad():
        want = call(module.eval(), to(x, ctx.device))
    want = getattr(want, "logits", want)
    agree = float((got.reshape(len(x), -1).argmax(-1) == want.reshape(len(x), -1).argmax(-1).cpu().numpy()).mean())
    return Check(artifact.label, "ok", f"built and run: top-1 agreement with the torch model {agree:.3f} on {len(x)} samples"
                 f"{'; ' + notes if notes else ''}", figures={"top1_agreement": agree, "samples": len(x)})


#: Checks for the built-in stage types (their packages do not define ``doctor`` themselves).
BUILTIN: dict[str, Callable[[Stage, RunState, RunContext], list[Check]]] = {
    "train": _train_checks,
    "evaluate": _evaluate_checks,
    "prune": _prune_checks,
    "export": _export_checks,
}
