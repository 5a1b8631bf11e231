"""The Typer app, its exit-code epilogs and the option types every command group shares (declared once)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core

from pruneflow import __version__
from pruneflow.errors import EXIT_OK

#: What each exit code means (pruneflow/errors.py); a command's --help lists those it can return (``exits``).
EXIT_WORDS = {0: "ok", 1: "a quality gate failed", 2: "invalid recipe or usage", 3: "missing dependency or unavailable target",
              4: "a stage or export failed", 130: "interrupted"}


def exits(*codes: int, **words: str) -> str:
    """The --help epilog naming the exit codes a command can return, ``words`` (``_1="..."``) rewording one."""
    return "Exit codes: " + " · ".join(f"{c} {words.get(f'_{c}', EXIT_WORDS[c])}" for c in codes) + "."


EPILOG = exits(0, 1, 2, 3, 4, 130)


def _plain_metavar(param, ctx) -> str | None:
    """The value placeholder shown in --help, as click shows it: none after a flag, PATH, N, X, TEXT or the choices.
    typer 0.2x prints the Python annotation there instead (``--resume <bool>``, ``--set <list[str]>``)."""
    if param.metavar is not None:
        return param.metavar
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    if isinstance(param, typer.core.TyperArgument):
        return (param.name or "value").upper()
    desc = param.type_descriptor
    if desc.is_choice:
        return "[" + "|".join(str(getattr(c, "value", c)) for c in desc.choices or ()) + "]"
    if desc.is_path:
        return "PATH"
    bare = param.bare_type().removeprefix("list[").removesuffix("]")
    return {"int": "N", "float": "X", "str": "TEXT"}.get(bare, bare.upper())


for _param_class in (typer.core.TyperOption, typer.core.TyperArgument):
    _param_class.display_type_rich = _plain_metavar  # type: ignore[method-assign, assignment]

app = typer.Typer(
    name="pruneflow",
    help="Turn a trained PyTorch model into smaller, faster, deployable artifacts.\n\n"
    "Write a YAML recipe (start with `pruneflow init`), check it with `pruneflow validate`, "
    "run it with `pruneflow optimize`.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)

RecipeArg = Annotated[Path, typer.Argument(metavar="RECIPE", help="Recipe file (YAML).", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a recipe value: KEY.PATH=VALUE, e.g. stages.0.epochs=3 (repeatable).",
                 show_default=False),
]
AllowPathOpt = Annotated[
    Optional[list[Path]],
    typer.Option("--allow-path", metavar="DIR", help="Let `extends` read recipes under this folder too (repeatable); by default it reads "
                 "only the recipe's own folder tree and the shipped templates.", show_default=False),
]
TrustCodeOpt = Annotated[
    Optional[list[str]],
    typer.Option("--trust-code", metavar="MODULE:FUNCTION", help="Let the recipe run this callable though it is neither "
                 "the zoo's nor a file in the recipe's folder, e.g. torchvision.models:resnet18 (repeatable); the "
                 "recipe's `trust.code` list does the same.", show_default=False),
]
NprocOpt = Annotated[int, typer.Option(
    "--nproc", min=1, max=4096, help="Train on N local processes with PyTorch DistributedDataParallel (gloo on CPU, nccl with "
    "--device cuda), started by torch's elastic launcher; rank 0 writes the run. Multi-node: torchrun -m pruneflow.")]
class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


DeviceOpt = Annotated[Optional[Device], typer.Option(
    "--device", help="Override the recipe's `device`; cuda where "
    "there is none is exit 3 before any work.", show_default=False)]
ForOpt = Annotated[Optional[str], typer.Option(
    "--for", metavar="CPU[,CPU...]",
    help="The CPUs the artifacts will be served on (replaces the recipe's `deploy.cpu`): avx2, avx512_vnni, avx_vnni, "
         "avx512_bf16, amx_int8, asimd, ... (+ joins flags of one CPU). The INT8 form and OpenVINO's hint are chosen "
         "for every one (a form needing VNNI only when all have it). Left out: the recipe's, else artifacts exact on "
         "every CPU.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks and debug logging.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (for CI) instead of tables.")]


def _version(value: bool) -> None:
    if value:
        print(f"pruneflow {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    pass
