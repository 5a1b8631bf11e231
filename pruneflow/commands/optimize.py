"""``pruneflow optimize``: run a recipe (one process, ``--nproc`` workers, or a rank under torchrun), its dry-run
plan and its summary."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pruneflow.context import Reporter
from pruneflow.errors import EXIT_OK, EXIT_STAGE_FAILED, UsageError

from .app import EPILOG, AllowPathOpt, DeviceOpt, ForOpt, for_cpus_set, JsonOpt, NprocOpt, RecipeArg, SetOpt, TrustCodeOpt, VerboseOpt, app
from .app import (RichReporter, err_console, handle_errors, json_line, out_console, print_code, sigterm_as_interrupt,
                      stdout_to_stderr)

@app.command(epilog=EPILOG)
def optimize(
    recipe: RecipeArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Parent folder of the run directory (OUT/NAME).")] = Path("runs"),
    set_: SetOpt = None,
    allow_path: AllowPathOpt = None,
    trust_code: TrustCodeOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip stages whose checkpoint matches (same input, config, versions); "
                                         "an export that runs again takes the choices the earlier run measured (delivered precision, "
                                         "INT8 form, OpenVINO hint: manifest.json `choices`), so it writes the same files.")] = False,
    retime: Annotated[bool, typer.Option("--retime", help="With --resume: measure those choices again on this host (the files "
                                         "may then differ from the earlier run's).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate, resolve stages and targets, check files and toolchains; run nothing.")] = False,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or stage lines; the summary only.")] = False,
    verbose: VerboseOpt = False,
    nproc: NprocOpt = 1,
    device: DeviceOpt = None,
    for_cpus: ForOpt = None,
) -> None:
    """Run a recipe: every stage in order, then every export, measured and reported.

    Writes OUT/NAME/ with manifest.json, metrics.json, report.md, recipe.resolved.yaml, logs/ and the
    artifacts, and prints a summary. Example:

        pruneflow optimize recipes/quickstart.yaml --out runs --set stages.0.epochs=3
    """
    from pruneflow import distributed
    from pruneflow.pipeline import plan_stages, preflight, run_recipe
    from pruneflow.recipe import load_recipe

    _debug_logging(verbose)
    with handle_errors(verbose, json_out):
        set_ = [*(set_ or []), *([for_cpus_set(for_cpus)] if for_cpus is not None else [])]  # workers get it as --set
        loaded = load_recipe(recipe, [*set_, *([f"device={device.value}"] if device else [])], allow_path or [], trust_code or [])
        distributed.check_device(loaded.recipe.device, nproc)
        if dry_run:
            with stdout_to_stderr(json_out):
                stages = plan_stages(loaded)
                notes = preflight(loaded, stages, out)
            _print_plan(loaded, stages, notes, out, json_out)
            raise typer.Exit(EXIT_OK)
        if nproc > 1 or distributed.in_worker():
            _check_distributed(resume)
        if nproc > 1 and not distributed.in_worker():
            with stdout_to_stderr(json_out):  # a recipe that cannot start fails here, once, before any worker exists
                preflight(loaded, plan_stages(loaded), out)
            args = _worker_args(recipe, out, set_, allow_path, json_out, quiet, verbose, device, trust_code)
            raise typer.Exit(distributed.launch(nproc, args, err_console().print))
        if distributed.in_worker():
            distributed.bind_to_launcher()
            raise typer.Exit(_optimize_worker(loaded, out, json_out, quiet, verbose))
        reporter = RichReporter(err_console(), quiet=quiet or json_out)
        with stdout_to_stderr(json_out), sigterm_as_interrupt():
            result = run_recipe(loaded, out=out, reporter=reporter, resume=resume, retime=retime)
        if json_out:
            print(json_line(result.as_json()))
        else:
            _print_summary(result)
        raise typer.Exit(result.exit_code)


def _debug_logging(on: bool) -> None:
    """--verbose: pruneflow's debug log on stderr."""
    if on:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
        logging.getLogger("pruneflow").setLevel(logging.DEBUG)


def _check_distributed(resume: bool) -> None:
    if resume:
        raise UsageError("--resume is not supported with --nproc > 1 or under torchrun",
                         hint="resume with one process (without --nproc), or run again without --resume")


def _worker_args(recipe, out, set_, allow_path, json_out, quiet, verbose, device, trust_code=None) -> list[str]:
    """The command line of each worker ``--nproc`` starts: this one without ``--nproc``."""
    args = ["optimize", str(recipe), "--out", str(out)]
    args += [a for item in set_ or [] for a in ("--set", item)]
    args += [a for path in allow_path or [] for a in ("--allow-path", str(path))]
    args += [a for ref in trust_code or [] for a in ("--trust-code", ref)]
    args += ["--device", device.value] if device else []
    return args + [flag for flag, on in (("--json", json_out), ("--quiet", quiet), ("--verbose", verbose)) if on]


class _SilentReporter(Reporter):
    """The reporter of ranks other than 0: rank 0 alone shows progress, stage lines and warnings."""

    def warning(self, message):
        logging.getLogger("pruneflow").debug(message)


class _ReleasingReporter(RichReporter):
    """Rank 0's reporter: when the last training stage finishes, the other ranks may stop and wait."""

    def __init__(self, console: Console, quiet: bool, release_after: str | None):
        super().__init__(console, quiet)
        self.release_after = release_after

    def stage_finished(self, stage_id, seconds, metrics, skipped=False):
        from pruneflow import distributed

        if stage_id == self.release_after:
            distributed.release()
        super().stage_finished(stage_id, seconds, metrics, skipped)


