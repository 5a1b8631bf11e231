"""The `pruneflow` command line (Typer + Rich).

Parse → call one library function → render. This module owns the console, the error → message →
exit-code table, and --json/--quiet/-v.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from rich.table import Table

from pruneflow import __version__
from pruneflow.context import Reporter
from pruneflow.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STAGE_FAILED,
    PruneflowError,
    RecipeError,
    UsageError,
)

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


def _err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


class _ReaderGone(Exception):
    """stdout's reader closed the pipe (``pruneflow ... | head -1``): not an error of the command's."""


class _PipeConsole(Console):
    def on_broken_pipe(self) -> None:  # rich's own handling raises SystemExit(1), which read as user code exiting
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more is written to the closed pipe, at exit included
        raise _ReaderGone()


def _out_console() -> Console:
    console = _PipeConsole(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # CI logs and pipes: wide enough that tables do not wrap
        console = _PipeConsole(highlight=False, soft_wrap=True, width=max(console.width, 140))
    return console


@contextlib.contextmanager
def handle_errors(verbose: bool, json_mode: bool = False) -> Iterator[None]:
    """The one mapping from exceptions to messages and exit codes."""
    err = _err_console()
    try:
        yield
    except typer.Exit:
        raise
    except _ReaderGone:  # what the reader wanted it read; the command did its work (as `yes | head -1` does)
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


def _version(value: bool) -> None:
    if value:
        print(f"pruneflow {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    pass


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
        set_ = [*(set_ or []), *([_for_cpus(for_cpus)] if for_cpus is not None else [])]  # workers get it as --set
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
            raise typer.Exit(distributed.launch(nproc, args, _err_console().print))
        if distributed.in_worker():
            distributed.bind_to_launcher()
            raise typer.Exit(_optimize_worker(loaded, out, json_out, quiet, verbose))
        reporter = RichReporter(_err_console(), quiet=quiet or json_out)
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


def _for_cpus(text: str) -> str:
    """``--for avx2,avx512_vnni`` as the ``--set`` it stands for; UsageError naming the known CPUs."""
    from pruneflow.recipe.cpus import normalise

    try:
        return "deploy.cpu=" + json.dumps(normalise(text))
    except ValueError as exc:
        raise UsageError(f"--for {text!r}: {exc}", hint="e.g. --for avx2,avx512_vnni") from None


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
    reporter = _ReleasingReporter(_err_console(), quiet or json_out, last)
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

    console = _out_console()
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
    _print_code(console, loaded)
    console.print("dry run: recipe valid, stages and targets resolved, files and toolchains present. Nothing was run.")


def _print_summary(result) -> None:
    from pruneflow.report import artifact_rows, fmt, not_built_rows, stage_rows

    console = _out_console()
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
    verdict = "[bold green]done[/]" if result.exit_code == 0 else f"[bold red]quality gate failed[/] (exit {result.exit_code})"
    console.print(f"{verdict} — run directory: {result.run_dir}  (report.md, manifest.json, metrics.json)")
    if not result.headline_gate.get("gated", True):
        from rich.markup import escape

        console.print(f"[yellow]warning:[/] {escape(result.headline_gate['message'])}", highlight=False)


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
        console = _out_console()
        if show:
            console.print(dump_recipe(loaded.recipe), markup=False)
        names = ", ".join(f"{s.id} ({s.config.type})" for s in stages)
        console.print(f"[green]✓[/] {recipe}: valid — {len(stages)} stages: {names}")
        for note in notes:
            console.print(f"  note: {note}", markup=False)
        _print_code(console, loaded, "  ")
        console.print("  not checked: the model is not built and the data not read (run `pruneflow doctor` for that)",
                      markup=False)


def _print_code(console: Console, loaded, indent: str = "") -> None:
    """One line per callable the recipe runs beyond the zoo, and why it may (``recipe/code.py``)."""
    for loc, ref, why in loaded.code:
        console.print(f"{indent}this recipe runs code: {ref} ({'.'.join(map(str, loc))}; {why})", markup=False)


@app.command(epilog=exits(0, 1, 2, 3, 130, _1="a check will fail"))
def doctor(
    recipe: RecipeArg,
    set_: SetOpt = None,
    allow_path: AllowPathOpt = None,
    trust_code: TrustCodeOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Try every stage on the loaded model and one batch, in seconds, before a long run: what will work, what
    will be skipped here and what will fail, with why and the fix.

    Exit 0: everything will work · 1: something will fail · 2: the recipe, its files, model or data are refused.

        pruneflow doctor recipe.yaml
    """
    from pruneflow.doctor import run_doctor
    from pruneflow.recipe import load_recipe

    with handle_errors(verbose, json_out):
        loaded = load_recipe(recipe, set_ or [], allow_path or [], trust_code or [])
        with stdout_to_stderr(json_out):
            report = run_doctor(loaded, RichReporter(_err_console(), quiet=json_out))
        if json_out:
            print(json_line(report.as_json()))
        else:
            _print_doctor(report)
        raise typer.Exit(report.exit_code)


