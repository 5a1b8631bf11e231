"""pruneflow: turn a trained PyTorch model into smaller, faster, deployable artifacts from one YAML recipe."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pruneflow")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
