"""`pruneflow doctor` for the export stage (``ExportStage.doctor``): every target and precision built for real into
doctor's temporary folder from the model the stages before would hand over, then run in its runtime on one batch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..artifacts import Artifact
from ..doctor import TRACED_SIZES
from ..errors import MissingDependencyError
from ..inputs import as_numpy, call, to
from ..runtime import open_artifact, runtimes_for
from ..stage import BuildInputs, Check
from .export_hosts import form_choice, pinned


def export_checks(stage, state, ctx) -> list[Check]:
    """Every target and precision built for real into the temporary folder, then run in its runtime on one batch."""
    cfg = stage.config
    rows: list[Check] = []
    built: list = []
    for name, made_target in stage.make_targets():
        # the `auto` settings the serving CPUs decide, pinned as the run pins them: doctor names the form the run builds
        target, pins = pinned(name, made_target, {}, ctx.recipe.deploy.cpu)
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
            try:
                made = target.build(state, ctx, out_dir, precision, BuildInputs(upstream=list(built),
                                                                                onnx_export=stage.onnx_export()))
            except Exception as exc:  # noqa: BLE001
                rows.append(Check.failed(f"{name}.{precision}", exc))
                continue
            for artifact in made if isinstance(made, list) else [made]:
                if artifact.status == "built":
                    form_choice(name, pins, artifact, {}, None, None)
                built.append(artifact)
                rows.append(artifact_check(artifact, state, ctx))
        if "fp16" in precisions and "fp32" in precisions:
            fp32 = next((r for r in rows if r.check == f"{name}.fp32"), None)
            rows.append(Check(f"{name}.fp16", fp32.status if fp32 else "ok", "not built here: the fp32 graph, converted to "
                              f"fp16; as {name}.fp32" + (f" ({fp32.status})" if fp32 else "")))
    return rows


STATUS_OF = {"built": "ok", "prepared": "will skip", "failed": "will fail"}


def artifact_check(artifact: Artifact, state, ctx) -> Check:
    """A built artifact run in its runtime on the batch, its agreement (the task's figure: top-1 agreement for classes)
    with the torch model it came from."""
    notes = "; ".join(artifact.notes[:2])
    if artifact.status != "built":
        fix = (f"none needed here: the run writes the bundle to {artifact.path}/ with its README; build it where "
               f"{artifact.target}'s toolchain exists, or set `required: true` to make its absence an error"
               if artifact.status == "prepared" else "see why; the run marks this artifact failed (exit 1)")
        return Check(artifact.label, STATUS_OF.get(artifact.status, "will fail"), notes or artifact.status, fix)
    path = ctx.run_dir / artifact.path
    if not runtimes_for(path):
        return Check(artifact.label, "ok", f"built; no runtime here to run it{'; ' + notes if notes else ''}")
    assert state.data is not None
    x = state.data.eval.x
    try:
        got = np.asarray(open_artifact(path)(as_numpy(x)))
    except Exception as exc:  # noqa: BLE001
        return Check.failed(artifact.label, exc, TRACED_SIZES)
    module = state.handle.module if artifact.precision == "int8" else state.handle.float_module()
    with torch.no_grad():
        want = state.task.output(call(module.eval(), to(x, ctx.device))).float().cpu().numpy()
    task = state.task
    agree = float(task.agree(want, got.reshape(want.shape).astype(np.float32))[task.agreement.name])
    shown = task.agreement.shown
    return Check(artifact.label, "ok", f"built and run: {shown} with the torch model {agree:.3f} on {len(x)} samples"
                 f"{'; ' + notes if notes else ''}", figures={task.agreement.name: agree, "samples": len(x)})
