"""What ``--resume`` reuses: each stage's resume key (the model and data it started from, its settings, tool versions
and, for a stage that times or serves named CPUs, the host and ``deploy``), a finished stage taken again from its
record and checkpoint, and the choices an earlier run made by measuring (manifest.json ``choices``)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from .artifacts import Artifact, Manifest, sha256_file, tool_versions
from .checkpoint import PickledCheckpointError, load_checkpoint
from .context import Reporter, RunContext, RunState
from .errors import PruneflowError
from .recipe import LoadedRecipe
from .results import StageRecord
from .runtime import timing_host
from .stage import Stage

log = logging.getLogger("pruneflow")


def hash_parts(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def serving_part(stage: Stage, recipe: Any) -> list[Any]:
    """What a stage that chooses for the serving hosts (``serves_hosts``: export) adds to its resume key: the recipe's
    ``deploy`` (another ``--for`` builds other files); nothing for the others."""
    return [{"deploy": recipe.deploy.model_dump(mode="json")}] if stage.serves_hosts else []


def host_part(stage: Stage) -> list[Any]:
    """What a stage whose results depend on the host (it times latency, or chooses by timing: export) adds to its
    resume key: the host it times on (``timing_host``). A ``--resume`` on another host runs such a stage again (and the
    stages after it), measuring here, instead of reusing figures and choices another machine made."""
    return [{"host": timing_host()}] if stage.times_on_host else []


def stage_key(previous: str, stage: Stage, recipe: Any) -> str:
    """The resume key of ``stage``: the key of the stage before it (or ``source_key``), its settings, the tool
    versions, and what it depends on beyond them (``serving_part``, ``host_part``)."""
    return hash_parts(previous, stage.config.model_dump(mode="json"), tool_versions(), *serving_part(stage, recipe),
                      *host_part(stage))


def source_key(loaded: LoadedRecipe) -> str:
    """Identity of the starting model and data: the input to the first stage's resume key.

    Covers the checkpoint's and a model file's content, and the data files' sizes and modification
    times (hashing gigabytes of data on every resume would cost more than it saves).
    """
    r = loaded.recipe
    ckpt = sha256_file(r.model.checkpoint) if r.model.checkpoint else None
    factory_file = r.model.factory.rsplit(":", 1)[0] if ".py:" in r.model.factory else None
    code = sha256_file(factory_file) if factory_file and Path(factory_file).is_file() else None
    data_files = [_stat(getattr(r.data, f)) for f in ("path", "train", "eval") if getattr(r.data, f)]
    return hash_parts(r.model.model_dump(mode="json"), ckpt, code, r.data.model_dump(mode="json"), data_files, r.seed,
                 r.task.model_dump(mode="json"))


def _stat(path: str) -> list:
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [(f.as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]


def hosts_before(run_dir: Path, reporter: Reporter) -> tuple[list[dict[str, Any]], bool]:
    """The hosts earlier runs in ``run_dir`` ran on, and whether the last one is not this one (``timing_host``): said,
    and kept in the manifest (``earlier_hosts``) rather than silently replaced. What depends on the host is then
    measured again here: the stages that time or choose by timing run again (``host_part``; their resume key holds the
    host too), and the export's choices with them."""
    try:
        found = json.loads((run_dir / Manifest.FILE).read_text())
    except (OSError, ValueError):
        return [], False
    host = found.get("host") if isinstance(found, dict) else None
    before = [h for h in found.get("earlier_hosts") or [] if isinstance(h, dict)] if isinstance(found, dict) else []
    if not isinstance(host, dict) or timing_host(host) == timing_host():
        return before, False
    was, now = timing_host(host), timing_host()
    changed = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in now if was.get(k) != now.get(k))
    reporter.warning(f"--resume on another host ({changed}): the stages that time latency or choose by timing (export) run "
                     "again and measure here; the stages that do not depend on the host are reused. manifest.json keeps "
                     "the earlier host under `earlier_hosts`")
    return [*before, host], True


def earlier_choices(run_dir: Path) -> dict[str, Any]:
    """The ``choices`` of the manifest an earlier run left in ``run_dir`` ({} when there is none to read)."""
    try:
        found = json.loads((run_dir / Manifest.FILE).read_text()).get("choices")
    except (OSError, ValueError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}


def recorded_for(stage: Stage, key: str, earlier: dict[str, Any]) -> dict[str, Any] | None:
    """What an earlier run of ``stage`` chose by measuring, when it ran with the same resume key (same model, settings
    and tool versions); None otherwise: the stage measures."""
    found = earlier.get(stage.id)
    return found if isinstance(found, dict) and found.get("key") == key else None


def keep_choices(manifest: Manifest, stage: Stage | None, key: str) -> None:
    """The choices ``stage`` made (its ``choices``, when it has any) into the manifest, under its id, with its key."""
    made = stage.choices if stage is not None else None
    if stage is not None and isinstance(made, dict) and made.get("targets"):
        manifest.choices[stage.id] = {"key": key, **made}


def resume_stage(stage: Stage, key: str, state: RunState, ctx: RunContext, manifest: Manifest) -> StageRecord | None:
    """Reuse a completed stage whose key matches and whose files are intact; None to run it again."""
    stage_file = ctx.run_dir / "stages" / f"{stage.index + 1:02d}-{stage.id}" / "stage.json"
    if not stage_file.is_file():
        return None
    try:
        saved = json.loads(stage_file.read_text())
    except ValueError:
        return None
    if saved.get("key") != key or saved.get("status") != "done" or not isinstance(saved.get("files"), list):
        return None
    try:
        artifacts = [Artifact.from_record(a) for a in saved.get("artifact_records", [])]
    except (TypeError, ValueError):  # a record of a layout this version does not write: run the stage again
        return None
    if not all(a.verify(ctx.run_dir) for a in artifacts):
        return None
    checkpoint = next((a for a in artifacts if a.kind == "checkpoint"), None)
    if stage.modifies_model and checkpoint is None:
        return None
    if checkpoint is not None:
        try:
            # The structure is applied to (a copy of) the float model in hand: the recipe's, or an earlier stage's.
            loaded = load_checkpoint(ctx.run_dir / checkpoint.path, into=state.handle.float_module())
        except PickledCheckpointError as exc:
            # Its sha256 matches the run's records, so they were edited to vouch for it: stop, load nothing.
            raise PickledCheckpointError(f"--resume: {exc.message}; {stage_file} records this file's sha256, so the "
                                         "run folder was altered after the run", hint="run without --resume (the folder "
                                         "is replaced), or use a run folder you made yourself") from exc
        except (PruneflowError, RuntimeError, ValueError, OSError) as exc:
            log.warning("stage %s: checkpoint not reusable (%s); running the stage again", stage.id, exc)
            return None
        state.handle = loaded.to(ctx.device)
        state.model_artifact = checkpoint
    try:
        stage.restore(state, ctx)
    except (PruneflowError, ValueError, OSError) as exc:
        log.warning("stage %s: saved results not reusable (%s); running the stage again", stage.id, exc)
        return None
    record = StageRecord(saved["id"], saved["type"], saved["index"], saved["seconds"], saved["metrics"], key,
                         resumed=True, artifacts=saved.get("artifacts", []), tables=saved.get("tables", {}),
                         gates=saved.get("gates", []), files=saved["files"])
    manifest.add_stage(record.as_dict(), artifacts)
    state.artifacts.extend(artifacts)
    ctx.reporter.stage_finished(stage.id, 0.0, record.metrics, skipped=True)
    return record
