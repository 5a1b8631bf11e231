"""The `pruneflow` command line (Typer + Rich): parse → call one library function → render.

The app, its shared option types, the consoles and the exception → message → exit-code table are
``pruneflow/commands/app.py``; each command group is a module beside it (optimize; validate and doctor in check;
schema and init in recipes; calibrate; inspect; bench) that registers its commands on the app, imported here in
the order ``--help`` lists them (the app lives below the command modules, so no module imports this one back).
Installed as ``pruneflow.cli`` (setup.py); ``python -m pruneflow`` and the ``pruneflow`` script run ``main``.
"""

from __future__ import annotations

from pruneflow.commands import optimize, check, recipes, calibrate, inspect, bench  # noqa: F401, I001  (each registers its commands)
from pruneflow.commands.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":  # `python -m cli` from a checkout
    main()
