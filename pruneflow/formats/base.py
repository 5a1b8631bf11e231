"""What a format and a runtime are: the two kinds every artifact question goes to.

A **format** (ONNX, OpenVINO IR, TensorRT engine, Ascend OM) is what a file is: its suffixes and companion files, how
its deployment record is written into it and read back, its input as the file declares it, the runtimes that load it
and its INT8 forms. A **runtime** (onnxruntime, OpenVINO, TensorRT) is what runs one: the devices it has, whether it
takes an inference-precision hint, and how it opens a file as an :class:`~pruneflow.runtime.Executor`. Both are
registered by name (``registry.formats``, ``registry.runtimes``), so a new target's file type is one class here and
a registration, not a suffix switch in the runtime layer, ``bench`` and the deployment record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..runtime.base import Executor


@dataclass
class InputSpec:
    """The artifact's (first) input: name, shape with None for a dynamic dimension, numpy dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str = "float32"

    def batch_fits(self, batch: int) -> bool:
        return not self.shape or self.shape[0] in (None, batch)


class Runtime:
    """A runtime that loads artifacts. Subclasses set the class attributes and ``open``.

        >>> from pruneflow.formats import runtime_named
        >>> runtime_named("openvino").takes_precision_hint
        True
    """

    #: The registered name (``onnxruntime``), what executors, lanes and reports call it.
    name: ClassVar[str] = ""
    #: The devices a service names (``cpu``, ``cuda``, ``gpu``, ``npu``) -> what this runtime calls each.
    devices: ClassVar[dict[str, str]] = {}
    #: Whether it computes float parts at a precision a hint chooses (OpenVINO's INFERENCE_PRECISION_HINT): ``bench``
    #: times such a runtime at each hint asked, a lane's label shows what it computed in, a record's hint is passed on.
    takes_precision_hint: ClassVar[bool] = False
    #: Whether its vendor's benchmark tool (OpenVINO's benchmark_app) times files of its native format beside bench.
    vendor_benchmark: ClassVar[bool] = False

    def open(self, path: Path, device: str | None, threads: int | None, precision_hint: str | None,
             exact_int8: bool = False) -> Executor:
        """``path`` loaded on ``device`` (None: the best this runtime has here); RuntimeUnavailable when it cannot."""
        raise NotImplementedError

    def hint_for(self, record: dict[str, Any] | None) -> str | None:
        """The precision hint a deployment record asks of this runtime (None: its default, or it takes none)."""
        return None


class Format:
    """What a file is. Subclasses set the class attributes and override what their files support.

        >>> from pruneflow.formats import format_of
        >>> format_of("model.int8.xml").name, format_of("model.int8.xml").runtimes
        ('openvino', ('openvino',))
    """

    #: The registered name, which is also the export target writing it and its artifacts' ``kind`` (``openvino``).
    name: ClassVar[str] = ""
    #: What the files are called in messages (``OpenVINO IR``).
    title: ClassVar[str] = ""
    #: Suffixes of the main file, the first being what a target writes (``.xml``).
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: The registered runtimes that load it, the default first; () where none runs here (Ascend OM: the NPU's own).
    runtimes: ClassVar[tuple[str, ...]] = ()
    #: The INT8 forms its files come in (``Artifact.form``): the same parameters written for different runtimes.
    int8_forms: ClassVar[tuple[str, ...]] = ()
    #: The INT8 form whose arithmetic another runtime only checks (TensorRT's Q/DQ convention in an ONNX): opened
    #: with ``exact_int8`` there, never timed as that runtime would serve it, never emulated on another CPU.
    foreign_int8_form: ClassVar[str | None] = None
    #: What the foreign form is called in reports (``TensorRT form``).
    foreign_int8_title: ClassVar[str] = ""
    #: Whether its files are served on CPUs (the recipe's ``deploy.cpu`` and the INT8 forms chosen for them apply).
    serves_on_cpu: ClassVar[bool] = False
    #: The portable graph other formats are built from (ONNX): where a choice of reference has one, it goes first.
    interchange: ClassVar[bool] = False
    #: Said on an INT8 artifact of a format whose runtimes cannot cap the CPU's instruction set (no AVX2 emulation).
    no_emulation_note: ClassVar[str | None] = None
    #: The runtime whose own format this is (OpenVINO for an IR): its vendor tools and a record's hint apply there.
    native_runtime: ClassVar[str | None] = None
    #: Whether a CPU's instruction set can be capped while its files run (OpenVINO's ONEDNN_MAX_CPU_ISA): an INT8 file
    #: built for an AVX2-only CPU is then checked and timed as that CPU would run it.
    emulates_cpus: ClassVar[bool] = False

    def companions(self, path: Path) -> list[Path]:
        """Files that travel with ``path`` (an IR's .bin, an ONNX's external data), whether or not they exist."""
        return []

    def read_record(self, path: Path) -> dict[str, Any]:
        """The deployment record written into ``path`` ({} for a file pruneflow did not write, or none it can read)."""
        return {}

    def stamp_record(self, model: Any, record: dict[str, Any], precision: str | None) -> None:
        """Write ``record`` into ``model`` (the format's in-memory model, before it is saved)."""
        raise NotImplementedError(f"{self.title or self.name} files carry no deployment record")

    def input_spec(self, path: Path) -> InputSpec | None:
        """The file's first input as it declares it (no runtime needed); None when it cannot be told."""
        return None

    def inspect(self, path: Path) -> dict | None:
        """What ``pruneflow inspect`` shows of a file (``layers`` rows, ``totals``); None: this format has no such table."""
        return None

    def refused(self, record: dict[str, Any] | None) -> dict[str, str]:
        """Runtimes of ``runtimes`` that cannot read this one file, given its deployment record -> why."""
        return {}

    def recorded_hint(self, runtime: str, record: dict[str, Any] | None) -> str | None:
        """The precision hint ``record`` asks of ``runtime`` for a file of this format (None: the runtime's default)."""
        return None