def _print_doctor(report) -> None:
    console = _out_console()
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
            _err_console().print(f"wrote {out}")
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
        console = _out_console()
        if list_:
            for name, summary in template_summaries().items():
                console.print(f"{name:24s} {summary}")
            raise typer.Exit(EXIT_OK)
        written = write_template(template, path, force=force)
        console.print(f"wrote {written.path}; next: pruneflow validate {written.path} && pruneflow optimize {written.path}")
        for note in written.notes:
            console.print(f"note: {note}")


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
                                warn=lambda m: _err_console().print(f"[yellow]warning:[/] {m}"))
        if json_out:
            print(json.dumps({"exit_code": 0, "calibration": {k: v for k, v in info.items() if k != "indices"}}, default=str))
            return
        console = _out_console()
        console.print(f"[green]✓[/] wrote {info['count']} samples to {out} (fingerprint {info['fingerprint'][:16]}, "
                      f"strategy {info['strategy']}, {info['duplicates_removed']} duplicates removed)")
        if info.get("histogram"):
            console.print("per class: " + ", ".join(f"{k}: {v}" for k, v in info["histogram"].items()))


@app.command(name="inspect", epilog=exits(0, 2, 3, 130))
def inspect_(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="A run directory, a checkpoint in one, a recipe, a zoo model name, or an .onnx file.", show_default=False)],
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

    console = _out_console()
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


def _print_budget(console: Console, result) -> None:
    """The best batch under --p99-budget-ms per artifact and runtime, with throughput per core and, given a price,
    the cost per million inferences (on the cores the lane used), and what to know about each (NOISY, a low-confidence
    p99, the largest batch timed); the line of exit 1 when nothing meets the budget."""
    from rich.markup import escape

    from pruneflow.benchmark.html import entry_note, nothing_meets

    chosen = result.under_budget()
    if not chosen:
        return
    table = Table(title=f"best batch with p99 within {result.settings.p99_budget_ms:g} ms", title_justify="left")
    priced = result.settings.price_per_hour is not None
    for c in ("artifact", "runtime", "batch", "p99 ms", "samples/s", "per core", *(["cost / 1M"] if priced else []), "note"):
        table.add_column(c, justify="left" if c in ("artifact", "runtime", "note") else "right")
    for e in (e for e in chosen if e["batch"] is not None):
        cost = [f"{e['cost_per_million']:.4g}"] if priced else []
        table.add_row(*(escape(c) for c in (e["variant"], e["runtime_label"], str(e["batch"]), f"{e['p99_ms']:.3g}",
                                            f"{e['throughput']:,.0f}", f"{e['throughput_per_core']:,.0f}", *cost,
                                            entry_note(e))))
    if table.row_count:
        console.print(table)
    for e in (e for e in chosen if e["batch"] is None):
        console.print(f"{e['variant']} on {e['runtime_label']}: {e['why']}", markup=False)
    if result.meets_budget() is False:
        console.print(nothing_meets(result.settings.p99_budget_ms), style="red", markup=False)


