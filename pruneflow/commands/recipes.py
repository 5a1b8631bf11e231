"""``pruneflow schema`` and ``pruneflow init``: the recipe format's JSON schema and a starting recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from pruneflow.errors import EXIT_OK

from .app import VerboseOpt, app, exits
from .app import err_console, handle_errors, out_console

@app.command(epilog=exits(0, 2))
def schema(
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to this file instead of stdout.")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Print the JSON schema of the recipe format (for editor completion).

    VS Code (YAML extension): put `# yaml-language-server: $schema=recipe.schema.json` at the top of a recipe.
    """
    from pruneflow.artifacts import write_text_atomic
    from pruneflow.recipe import json_schema

    with handle_errors(verbose):
        text = json.dumps(json_schema(), indent=2)
        if out:
            write_text_atomic(out, text + "\n")
            err_console().print(f"wrote {out}")
        else:
            print(text)


@app.command(epilog=exits(0, 2))
def init(
    template: Annotated[str, typer.Argument(metavar="TEMPLATE", help="Template name (see --list).")] = "quickstart",
    path: Annotated[Optional[str], typer.Argument(metavar="PATH", help="Where to write it: a file, or a folder (ending in /) to hold TEMPLATE.yaml (default: ./TEMPLATE.yaml).", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    list_: Annotated[bool, typer.Option("--list", help="List the templates and exit.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Write a starting recipe from a template (the example recipes shipped with pruneflow)."""
    from pruneflow.recipe.templates import template_summaries, write_template

    with handle_errors(verbose):
        console = out_console()
        if list_:
            for name, summary in template_summaries().items():
                console.print(f"{name:24s} {summary}")
            raise typer.Exit(EXIT_OK)
        written = write_template(template, path, force=force)
        console.print(f"wrote {written.path}; next: pruneflow validate {written.path} && pruneflow optimize {written.path}")
        for note in written.notes:
            console.print(f"note: {note}")

