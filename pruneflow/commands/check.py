"""``pruneflow validate`` and ``pruneflow doctor``: a recipe checked without running it, then tried on one batch."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from .app import AllowPathOpt, ForOpt, JsonOpt, RecipeArg, SetOpt, TrustCodeOpt, VerboseOpt, app, exits, for_cpus_set
from .app import RichReporter, err_console, handle_errors, json_line, out_console, print_code, stdout_to_stderr

@app.command(epilog=exits(0, 2, 3, 130))
def validate(
    recipe: RecipeArg,
    set_: SetOpt = None,
    allow_path: AllowPathOpt = None,
    trust_code: TrustCodeOpt = None,
    show: Annotated[bool, typer.Option("--show", help="Print the resolved recipe (defaults filled in, paths absolute).")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Check a recipe without running it: keys, types, ranges, stage types and targets; that every file it
    names exists (data, checkpoint, factory file); that model.factory is defined there (the file is parsed,
    never imported: validate runs none of your code); and each target's toolchain (`required: true` without
    it fails here). What only a run can tell (the model builds, the data loads) is `pruneflow doctor`'s job.

    Each problem is printed as `FILE:LINE  key.path  value  message`.
    """
    from pruneflow.pipeline import plan_stages, preflight
    from pruneflow.recipe import dump_recipe, load_recipe

    with handle_errors(verbose):
        loaded = load_recipe(recipe, set_ or [], allow_path or [], trust_code or [])
        stages = plan_stages(loaded)
        notes = preflight(loaded, stages, None)
        console = out_console()
        if show:
            console.print(dump_recipe(loaded.recipe), markup=False)
        names = ", ".join(f"{s.id} ({s.config.type})" for s in stages)
        console.print(f"[green]✓[/] {recipe}: valid — {len(stages)} stages: {names}")
        for note in notes:
            console.print(f"  note: {note}", markup=False)
        print_code(console, loaded, "  ")
        console.print("  not checked: the model is not built and the data not read (run `pruneflow doctor` for that)",
                      markup=False)


@app.command(epilog=exits(0, 1, 2, 3, 130, _1="a check will fail"))
def doctor(
    recipe: RecipeArg,
    set_: SetOpt = None,
    for_cpus: ForOpt = None,
    allow_path: AllowPathOpt = None,
    trust_code: TrustCodeOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Try every stage on the loaded model and one batch, in seconds, before a long run: what will work, what
    will be skipped here and what will fail, with why and the fix.

    Exit 0: everything will work · 1: something will fail · 2: the recipe, its files, model or data are refused.

        pruneflow doctor recipe.yaml
        pruneflow doctor recipe.yaml --for avx2      # the INT8 forms `optimize --for avx2` will build
    """
    from pruneflow.doctor import run_doctor
    from pruneflow.recipe import load_recipe

    with handle_errors(verbose, json_out):
        set_ = [*(set_ or []), *([for_cpus_set(for_cpus)] if for_cpus is not None else [])]
        loaded = load_recipe(recipe, set_, allow_path or [], trust_code or [])
        with stdout_to_stderr(json_out):
            report = run_doctor(loaded, RichReporter(err_console(), quiet=json_out))
        if json_out:
            print(json_line(report.as_json()))
        else:
            _print_doctor(report)
        raise typer.Exit(report.exit_code)


def _print_doctor(report) -> None:
    console = out_console()
    table = Table(title=f"doctor: {report.recipe}", title_justify="left")
    for column in ("stage / target", "check", "status", "why", "fix"):
        table.add_column(column, overflow="fold")
    style = {"ok": "green", "will skip": "yellow", "will fail": "bold red"}
    for r in report.rows:
        table.add_row(r.where, r.check, f"[{style[r.status]}]{r.status}[/]", r.why, r.fix)
    console.print(table)
    failing = sum(r.status == "will fail" for r in report.rows)
    skipping = sum(r.status == "will skip" for r in report.rows)
    verdict = f"[bold red]{failing} check(s) will fail[/]" if failing else "[bold green]everything will work[/]"
    if skipping:
        verdict += f"; [yellow]{skipping} will skip or fall back[/] (see the table)"
    console.print(f"{verdict} ({report.seconds:.1f}s)")
    if report.slow:
        console.print(f"[yellow]note:[/] doctor {report.slow}")

