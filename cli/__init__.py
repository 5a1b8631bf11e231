"""The `pruneflow` command line (Typer + Rich).

Parse → call one library function → render. This package owns the console, the error → message →
exit-code table, and --json/--quiet/-v: ``app.py`` (the app and the option types every command shares),
``console.py`` (consoles, the exception table, the reporter) and one module per command group. The command
modules are imported in the order ``--help`` lists the commands.
"""

from __future__ import annotations

from . import optimize, check, recipes, calibrate, inspect, bench  # noqa: F401  (each registers its commands)
from .app import app

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
