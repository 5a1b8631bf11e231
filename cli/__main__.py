"""``python -m cli`` from a checkout (the tests' subprocesses), as ``python -m pruneflow``."""

from . import main

main()