class _OptionalJsonValue(typer.core.TyperCommand):
    """``--json`` alone means stdout (``--json=-``); ``--json FILE.json`` and ``--json=FILE`` name a file.
    Typer has no option with an optional value, so a bare ``--json`` is rewritten before parsing."""

    def parse_args(self, ctx, args):
        out = []
        for i, arg in enumerate(args):
            following = args[i + 1] if i + 1 < len(args) else ""
            if arg == "--" or "--" in out:
                out.append(arg)
                continue
            out.append("--json=-" if arg == "--json" and not (following == "-" or following.endswith(".json")) else arg)
        return super().parse_args(ctx, out)


def _int_list(option: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of integers", hint=f"e.g. {option} 1,32") from None


def _names(text: str | None) -> list[str] | None:
    return [v.strip() for v in text.split(",") if v.strip()] if text else None


@app.command(cls=_OptionalJsonValue, epilog=exits(0, 1, 2, 3, 4, 130, _1="nothing meets --p99-budget-ms (--load: no lane holds it)"))
def bench(
    sources: Annotated[list[Path], typer.Argument(metavar="RUN_OR_ARTIFACT", help="Run folders (every exported artifact of the run) and/or .onnx/.xml files.", show_default=False)],
    runtime: Annotated[Optional[str], typer.Option("--runtime", help="Comma-separated: onnxruntime, openvino (default: every runtime that loads each file).", show_default=False)] = None,
    batch: Annotated[str, typer.Option("--batch", help="Comma-separated batch sizes.")] = "1,32",
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs of each artifact first (the export stage's default too).")] = 3,
    runs: Annotated[Optional[int], typer.Option("--runs", help="Timed repetitions per batch size [default: until 200 runs back each p99, or 20 s per batch size, at least 50]; a p99 from fewer than 200 runs is marked low-confidence (~).", show_default=False)] = None,
    duration: Annotated[Optional[float], typer.Option("--duration", help="Seconds of timing per batch size (a window: every artifact in turn until it has passed), instead of --runs.", show_default=False)] = None,
    threads: Annotated[str, typer.Option("--threads", help="Runtime threads, as the export stage times with; 0: the runtime's own choice. Under --load, a comma-separated list (each a lane).")] = "1",
    metric: Annotated[Optional[str], typer.Option("--metric", help="The figure each row shows, as its run measured it (default: the run's headline; e.g. finish.auc, a multi-head run's second head).", show_default=False)] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Variant the ratios are against: RUN/LABEL (e.g. quickstart/onnx.fp32), a label, or a file name [default: the first fp32 artifact].", show_default=False)] = None,
    openvino_precision: Annotated[Optional[str], typer.Option("--openvino-precision", help="OpenVINO inference precision hints to time, comma-separated: default (bf16 on AVX-512 BF16/AMX CPUs), f32, bf16, f16 [default: default,f32; under --load: as each IR's deployment record says].", show_default=False)] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="[FILE]", help="Every figure as JSON: alone on stdout (instead of the table), or into FILE (--json out.json, --json=FILE).", show_default=False)] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="A self-contained HTML report with charts.", show_default=False)] = None,
    prometheus: Annotated[Optional[Path], typer.Option("--prometheus", help="Prometheus text format for node-exporter's textfile collector.", show_default=False)] = None,
    benchmark_app: Annotated[bool, typer.Option("--benchmark-app", help="Also run OpenVINO's benchmark_app on each IR and record its throughput.")] = False,
    p99_budget_ms: Annotated[Optional[float], typer.Option("--p99-budget-ms", help="Latency budget: per artifact and runtime, the batch size of highest throughput whose p99 stays within it (time several batch sizes: --batch 1,2,4,8,16,32); exit 1 when none does.", show_default=False)] = None,
    price_per_hour: Annotated[Optional[str], typer.Option("--price-per-hour", metavar="PRICE|FILE", help="What the machine costs an hour, or a YAML file of prices per host (host label or CPU model: price): adds the cost per million inferences to every row.", show_default=False)] = None,
    host_label: Annotated[Optional[str], typer.Option("--host-label", help="A name for this machine (e.g. its instance type), recorded in the JSON, matched in a price file and shown by --merge.", show_default=False)] = None,
    merge: Annotated[bool, typer.Option("--merge", help="Compare hosts: the arguments are bench --json files from several machines, merged into one table, HTML, JSON and Prometheus file (timing options do not apply).")] = False,
    load: Annotated[bool, typer.Option("--load", help="Serve each artifact under offered load instead: open-loop Poisson arrivals, one request at a time, through the dynamic batcher (pruneflow.runtime.Server); p50/p95/p99 end to end, achieved QPS, batch sizes. Needs --rate, or --p99-budget-ms to search the highest rate that holds it.", rich_help_panel="Under load")] = False,
    rate: Annotated[Optional[str], typer.Option("--rate", help="Offered rates in requests/s, comma-separated (a sweep; every lane at each rate in turn).", show_default=False, rich_help_panel="Under load")] = None,
    max_batch: Annotated[str, typer.Option("--max-batch", help="Batching policies: the most rows a batch takes (1: one request at a time).", rich_help_panel="Under load")] = "1,8,32",
    max_delay_ms: Annotated[str, typer.Option("--max-delay-ms", help="Batching policies: how long the oldest request may wait for a batch to fill.", rich_help_panel="Under load")] = "0,2,5",
    workers: Annotated[int, typer.Option("--workers", min=1, help="Executors (streams) per lane, each with --threads threads.", rich_help_panel="Under load")] = 1,
    requests: Annotated[int, typer.Option("--requests", min=10, help="At most this many requests per point (with --duration seconds of arrivals, default 3).", rich_help_panel="Under load")] = 6000,
    metrics_port: Annotated[Optional[int], typer.Option("--metrics-port", min=0, help="Serve live /metrics on 127.0.0.1:PORT while the load runs (0: any free port); each point is checked against a scrape.", show_default=False, rich_help_panel="Under load")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Time artifacts side by side (p50/p90/p99, throughput, size, headline metric, ratios), interleaved per batch size;
    with --load, one request at a time under offered load (docs/serving.md). The batch to serve at, its cost, two hosts:

        pruneflow bench runs/ptq --batch 1,2,4,8,16,32,64 --p99-budget-ms 20 --price-per-hour 0.36 --host-label c7i.large --json c7i.json
        pruneflow bench --merge c7i.json m7a.json --price-per-hour prices.yaml --p99-budget-ms 20 --html hosts.html
    """
    from pruneflow.benchmark import BenchSettings, price_for_this_host, result_json, run_bench, write_outputs

    to_stdout = json_out == "-"
    with handle_errors(verbose, to_stdout):
        if merge:
            return _bench_merge(sources, price_per_hour, p99_budget_ms, json_out, html, prometheus)
        if load:
            return _bench_load(sources, runtime, openvino_precision, threads, rate, max_batch, max_delay_ms, workers, duration,
                               requests, p99_budget_ms, price_per_hour, host_label, metrics_port, json_out, html, prometheus)
        json_file = _json_file(json_out)
        price, price_source = price_for_this_host(price_per_hour, host_label)
        settings = BenchSettings(runtimes=_names(runtime), batches=_int_list("--batch", batch), warmup=warmup,
                                 runs=runs, duration=duration, threads=_one_threads(threads), baseline=baseline,
                                 openvino_precisions=_names(openvino_precision or "default,f32") or [], benchmark_app=benchmark_app,
                                 p99_budget_ms=p99_budget_ms, price_per_hour=price, price_source=price_source,
                                 host_label=host_label, metric=metric)
        result = run_bench(list(sources), settings, RichReporter(_err_console(), quiet=to_stdout))
        written = write_outputs(result, json_file=json_file, html=html, prometheus=prometheus)
        if to_stdout:
            print(json.dumps(result_json(result), allow_nan=False))
        else:
            _print_bench(result, written)
        if result.exit_code():  # nothing meets --p99-budget-ms: CI gates on it; every file is still written
            raise typer.Exit(result.exit_code())


def _one_threads(text: str) -> int | None:
    values = _int_list("--threads", text)
    if len(values) != 1 or values[0] < 0:
        raise UsageError(f"--threads {text!r}: one number >= 0 (0: the runtime's own choice)",
                         hint="several thread counts are lanes of --load only")
    return values[0] or None


def _bench_load(sources: list[Path], runtime: str | None, openvino_precision: str | None, threads: str, rate: str | None,
                max_batch: str, max_delay_ms: str, workers: int, duration: float | None, requests: int,
                p99_budget_ms: float | None, price_per_hour: str | None, host_label: str | None, metrics_port: int | None,
                json_out: str | None, html: Path | None, prometheus: Path | None) -> None:
    """``bench --load``: every lane under offered load (``pruneflow.benchmark.load``); exit 1 when none holds."""
    from pruneflow.benchmark import price_for_this_host
    from pruneflow.benchmark.load import LoadSettings, run_load, write_load_outputs

    to_stdout = json_out == "-"
    price, price_source = price_for_this_host(price_per_hour, host_label)
    settings = LoadSettings(
        rates=[float(v) for v in _float_list("--rate", rate)] if rate else None, max_batches=_int_list("--max-batch", max_batch),
        max_delays_ms=_float_list("--max-delay-ms", max_delay_ms), threads=_int_list("--threads", threads), workers=workers,
        duration=duration or 3.0, max_requests=requests, p99_budget_ms=p99_budget_ms, runtimes=_names(runtime),
        openvino_precisions=_names(openvino_precision), price_per_hour=price,
        price_source=price_source, host_label=host_label, metrics_port=metrics_port)
    result = run_load(list(sources), settings, RichReporter(_err_console(), quiet=to_stdout))
    written = write_load_outputs(result, json_file=_json_file(json_out), html=html, prometheus=prometheus)
    if to_stdout:
        print(json.dumps(result.as_json(), allow_nan=False))
    else:
        _print_load(result, written)
    if not result.holds_any():
        raise typer.Exit(1)


def _float_list(option: str, text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of numbers", hint=f"e.g. {option} 0,2,5") from None


def _print_load(result, written: list[Path]) -> None:
    """Per lane: each point's p99 (achieved QPS); then the best configuration per artifact, its cost and the ratio to
    FP32 served one request at a time."""
    console = _out_console()
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=True, width=240)
    doc = result.as_json()
    budget = result.settings.p99_budget_ms
    cpu = doc["host"]["cpu"]
    console.print(f"host: {cpu['model']} ({cpu['arch']}), ISA {' '.join(cpu['isa'])}, {cpu['usable_cpus']} usable CPUs"
                  + (f", label {doc['host']['label']}" if doc["host"].get("label") else ""), markup=False)
    table = Table(title="p99 ms (achieved QPS) at each offered rate; * over the budget or not keeping up", title_justify="left")
    for column in ("artifact", "runtime", "policy", "thr", "knee QPS", "points"):
        table.add_column(column)
    for lane in doc["lanes"]:
        cells = []
        for p in lane["points"]:
            held = p["keeps_up"] and (budget is None or (p["p99_ms"] is not None and p["p99_ms"] <= budget))
            p99 = "inf" if p["p99_ms"] is None else f"{p['p99_ms']:.3g}"
            cells.append(f"{p['offered_qps']:,.0f}: {p99}{'' if held else '*'} ({p['achieved_qps']:,.0f})")
        knee = f"{lane['knee_qps']:,.0f}" if lane["knee_qps"] else "–"
        table.add_row(lane["variant"], lane["runtime_label"] or lane["runtime"], lane["policy"], str(lane["threads"]), knee,
                      lane["error"] or "  ".join(cells))
    console.print(table)
    best = Table(title="best configuration per artifact" + (f", p99 within {budget:g} ms" if budget else ""), title_justify="left")
    for column in ("artifact", "runtime", "policy", "thr", "QPS held", "p99 ms", "mean batch", "vs FP32 one at a time", "cost / 1M"):
        best.add_column(column, justify="left" if column in ("artifact", "runtime", "policy") else "right")
    for b in doc["best"]:
        if b.get("qps") is None:
            best.add_row(b["variant"], b["why"], "", "", "", "", "", "", "")
            continue
        best.add_row(b["variant"], b["runtime"], b["policy"], str(b["threads"]), f"{b['qps']:,.0f}", f"{b['p99_ms']:.3g}",
                     f"{b['mean_batch']:.1f}", f"{b['vs_fp32_one_at_a_time']:.2f}x" if b.get("vs_fp32_one_at_a_time") else "–",
                     f"{b['cost_per_million']:.4g}" if b.get("cost_per_million") is not None else "–")
    console.print(best)
    if doc.get("reference"):
        console.print(f"FP32 one at a time: {doc['reference']}", markup=False)
    scraped = [(p["scraped"], p) for lane in doc["lanes"] for p in lane["points"] if p.get("scraped")]
    if scraped:
        worst = max(max(abs(s["qps"] / p["achieved_qps"] - 1) if p["achieved_qps"] else 0,
                        abs(s["p99_ms"] / p["p99_ms"] - 1) if p["p99_ms"] else 0) for s, p in scraped)
        console.print(f"/metrics scraped around each of {len(scraped)} points: QPS and p99 within {worst:.1%} of bench's own", markup=False)
    if not result.holds_any():
        console.print("[red]no lane held any rate" + (f" within p99 {budget:g} ms" if budget else "") + " (exit 1)[/red]")
    for path in written:
        console.print(f"wrote {path}", markup=False)


def _json_file(json_out: str | None) -> Path | None:
    json_file = Path(json_out) if json_out and json_out != "-" else None
    if json_file is not None and (json_file.is_dir() or json_file.suffix in (".onnx", ".xml")):
        raise UsageError(f"--json took {json_out!r} as the file to write, and it is a model or a folder",
                         hint="put --json after the artifacts, or write --json=FILE")
    return json_file


def _bench_merge(sources: list[Path], price_per_hour: str | None, p99_budget_ms: float | None, json_out: str | None,
                 html: Path | None, prometheus: Path | None) -> None:
    """``bench --merge``: several hosts' bench JSON side by side (``pruneflow.benchmark.hosts``); exit 1 when no host
    has anything within the budget."""
    import math

    from pruneflow.benchmark import Prices, merge, write_outputs

    from pruneflow.benchmark.load_merge import is_load_file

    if p99_budget_ms is not None and not (math.isfinite(p99_budget_ms) and p99_budget_ms > 0):
        raise UsageError(f"--p99-budget-ms {p99_budget_ms:g}: must be a positive finite number", hint="e.g. --p99-budget-ms 20")
    kinds = {is_load_file(p) for p in sources}
    if kinds == {True}:
        if html is not None or prometheus is not None:
            raise UsageError("--merge of bench --load results writes --json and the table, not --html or --prometheus",
                             hint="drop --html/--prometheus (each host's own bench --load --html has its curves)")
        return _bench_merge_load(sources, Prices.parse(price_per_hour), p99_budget_ms, json_out)
    if len(kinds) > 1:
        raise UsageError("--merge: some files are bench --load results and some are not",
                         hint="merge load results with load results, and batch timings with batch timings")
    merged = merge(list(sources), Prices.parse(price_per_hour), p99_budget_ms)
    written = write_outputs(merged, json_file=_json_file(json_out), html=html, prometheus=prometheus)
    if json_out == "-":
        print(json.dumps(merged.as_json(), allow_nan=False))
    else:
        _print_merged(merged, written)
    if merged.exit_code():
        raise typer.Exit(merged.exit_code())


def _bench_merge_load(sources: list[Path], prices, p99_budget_ms: float | None, json_out: str | None) -> None:
    """``bench --merge`` of ``bench --load`` files: per artifact and host the best configuration, its cost, and the best
    artifact per host (``pruneflow.benchmark.load_merge``); exit 1 when no host held any rate."""
    from rich.markup import escape

    from pruneflow.artifacts import write_text_atomic
    from pruneflow.benchmark.load_merge import merge_load

    merged = merge_load(list(sources), prices, p99_budget_ms)
    failed = not any(h.get("artifact") for h in merged["best_per_host"])
    if json_out is not None:
        text = json.dumps(merged | {"exit_code": int(failed)}, indent=None if json_out == "-" else 2, allow_nan=False)
        if json_out == "-":
            print(text)
            raise typer.Exit(int(failed))
        write_text_atomic(Path(json_out), text + "\n")
    console = _out_console()
    budget = merged["p99_budget_ms"]
    hosts = [h["name"] for h in merged["hosts"]]
    table = Table(title="highest rate held per artifact and host" + (f", p99 within {budget:g} ms" if budget else ""),
                  title_justify="left")
    table.add_column("artifact")
    for host in hosts:
        table.add_column(f"{escape(host)}\nQPS (p99 ms) policy thr, cost/1M", justify="right")
    for artifact in dict.fromkeys(r["artifact"] for r in merged["best"]):
        cells = []
        for host in hosts:
            r = next((r for r in merged["best"] if r["artifact"] == artifact and r["host"] == host), None)
            cost = f", {r['cost_per_million']:.4g}" if r and r["cost_per_million"] is not None else ""
            cells.append("–" if r is None else escape(f"{r['qps']:,.0f} ({r['p99_ms']:.3g}) {r['policy']} {r['threads']}t{cost}"))
        table.add_row(escape(artifact), *cells)
    console.print(table)
    for h in merged["best_per_host"]:
        line = (f"{h['host']}: best {h['artifact']} on {h['runtime']} {h['policy']} {h['threads']}t, {h['qps']:,.0f} "
                "requests/s" if h.get("artifact") else f"{h['host']}: {h['why']}")
        console.print(line, markup=False)
    if json_out not in (None, "-"):
        console.print(f"wrote {json_out}", markup=False)
    if failed:
        raise typer.Exit(1)


def _print_merged(merged, written: list[Path]) -> None:
    """The hosts, then per batch size one table with a column group per host, then the best batch under the budget.
    Names come from other hosts' files: table cells are escaped, never read as rich markup."""
    from rich.markup import escape

    from pruneflow.benchmark.hosts_html import host_cells
    from pruneflow.benchmark.html import marks_note

    console = _out_console()
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=True, width=240)
    priced = any(h["price_per_hour"] for h in merged.hosts)
    for h in merged.hosts:
        cpu = h["host"]["cpu"]
        price = f"{h['price_per_hour']:g}/h ({h['price_source']})" if h["price_per_hour"] else (h["price_source"] or "no price")
        console.print(f"host {h['name']}: {cpu['model']} ({cpu['arch']}), {cpu['usable_cpus']} CPUs, ISA "
                      f"{' '.join(cpu['isa'])}; threads {h['settings'].get('threads') or 'runtime default'}; {price}; "
                      f"{h['file']}", markup=False)
    figures = ("p50 ms", "p99 ms", "samples/s", *(("cost / 1M",) if priced else ()))
    for batch in merged.batches():
        table = Table(title=f"batch {batch}", title_justify="left")
        table.add_column("artifact")
        table.add_column("runtime")
        for h in merged.hosts:
            for i, f in enumerate(figures):
                table.add_column(f"{escape(h['name']) if i == 0 else ''}\n{f}", justify="right")
        for variant, lane in merged.lanes():
            table.add_row(*(escape(c) for c in (variant, lane, *(c for h in merged.hosts for c in host_cells(
                merged.row(h["name"], variant, lane, batch), priced)))))
        console.print(table)
    if (note := marks_note(merged.rows)) is not None:
        console.print(note, markup=False)
    _print_merged_budget(console, merged, priced)
    for path in written:
        console.print(f"wrote {path}", markup=False)