def _optimize_worker(loaded, out, json_out: bool, quiet: bool, verbose: bool) -> int:
    """One rank under torchrun: rank 0 runs the recipe into OUT, the others its training stages into a
    scratch folder; every rank ends with rank 0's exit code (``pruneflow.distributed``)."""
    from pruneflow import distributed

    distributed.init(loaded.recipe.device)
    code = EXIT_STAGE_FAILED
    try:
        with handle_errors(verbose, json_out and distributed.is_main()):
            code = _run_rank(loaded, out, json_out, quiet)
    except typer.Exit as exc:
        code = exc.exit_code
    code = distributed.finish(code)
    distributed.shutdown()
    return code


def _run_rank(loaded, out, json_out: bool, quiet: bool) -> int:
    from pruneflow import distributed
    from pruneflow.pipeline import run_recipe

    if not distributed.is_main():
        mine = distributed.worker_recipe(loaded)
        if mine is not None:
            with distributed.scratch_dir() as scratch, stdout_to_stderr(True):
                run_recipe(mine, out=scratch, reporter=_SilentReporter())
        return EXIT_OK
    last = distributed.last_training_stage_id(loaded)
    if last is None:
        distributed.release()
    reporter = _ReleasingReporter(err_console(), quiet or json_out, last)
    with stdout_to_stderr(json_out), sigterm_as_interrupt():
        result = run_recipe(loaded, out=out, reporter=reporter)
    if json_out:
        print(json_line(result.as_json()))
    else:
        _print_summary(result)
    return result.exit_code


def _plan_settings(config) -> str:
    """A stage's settings as the plan shows them: what differs from the defaults, and a list of typed entries (an
    export's targets) by type, each with its own changed settings (``targets=[onnx, tensorrt(required=True)]``; a
    plain dump showed ``targets=[{}, {}]``)."""
    full = config.model_dump(mode="json", exclude={"type", "name"})
    parts = []
    for key, value in config.model_dump(mode="json", exclude={"type", "name"}, exclude_defaults=True).items():
        typed = full.get(key)
        if isinstance(value, list) and isinstance(typed, list) and all(isinstance(t, dict) and "type" in t for t in typed):
            shown = [t["type"] + (f"({', '.join(f'{k}={v}' for k, v in c.items() if k != 'type')})"
                                  if any(k != "type" for k in c) else "") for t, c in zip(typed, value)]
            parts.append(f"{key}=[{', '.join(shown)}]")
        else:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def _print_plan(loaded, stages, notes, out, json_out) -> None:
    plan = {
        "recipe": str(loaded.file),
        "run_dir": str(Path(out) / loaded.recipe.name),
        "stages": [{"name": s.id, "type": s.config.type} for s in stages],
        "notes": notes,
        "code": [{"field": ".".join(map(str, loc)), "callable": ref, "why": why} for loc, ref, why in loaded.code],
    }
    if json_out:
        print(json_line({"exit_code": 0, "dry_run": plan}))
        return
    from rich.markup import escape

    console = out_console()
    table = Table(title=f"plan: {loaded.recipe.name} → {plan['run_dir']}")
    table.add_column("#")
    table.add_column("stage")
    table.add_column("type")
    table.add_column("settings")
    for s in stages:
        table.add_row(str(s.index + 1), s.id, s.config.type, escape(_plan_settings(s.config)))
    console.print(table)
    for note in notes:
        console.print(f"note: {note}", markup=False)
    print_code(console, loaded)
    console.print("dry run: recipe valid, stages and targets resolved, files and toolchains present. Nothing was run.")


def _print_summary(result) -> None:
    from pruneflow.report import artifact_rows, fmt, not_built_rows, stage_rows

    console = out_console()
    for title, rows in (("stages", stage_rows(result)), ("artifacts", artifact_rows(result))):
        if not rows:
            continue
        table = Table(title=title, title_justify="left")
        columns = [c for c in rows[0] if any(r.get(c) not in (None, "") for r in rows)]
        for c in columns:
            table.add_column(c, justify="right" if c not in ("stage", "type", "artifact", "status") else "left")
        for r in rows:
            table.add_row(*(fmt(r.get(c)) for c in columns))
        console.print(table)
    for row in not_built_rows(result):
        console.print(f"[yellow]{row['artifact']}: {row['status']}[/] — {row['why']}; bundle: {result.run_dir.name}/{row['folder']}")
    if result.gates:
        table = Table(title="gates", title_justify="left")
        for c in ("gate", "result", "detail"):
            table.add_column(c)
        for g in result.gates:
            table.add_row(g.name, "[green]pass[/]" if g.passed else "[bold red]FAIL[/]", g.message)
        console.print(table)
    headline = result.headline_rows()
    if headline:  # last, where the eye lands: what changed against the model the run started from
        table = Table(title=f"against the model you started from (entering {result.start['stage']})", title_justify="left")
        for c in ("", "start", "result", "change"):
            table.add_column(c, justify="left" if c in ("", "change") else "right")
        for r in headline:
            table.add_row(r["what"], r["start"], r["result"], r["change"], style="red" if r.get("slower") or r.get("fp32_faster") else "yellow" if r.get("noisy") else None)
        console.print(table)
    for note in result.baseline_notes:  # a gate on the headline that counts from another model than the table
        console.print(f"note: {note}", markup=False, highlight=False)
    # the word report.md opens with: PASSED, or the gate failure with its exit code
    verdict = "[bold green]PASSED[/]" if result.exit_code == 0 else f"[bold red]GATE FAILED[/]: a quality gate failed (exit {result.exit_code})"
    console.print(f"{verdict} — run directory: {result.run_dir}  (report.md, manifest.json, metrics.json)")
    if not result.headline_gate.get("gated", True):
        from rich.markup import escape

        console.print(f"[yellow]warning:[/] {escape(result.headline_gate['message'])}", highlight=False)

