"""``pruneflow calibrate``: a calibration set built outside a recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import JsonOpt, VerboseOpt, app, exits
from .app import err_console, handle_errors, out_console

@app.command(name="calibrate", epilog=exits(0, 2, 3, 4, 130))
def calibrate_cmd(
    source: Annotated[Path, typer.Argument(metavar="SOURCE", help="A local source: .jsonl/.json, .csv, .parquet, .npz, an image folder, or a save_to_disk folder.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the set to (a datasets folder plus calibration.json).")],
    size: Annotated[int, typer.Option("--size", help="Samples to choose.")] = 512,
    strategy: Annotated[str, typer.Option("--strategy", help="random | stratified | diverse")] = "diverse",
    by: Annotated[str, typer.Option("--by", help="stratified: the label, or any column.")] = "label",
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**32 - 1, help="Sampling seed.")] = 0,
    recipe: Annotated[Optional[Path], typer.Option("--recipe", help="Borrow this recipe's preprocessing (scale, mean/std, tokenizer) and model (features for diverse).")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", help="Source format when the suffix does not tell.")] = None,
    input_column: Annotated[Optional[str], typer.Option("--input-column", help="Column holding the input.")] = None,
    label_column: Annotated[Optional[str], typer.Option("--label-column", help="Column holding labels, if any.")] = None,
    amct: Annotated[bool, typer.Option("--amct", help="Also write Ascend AMCT .bin files and a list.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Build a calibration set outside a recipe, e.g. from inputs logged in production.

        pruneflow calibrate logs/requests.jsonl --out calib --size 512 --strategy diverse
    """
    with handle_errors(verbose, json_out):
        from pruneflow.calibrate.source import calibrate_source

        info = calibrate_source(source, out, size=size, strategy=strategy, by=by, seed=seed, recipe=recipe, fmt=fmt,
                                input_column=input_column, label_column=label_column, amct=amct,
                                warn=lambda m: err_console().print(f"[yellow]warning:[/] {m}"))
        if json_out:
            print(json.dumps({"exit_code": 0, "calibration": {k: v for k, v in info.items() if k != "indices"}}, default=str))
            return
        console = out_console()
        console.print(f"[green]✓[/] wrote {info['count']} samples to {out} (fingerprint {info['fingerprint'][:16]}, "
                      f"strategy {info['strategy']}, {info['duplicates_removed']} duplicates removed)")
        if info.get("histogram"):
            console.print("per class: " + ", ".join(f"{k}: {v}" for k, v in info["histogram"].items()))

