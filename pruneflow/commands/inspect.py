"""``pruneflow inspect``: a model's parameters, MACs and per-layer table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from pruneflow.errors import UsageError

from .app import JsonOpt, TrustCodeOpt, VerboseOpt, app, exits
from .app import handle_errors, json_line, out_console, stdout_to_stderr

@app.command(name="inspect", epilog=exits(0, 2, 3, 130))
def inspect_(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="A run directory, a checkpoint in one, a recipe, a zoo model name, an .onnx file or an OpenVINO IR (.xml; its ops counted).", show_default=False)],
    input_shape: Annotated[Optional[str], typer.Option("--input-shape", help="One sample's shape, e.g. 3,32,32.")] = None,
    recipe: Annotated[Optional[Path], typer.Option("--recipe", help="For a run folder whose model is not a zoo model: the recipe it was made with (a run folder's own recipe never names code to run).", show_default=False)] = None,
    trust_code: TrustCodeOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Show a model's parameters, MACs and a per-layer table."""
    from pruneflow.inspect import inspect_source

    with handle_errors(verbose, json_out):
        try:
            shape = tuple(int(v) for v in input_shape.split(",")) if input_shape else None
        except ValueError:
            raise UsageError(f"--input-shape {input_shape!r} is not a list of integers", hint="e.g. --input-shape 3,32,32") from None
        with stdout_to_stderr(json_out):
            info = inspect_source(source, shape, recipe, trust_code or [])
        if json_out:
            print(json_line(info))
            return
        _print_inspect(info)


def _print_inspect(info: dict) -> None:
    from pruneflow.report import fmt

    console = out_console()
    table = Table(title=f"{info['source']}  ({info['kind']})", title_justify="left")
    rows = info["layers"]
    columns = list(rows[0]) if rows else []
    for c in columns:
        table.add_column(c, justify="right" if c in ("params", "macs", "macs %", "count") else "left")
    for r in rows:  # a share is a percentage with one decimal (fmt would print 0.8 as 0.8000 and 24.6 as 24.6)
        table.add_row(*(f"{r[c]:.1f}" if c == "macs %" and isinstance(r[c], (int, float)) else fmt(r[c]) for c in columns))
    console.print(table)
    totals = ", ".join(f"{k} {fmt(v)}" for k, v in info["totals"].items())
    console.print(f"total: {totals}")

