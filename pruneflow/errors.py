"""One exception hierarchy; each class carries the exit code the CLI returns for it.

Exit codes: 0 ok · 1 a quality gate failed · 2 invalid recipe or usage · 3 missing dependency or
unavailable target · 4 a stage or export failed · 130 interrupted.
"""

from __future__ import annotations

from typing import Sequence

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_INVALID = 2
EXIT_MISSING_DEPENDENCY = 3
EXIT_STAGE_FAILED = 4
EXIT_INTERRUPTED = 130


class PruneflowError(Exception):
    """Base class. ``hint`` is the fix, printed after the message."""

    exit_code = EXIT_STAGE_FAILED
    title = "error"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nFix: {self.hint}"


class InputError(PruneflowError):
    """Something the user handed us is wrong: a recipe value, a missing file, a bad checkpoint."""

    exit_code = EXIT_INVALID
    title = "invalid input"


class RecipeError(InputError):
    """Recipe validation failed. ``issues`` holds one entry per problem, each with its location."""

    title = "invalid recipe"

    def __init__(self, message: str, issues: list["RecipeIssue"] | None = None, *, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.issues = list(issues or [])

    def __str__(self) -> str:
        lines = [self.message] + [issue.format() for issue in self.issues]
        if self.hint:
            lines.append(f"Fix: {self.hint}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}: {self}"

    def to_records(self) -> list[dict]:
        """One dict per problem: file, line, path (the key), value, message, hint."""
        return [issue.as_dict() for issue in self.issues]

    def to_pandas(self):
        """``to_records()`` as a pandas DataFrame (pandas is not a dependency of pruneflow)."""
        try:
            import pandas  # type: ignore[import-untyped]
        except ImportError as exc:  # units.dataframe says the same; this module imports nothing of ours
            raise MissingDependencyError("to_pandas() needs pandas", hint="pip install pandas") from exc
        return pandas.DataFrame.from_records(self.to_records())


class RecipeIssue:
    """One validation problem: ``FILE:LINE  key.path  value  message``; ``hint``, when known, is its fix."""

    def __init__(self, source: str, line: int | None, path: str, value: object, message: str, hint: str | None = None):
        self.source, self.line, self.path, self.value, self.message = source, line, path, value, message
        self.hint = hint

    def location(self) -> str:
        return f"{self.source}:{self.line}" if self.line else self.source

    def format(self) -> str:
        value = "" if self.value is _MISSING else f"  {_short(self.value)}"
        return f"  {self.location()}  {self.path or '<root>'}{value}  {self.message}"

    def __str__(self) -> str:
        return self.format().strip() + (f"  (fix: {self.hint})" if self.hint else "")

    def __repr__(self) -> str:
        return f"RecipeIssue({self.format().strip()})"

    def as_dict(self) -> dict:
        return {
            "file": self.source,
            "line": self.line,
            "path": self.path,
            "value": None if self.value is _MISSING else self.value,
            "message": self.message,
            "hint": self.hint,
        }


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
MISSING = _MISSING


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(InputError):
    """A recipe value is wrong, found by a rule that needs more than its own field (another stage, the
    model or the data). ``loc`` is its key path into the recipe, e.g. ``("stages", 2, "fade")``; the
    loader (rules that need only the recipe) and the pipeline (rules that need the model or data)
    resolve it to FILE:LINE from the recipe's stored positions, so it reads like any validation error::

        raise ConfigError(self.loc("ignore"), f"{pattern!r} matches no module of the model",
                          value=pattern, hint="use names from `pruneflow inspect`")
    """

    title = "invalid recipe"

    def __init__(self, loc: tuple, message: str, *, value: object = MISSING, hint: str | None = None):
        super().__init__(f"{key_path(loc)}: {message}" if loc else message, hint=hint)
        self.loc = tuple(loc)
        self.value = value
        self.detail = message

    def under(self, *prefix: str | int) -> "ConfigError":
        """The same problem with ``prefix`` put before its key path.

        A helper shared by a stage and a command (calibration building) knows only the key it checks
        (``("by",)``); the stage that called it knows where it sits in the recipe::

            except ConfigError as exc:
                raise exc.under(*self.loc()) from None
        """
        return ConfigError((*prefix, *self.loc), self.detail, value=self.value, hint=self.hint)


def key_path(loc: Sequence[str | int]) -> str:
    """The one spelling of a recipe key path in messages: ``stages.2.fade``."""
    return ".".join(str(p) for p in loc)


class UnknownNameError(InputError):
    """A registry lookup missed: the message lists the known names."""


class MissingDependencyError(PruneflowError):
    """An optional library or toolchain is absent; ``hint`` holds the install command."""

    exit_code = EXIT_MISSING_DEPENDENCY
    title = "missing dependency"


class TargetUnavailableError(MissingDependencyError):
    title = "target unavailable"


class StageError(PruneflowError):
    """A stage failed while running."""

    exit_code = EXIT_STAGE_FAILED
    title = "stage failed"


class ExportError(StageError):
    title = "export failed"


class PluginError(PruneflowError):
    """A plugin registered through entry points could not be loaded."""

    exit_code = EXIT_MISSING_DEPENDENCY
    title = "plugin failed to load"


class UsageError(InputError):
    """The command line itself is wrong (a malformed --set, a bad option value)."""

    title = "usage error"
