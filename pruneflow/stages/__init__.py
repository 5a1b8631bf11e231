"""Built-in stages. Each is registered through the `pruneflow.stages` entry point in pyproject.toml."""
