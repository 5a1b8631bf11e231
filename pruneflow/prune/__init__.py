"""Structured pruning: importance criteria, progressive schedule, torch-pruning DepGraph glue."""
