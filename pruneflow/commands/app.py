"""The Typer app and what every command shares: the option types (declared once), the consoles, the one
exception → message → exit-code table, signals, stdout under --json, the JSON lines and the progress reporter.
The command modules beside it register their commands on ``app``; ``cli.py`` (installed as ``pruneflow.cli``)
imports them in the order ``--help`` lists them, and is what runs."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from pruneflow import __version__
from pruneflow.context import Reporter
from pruneflow.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_STAGE_FAILED, PruneflowError, RecipeError, UsageError

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


def for_cpus_set(text: str) -> str:
    """``--for avx2,avx512_vnni`` as the ``--set`` it stands for; UsageError naming the known CPUs."""
    from pruneflow.recipe.cpus import normalise

    try:
        return "deploy.cpu=" + json.dumps(normalise(text))
    except ValueError as exc:
        raise UsageError(f"--for {text!r}: {exc}", hint="e.g. --for avx2,avx512_vnni") from None


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


# ---------------------------------------------------------------- what every command shares at run time

def err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


class _ReaderGone(Exception):
    """stdout's reader closed the pipe (``pruneflow ... | head -1``): not an error of the command's."""


def _quiet_stdout() -> None:
    """Nothing more is written to stdout's closed pipe, at exit included."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class _PipeConsole(Console):
    def on_broken_pipe(self) -> None:  # rich's own handling raises SystemExit(1), which read as user code exiting
        _quiet_stdout()
        raise _ReaderGone()


