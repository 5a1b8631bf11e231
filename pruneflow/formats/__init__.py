"""Artifact formats and the runtimes that load them, as registered kinds (``base.py`` says what each owns).

Built in: the ``onnx``, ``openvino`` (IR), ``tensorrt`` (engine) and ``ascend`` (OM) formats, and the
``onnxruntime``, ``openvino`` and ``tensorrt`` runtimes; a third party's arrives the same way, through the
``pruneflow.formats`` and ``pruneflow.runtimes`` entry points. The runtime layer, ``bench``, serving and the export
stage ask here what a file is and what runs it::

    fmt = format_of("export/openvino/model.int8.xml")   # IrFormat
    fmt.runtimes, fmt.read_record(path)                   # ('openvino',), the deployment record
    runtime_named("openvino").takes_precision_hint        # True
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import registry
from .base import Format, InputSpec, Runtime

if TYPE_CHECKING:
    from ..artifacts import Artifact

__all__ = ["Format", "InputSpec", "Runtime", "all_formats", "companions", "format_named", "format_of", "format_of_kind",
           "input_spec", "read_record", "runs_elsewhere", "runtime_named", "runtimes_for", "suffixes"]


def all_formats() -> list[Format]:
    """Every registered format, one instance each, in name order."""
    return [cls() for cls in registry.formats.all().values()]


def format_named(name: str) -> Format:
    """The format registered as ``name`` (an artifact's ``kind``, its target's name); UnknownNameError listing them."""
    return registry.formats.get(name)()


def format_of_kind(kind: str | None) -> Format | None:
    """The format of an artifact of ``kind`` (its target's name): None for a kind that is no format (a checkpoint)."""
    return format_named(kind) if kind and kind in registry.formats.names() else None


def runs_elsewhere(artifact: "Artifact") -> bool:
    """Whether ``artifact`` is in its format's foreign INT8 form (an ONNX in TensorRT's Q/DQ convention): its arithmetic
    is checked here, but it is not timed as a CPU runtime would serve it, chosen, gated on speed or emulated."""
    fmt = format_of_kind(artifact.kind)
    return fmt is not None and artifact.form is not None and artifact.form == fmt.foreign_int8_form


def format_of(path: str | Path) -> Format | None:
    """The format whose suffixes ``path`` ends in (None: no registered format has it)."""
    suffix = Path(path).suffix
    return next((f for f in all_formats() if suffix in f.suffixes), None)


def suffixes(loadable: bool = False) -> tuple[str, ...]:
    """Every registered format's suffixes (``loadable``: only of formats some runtime here loads)."""
    return tuple(s for f in all_formats() if f.runtimes or not loadable for s in f.suffixes)


def runtimes_for(path: str | Path) -> tuple[str, ...]:
    """The runtimes that can load ``path`` (by its format), the default first; () when none can."""
    fmt = format_of(path)
    return fmt.runtimes if fmt is not None else ()


def runtime_named(name: str) -> Runtime:
    """The runtime registered as ``name``; UnknownNameError listing them."""
    return registry.runtimes.get(name)()


def read_record(path: str | Path) -> dict[str, Any]:
    """The deployment record written into ``path`` by its format ({} for a file of no registered format)."""
    fmt = format_of(path)
    return fmt.read_record(Path(path)) if fmt is not None else {}


def input_spec(path: str | Path) -> InputSpec | None:
    """The first input ``path`` declares (None: unknown format, no input, or a header that will not parse)."""
    fmt = format_of(path)
    try:
        return fmt.input_spec(Path(path)) if fmt is not None else None
    except Exception:  # noqa: BLE001 - an unreadable header: the runtime will say more when it loads the file
        return None


def companions(path: str | Path) -> list[Path]:
    """The files that travel with ``path`` (its format's; [] for an unknown one)."""
    fmt = format_of(path)
    return fmt.companions(Path(path)) if fmt is not None else []
