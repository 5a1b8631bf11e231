"""The example recipes, shipped inside the wheel as `pruneflow.templates` (see pyproject.toml)."""