def _print_merged_budget(console: Console, merged, priced: bool) -> None:
    """Per artifact x runtime, per host: the best batch within --p99-budget-ms, its samples/s and cost per million
    (``+``: the largest batch timed, a larger one may do better); then the line of exit 1 when nothing fits anywhere."""
    from rich.markup import escape

    from pruneflow.benchmark.html import entry_note, nothing_meets

    listed = merged.under_budget()
    chosen = {(e["host"], e["variant"], e["runtime_label"]): e for e in listed}
    if not chosen:
        return
    table = Table(title=f"best batch with p99 within {merged.p99_budget_ms:g} ms", title_justify="left")
    table.add_column("artifact")
    table.add_column("runtime")
    figures = ("batch", "samples/s", "per core", *(("cost / 1M",) if priced else ()))
    for h in merged.hosts:
        for i, f in enumerate(figures):
            table.add_column(f"{escape(h['name']) if i == 0 else ''}\n{f}", justify="right")
    for variant, lane in merged.lanes():
        cells = [variant, lane]
        for h in merged.hosts:
            e = chosen.get((h["name"], variant, lane))
            if e is None or e.get("batch") is None:
                cells += ["none fits" if e else "–", *["–"] * (len(figures) - 1)]
                continue
            cost = e.get("cost_per_million")
            cells += [f"{e['batch']}{'+' if e.get('largest_timed') else ''}", f"{e['throughput']:,.0f}",
                      f"{e['throughput_per_core']:,.0f}", *([f"{cost:.4g}" if cost is not None else "–"] if priced else [])]
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
    for e in listed:
        if e.get("batch") is not None and entry_note(e):
            console.print(f"{e['host']}, {e['variant']} on {e['runtime_label']}, batch {e['batch']}: {entry_note(e)}",
                          markup=False)
    if merged.meets_budget() is False:
        console.print(nothing_meets(merged.p99_budget_ms), style="red", markup=False)


