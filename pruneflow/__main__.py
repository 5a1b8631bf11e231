"""``python -m pruneflow``: the CLI, as torchrun starts it (``torchrun --nproc-per-node 2 -m pruneflow optimize RECIPE``)."""

from pruneflow.cli import main

if __name__ == "__main__":
    main()