def out_console() -> Console:
    console = _PipeConsole(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # CI logs and pipes: wide enough that tables do not wrap
        console = _PipeConsole(highlight=False, soft_wrap=True, width=max(console.width, 140))
    return console


@contextlib.contextmanager
def handle_errors(verbose: bool, json_mode: bool = False) -> Iterator[None]:
    """The one mapping from exceptions to messages and exit codes."""
    err = err_console()
    try:
        yield
    except typer.Exit:
        raise
    except _ReaderGone:  # what the reader wanted it read; the command did its work (as `yes | head -1` does)
        raise typer.Exit(EXIT_OK) from None
    except BrokenPipeError:  # the same, from a plain print (`pruneflow schema | head`)
        _quiet_stdout()
        raise typer.Exit(EXIT_OK) from None
    except PruneflowError as exc:
        _print_error(err, exc, verbose)
        issues = [i.as_dict() for i in exc.issues] if isinstance(exc, RecipeError) else None
        caught: BaseException = exc
        failure = (exc.exit_code, type(exc).__name__, exc.message, exc.hint, issues)
    except KeyboardInterrupt as exc:
        what = f"terminated ({exc.signal_name})" if isinstance(exc, Terminated) else "interrupted"
        err.print(f"[bold yellow]{what}[/]: finished stages are kept; run again with --resume to continue.")
        caught = exc
        failure = (EXIT_INTERRUPTED, type(exc).__name__, what, None, None)
    except SystemExit as exc:  # code we called (a plugin, user code) exited instead of raising
        err.print(f"[bold red]stage failed:[/] code run by pruneflow called sys.exit({exc.code!r})", markup=True)
        caught = exc
        failure = (EXIT_STAGE_FAILED, "SystemExit", f"code run by pruneflow called sys.exit({exc.code!r})",
                   "raise an exception instead of calling sys.exit", None)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a message, not a traceback
        _print_internal_error(err, exc, verbose)
        caught = exc
        failure = (EXIT_STAGE_FAILED, type(exc).__name__, str(exc), None, None)
    else:
        return
    partial = partial_of(caught)
    if partial is not None and not json_mode:
        err.print(f"the stages that finished and the error: {partial.run_dir / 'report.md'} (log: "
                  f"{partial.run_dir / 'logs' / 'pruneflow.log'})", markup=False)
    if json_mode:
        print(error_json(*failure, run=partial.as_json() if partial is not None else None))
    raise typer.Exit(failure[0])


def partial_of(exc: BaseException):
    """The finished part of a run that ``exc`` stopped (``pruneflow.results.partial_run``), or None."""
    from pruneflow.results import partial_run

    return partial_run(exc)


class Terminated(KeyboardInterrupt):
    """SIGTERM (CI cancellation, ``docker stop``) or SIGHUP (the terminal or ssh session closed), raised where the run
    is, so it stops like Ctrl-C: manifest ``interrupted``, exit 130, a message, ``--resume`` picks up."""

    def __init__(self, signal_name: str = "SIGTERM"):
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` (in the main thread; elsewhere signals cannot be
    set). SIGHUP ended a run with no message and left its manifest `running` (issue 41)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    caught = [signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {sig: signal.signal(sig, terminate) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """Under --json, stdout carries one JSON object: while the pipeline runs, whatever else writes there
    (a factory's print, NNCF's INFO log handler bound to stdout, a C library) goes to stderr instead."""
    if not active:
        yield
        return
    import logging
    import os

    original = sys.stdout
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    moved = [(h, h.stream) for lg in loggers for h in lg.handlers
             if type(h) is logging.StreamHandler and h.stream in (original, sys.__stdout__)]
    for handler, _ in moved:
        handler.setStream(sys.stderr)
    saved_fd = _redirect_fd1()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        for handler, stream in moved:
            handler.setStream(stream)


def _redirect_fd1() -> int | None:
    """Point file descriptor 1 at 2 (for output below Python); the saved descriptor, or None when stdout
    is not descriptor 1 (under a test runner)."""
    import os

    try:
        if sys.stdout.fileno() != 1:
            return None
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(sys.stderr.fileno(), 1)
        return saved
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


def json_line(payload: object) -> str:
    """Strict JSON (RFC 8259) on one line: NaN and infinities become null, as strict parsers require."""
    from pruneflow.artifacts import finite

    return json.dumps(finite(payload), default=str, allow_nan=False)


def error_json(exit_code: int, type_name: str, message: str, hint: str | None = None,
               issues: list[dict] | None = None, run: dict | None = None) -> str:
    """The `--json` error object, built in one place so every failure reads the same to CI.

    ``{"exit_code": N, "error": {"type", "message", "hint", "issues"?}}`` (the README's contract):
    ``issues`` only for a recipe error, one per location. ``run``: when a run folder was made before the
    failure, what ``optimize --json`` prints for a run (``run_dir``, ``stages`` with the metrics of those that
    finished, ``artifacts``, ``gates``) is merged in.
    """
    error: dict = {"type": type_name, "message": message, "hint": hint}
    if issues is not None:
        error["issues"] = issues
    return json_line({**(run or {}), "exit_code": exit_code, "error": error})


def _print_error(err: Console, exc: PruneflowError, verbose: bool) -> None:
    """Our own errors: title, message, one line per recipe issue, and the fix; a traceback only with -v."""
    if verbose:
        err.print(traceback.format_exc(), markup=False)
    err.print(f"[bold red]{exc.title}:[/] ", end="")
    err.print(exc.message, markup=False)
    if isinstance(exc, RecipeError):
        for issue in exc.issues:
            err.print(issue.format(), markup=False)
    if exc.hint:
        err.print("[bold]Fix:[/] ", end="")
        err.print(exc.hint, markup=False)


def _print_internal_error(err: Console, exc: Exception, verbose: bool) -> None:
    """A bug (not a user error): one line naming it, and how to get the traceback for a report."""
    if verbose:
        err.print(traceback.format_exc(), markup=False)
    err.print(f"[bold red]internal error:[/] {type(exc).__name__}: ", end="")
    err.print(str(exc), markup=False)
    if not verbose:
        err.print("Run again with -v for the traceback, and please report it.")


class RichReporter(Reporter):
    """Progress bars and stage lines on stderr; silent with --quiet/--json."""

    def __init__(self, console: Console, quiet: bool):
        self.console = console
        self.quiet = quiet
        self.headline = ""  # the task's headline metric, shown on each stage's line (run_started)

    @contextlib.contextmanager
    def progress(self, description, total):
        if self.quiet or not self.console.is_terminal:
            yield lambda n=1, **fields: None
            return
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total, info="")

            def advance(n=1, **fields):
                info = " ".join(f"{k} {v}" for k, v in fields.items())
                bar.update(task, advance=n, info=info)

            yield advance

    def stage_started(self, stage_id, stage_type, index, total):
        super().stage_started(stage_id, stage_type, index, total)
        if not self.quiet:
            self.console.print(f"[bold cyan]▶ {index + 1}/{total} {stage_id}[/] [dim]({stage_type})[/]")

    def run_started(self, name, task):
        super().run_started(name, task)
        self.headline = task.get("headline", "")

    def stage_finished(self, stage_id, seconds, metrics, skipped=False):
        super().stage_finished(stage_id, seconds, metrics, skipped)
        if not self.quiet:
            shown_keys = (self.headline, "macs", "params")
            shown = ", ".join(f"{k} {_fmt(v)}" for k, v in metrics.items() if k in shown_keys)
            how = "resumed from checkpoint" if skipped else f"{seconds:.1f}s"
            self.console.print(f"  [green]✓[/] {stage_id} [dim]{how}[/] {shown}")

    def info(self, message):
        super().info(message)

    def warning(self, message):
        super().warning(message)
        if not self.quiet:
            self.console.print(f"[yellow]warning:[/] {message}", markup=True)


def _fmt(value) -> str:
    from pruneflow.report import fmt

    return fmt(value)


def print_code(console: Console, loaded, indent: str = "") -> None:
    """One line per callable the recipe runs beyond the zoo, and why it may (``recipe/code.py``)."""
    for loc, ref, why in loaded.code:
        console.print(f"{indent}this recipe runs code: {ref} ({'.'.join(map(str, loc))}; {why})", markup=False)