def _print_bench(result, written: list[Path]) -> None:
    """One table per batch size (columns with nothing in them left out; one run: labels without its name),
    then what was not timed, the host, the inputs and the files written. Cells are escaped: a file's name is never
    read as rich markup."""
    from rich.markup import escape

    from pruneflow.benchmark.html import low_confidence_note, table_cells, table_head

    console = _out_console()
    if not console.is_terminal:  # logs and pipes: every figure whole, however wide
        console = Console(highlight=False, soft_wrap=True, width=240)
    models = {v.model for v in result.variants}
    head = table_head(result)
    for batch in result.settings.batches:
        rows = [r for r in result.rows if r.batch == batch]
        cells = [table_cells(result, r) for r in rows]
        if len(models) == 1:
            cells = [[row.lane.variant.label, *c[1:]] for row, c in zip(rows, cells)]
        keep = [i for i, h in enumerate(head) if h != "batch" and any(c[i] not in ("", "–") for c in cells)]
        where = f" of {next(iter(models))}" if len(models) == 1 else ""
        table = Table(title=escape(f"batch {batch}{where}: ratios against {result.baseline.name}"), title_justify="left")
        for i in keep:
            table.add_column(escape(head[i]), justify="left" if i in (0, 1, len(head) - 1) else "right",
                             no_wrap=0 < i < len(head) - 1)
        for row, c in zip(rows, cells):
            table.add_row(*(escape(c[i]) for i in keep), style="bold" if row.lane.variant is result.baseline else None)
        console.print(table)
    if (note := result.metric_note()) is not None:
        console.print(note, markup=False)
    if (marks := low_confidence_note(result)) is not None:
        console.print(marks, markup=False)
    for v in result.variants:
        if not v.timed:
            console.print(f"{v.name}: {v.untimed_detail()}", markup=False)
    cpu = result.host["cpu"]
    label = f"{result.host['label']}, " if result.host.get("label") else ""
    console.print(f"host: {label}{cpu['model']} ({cpu['arch']}), {cpu['usable_cpus']} CPUs, ISA {' '.join(cpu['isa'])}; "
                  f"threads {result.settings.threads or 'runtime default'}", markup=False)
    if result.settings.price_source and result.settings.price_per_hour is None:
        console.print(f"cost per million: none, {result.settings.price_source}", markup=False)
    _print_budget(console, result)
    settings = result.settings
    runs = sorted({r.stats.runs for r in result.rows if r.stats is not None})
    timed = f" ({runs[0]} timed)" if len(runs) == 1 else f" ({runs[0]} to {runs[-1]} timed)" if runs else ""
    console.print(f"timing: interleaved, {settings.window().describe()}{timed} per batch size after {settings.warmup} "
                  f"warm-up, threads {settings.threads or 'runtime default'} (the export stage's defaults: 50 runs, "
                  "3 warm-up, 1 thread)", markup=False)
    for what in sorted(set(result.inputs.values())):
        console.print(f"input: {what}", markup=False)
    if result.benchmark_app["asked"]:
        console.print(f"benchmark_app: {result.benchmark_app['how']}", markup=False)
    for path in written:
        console.print(f"wrote {path}", markup=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
