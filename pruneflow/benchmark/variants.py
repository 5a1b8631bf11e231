"""What `pruneflow bench` compares: the variants named on its command line.

A run folder contributes every export artifact in its manifest (``built`` ones are timed, ``prepared``
and ``failed`` ones are listed without figures); a bare ``.onnx``/``.xml`` file contributes itself, and
borrows the manifest entry (label, the task's headline metric, data) of the run it lies in, if any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import check_run_sizes, manifest_entries, read_record, run_file
from ..deployment import cpu_shortfall
from ..errors import InputError, UsageError
from ..formats import InputSpec, companions, format_of, input_spec, read_record as file_record
from ..runtime import runtimes_for

PRECISIONS = ("fp32", "fp16", "bf16", "int8")


@dataclass
class Variant:
    """One artifact to compare. ``name`` (``run/onnx.int8``) is unique on the command line; ``model`` and
    ``label`` are its Prometheus labels."""

    name: str
    model: str
    label: str
    path: Path | None
    status: str = "built"
    precision: str | None = None
    target: str | None = None
    size_bytes: int | None = None
    #: The run's headline metric (its task's, from the manifest): name, value, and "higher"/"lower" is better.
    metric: str | None = None
    metric_value: float | None = None
    metric_direction: str | None = None
    #: The headline as the run measured it per runtime and precision (``metric_key``: ``onnxruntime``,
    #: ``openvino/bf16``, ``openvino/f32``); empty for a manifest that did not say where (``metric_value`` then
    #: stands for every lane).
    measured_in: dict[str, float] = field(default_factory=dict)
    run_dir: Path | None = None
    input: InputSpec | None = None
    notes: list[str] = field(default_factory=list)
    #: Why this host cannot run the artifact exactly (``deployment.cpu_shortfall``): its lanes are not timed.
    shortfall: str | None = None
    #: Runtimes of its format that cannot read this file (its deployment record says why) -> the note saying so.
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def timed(self) -> bool:
        """Built, present and loadable by some runtime (whether that runtime is installed is found later)."""
        return self.status == "built" and self.path is not None and self.path.is_file() and bool(runtimes_for(self.path))

    def untimed_detail(self) -> str:
        """``prepared, not built: tensorrt is not importable here; build on the GPU machine: ...``: why a
        variant has no figures, from its status and the notes its target wrote (said once)."""
        head = "prepared, not built" if self.status == "prepared" else self.status
        notes = [n.removeprefix("prepared, not built").lstrip(": ") for n in self.notes]
        return ": ".join([head, "; ".join(n for n in notes if n)]) if any(notes) else head

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "label": self.label, "status": self.status,
                "path": str(self.path) if self.path else None, "precision": self.precision, "target": self.target,
                "size_bytes": self.size_bytes, "metric": self.metric, "metric_value": self.metric_value,
                "metric_direction": self.metric_direction, "measured_in": self.measured_in,
                "run_dir": str(self.run_dir) if self.run_dir else None,
                "input": None if self.input is None else {"name": self.input.name, "shape": list(self.input.shape),
                                                          "dtype": self.input.dtype},
                "notes": self.notes, "shortfall": self.shortfall}


def collect_variants(sources: list[Path], metric: str | None = None) -> list[Variant]:
    """The variants of every argument, in order; a wrong argument is an InputError (exit 2) naming it. ``metric``: the
    figure each variant carries (``bench --metric``, e.g. ``finish.auc``, a multi-head run's second head), default its
    run's headline."""
    if not sources:
        raise UsageError("bench needs at least one run folder or artifact file",
                         hint="e.g. pruneflow bench runs/quickstart, or pruneflow bench model.onnx")
    variants: list[Variant] = []
    for source in sources:
        variants += _from_run(source, metric) if source.is_dir() else [_from_file(source)]
    _unique_names(variants)
    return variants


def _from_run(run_dir: Path, metric: str | None = None) -> list[Variant]:
    manifest_file = run_dir / "manifest.json"
    if not manifest_file.is_file():
        raise InputError(f"{run_dir}: a folder without manifest.json is not a pruneflow run",
                         hint="pass a run directory written by `pruneflow optimize` (OUT/NAME), or an .onnx/.xml file")
    manifest = read_record(manifest_file)
    run_name = str(manifest.get("recipe") or run_dir.name)
    task = _task(manifest)
    if metric is not None and metric not in (task.get("metrics") or {}):
        raise UsageError(f"--metric {metric}: run {run_dir} measures no such figure",
                         hint="one of: " + (", ".join(sorted(task.get("metrics") or {})) or "(none recorded)"))
    found = [_from_entry(run_dir, run_name, entry, {**task, "headline": metric or task.get("headline")})
             for entry in manifest_entries(manifest) if entry.get("target") and entry.get("kind") != "checkpoint"]
    if not found:
        raise InputError(f"{run_dir}: the run's manifest lists no exported artifact",
                         hint="add an `export` stage to the recipe and run it again")
    return found


def metric_key(runtime: str, inference_precision: str | None) -> str:
    """Where a figure was computed: ``onnxruntime``, or ``openvino/<what it computed in>`` (``bf16``, ``f32``)."""
    from ..formats import runtime_named

    return f"{runtime}/{inference_precision or 'f32'}" if runtime_named(runtime).takes_precision_hint else runtime


def _measured_in(metrics: dict[str, Any], metric: str | None) -> dict[str, float]:
    """``{metric_key: value}`` from the export stage's figures: ``<metric>`` computed in ``runtime`` (e.g.
    ``openvino/CPU (default: bf16)``) at ``inference_precision``, and the same with ``_f32`` for OpenVINO's f32 twin."""
    found: dict[str, float] = {}
    for suffix in ("", "_f32"):
        runtime, value = metrics.get(f"runtime{suffix}"), metrics.get(f"{metric}{suffix}") if metric else None
        if isinstance(runtime, str) and isinstance(value, (int, float)):
            found[metric_key(runtime.split("/")[0], metrics.get(f"inference_precision{suffix}"))] = float(value)
    return found


def _task(manifest: dict[str, Any]) -> dict[str, Any]:
    task = manifest.get("task")
    return task if isinstance(task, dict) else {}


def _from_entry(run_dir: Path, run_name: str, entry: dict[str, Any], task: dict[str, Any]) -> Variant:
    """A variant from its run's manifest entry; ``task``: the manifest's (``Task.summary``), naming the headline."""
    record = run_dir / "manifest.json"
    path = run_file(run_dir, entry.get("path"), record)
    label = _label(entry)
    status = str(entry.get("status", "built"))
    metric = task.get("headline") or None
    value = (entry.get("metrics") or {}).get(metric) if metric else None
    variant = Variant(name=f"{run_name}/{label}", model=run_name, label=label, path=path, status=status,
                      precision=entry.get("precision"), target=entry.get("target"), metric=metric,
                      metric_value=value if isinstance(value, (int, float)) else None,
                      metric_direction=(task.get("metrics") or {}).get(metric), run_dir=run_dir,
                      notes=list(entry.get("notes") or []), measured_in=_measured_in(entry.get("metrics") or {}, metric))
    companions = [run_file(run_dir, rel, record) for rel in (entry.get("files") or {})]
    if status == "built":
        check_run_sizes(record, [path, *companions], entry.get("size_bytes"))
    variant.size_bytes = disk_size([path, *companions]) if path.is_file() else entry.get("size_bytes")
    if status == "built" and not path.is_file():
        variant.status = "missing"
        variant.notes.append(f"{entry['path']} is listed as built but is not on disk")
    elif status == "built" and runtimes_for(path):
        variant.input = read_input_spec(path)
        variant.shortfall = cpu_shortfall(entry.get("deployment"))
        variant.refused = _refused(path, entry.get("deployment"))
    elif status == "built":
        variant.notes.append(f"no runtime here loads {path.suffix or 'this'} files")
    return variant


def _label(entry: dict[str, Any]) -> str:
    """``onnx.int8``, ``onnx.int8_tensorrt``: Artifact.label, rebuilt from the manifest's fields."""
    form = entry.get("form")
    suffix = f"_{form}" if form and form != "cpu" else ""
    return f"{entry.get('target')}.{entry.get('precision')}{suffix}"


def _from_file(path: Path) -> Variant:
    if not path.exists():
        raise InputError(f"{path}: no such file or folder", hint="pass a run directory or an .onnx/.xml artifact")
    if not runtimes_for(path):
        raise InputError(f"{path}: no runtime loads {path.suffix or 'files without a suffix'}",
                         hint="pass .onnx or .xml (OpenVINO IR) files, or a run directory")
    if path.is_file() and path.stat().st_size == 0:
        raise InputError(f"{path} is empty (0 bytes): no model in it", hint="export the model again, or pass the file a "
                         "run wrote (OUT/NAME/export/...)")
    owner = _owning_run(path)
    if owner is not None:
        return owner
    precision = next((p for p in PRECISIONS if p in path.name.split(".")), None)
    record = _file_record(path)
    fmt = format_of(path)
    return Variant(name=str(path), model=path.stem, label=path.name, path=path, precision=precision,
                   target=fmt.name if fmt is not None else None,
                   size_bytes=disk_size([path, *companions(path)]), input=read_input_spec(path),
                   shortfall=cpu_shortfall(record), refused=_refused(path, record))


def _refused(path: Path, record: dict[str, Any] | None) -> dict[str, str]:
    """The runtimes that load ``path``'s format but not this file (``Format.refused``)."""
    fmt = format_of(path)
    return fmt.refused(record) if fmt is not None else {}


def _file_record(path: Path) -> dict[str, Any] | None:
    """The deployment record written into a bare artifact (None when it has none or cannot be read here)."""
    try:
        return file_record(path)
    except Exception:  # noqa: BLE001 - a file that will not parse is reported when it is opened for timing
        return None


def _owning_run(path: Path) -> Variant | None:
    """The manifest entry of ``path`` when it lies inside a run folder (label, headline metric and data from the run)."""
    resolved = path.resolve()
    for folder in resolved.parents:
        manifest = folder / "manifest.json"
        if manifest.is_file():
            data = read_record(manifest)
            rel = resolved.relative_to(folder).as_posix()
            entry = next((a for a in manifest_entries(data) if a.get("path") == rel), None)
            if entry is None:
                return None
            return _from_entry(folder, str(data.get("recipe") or folder.name), entry, _task(data))
    return None


def disk_size(files: list[Path]) -> int:
    """Bytes on disk of every file that exists (an IR's .xml and .bin, an ONNX and its external data)."""
    return sum(f.stat().st_size for f in dict.fromkeys(files) if f.is_file())  # the manifest's `files` holds the main file too


def _unique_names(variants: list[Variant]) -> None:
    """Two runs of one recipe (A/B of two run folders) get their folder's name instead of the recipe's."""
    names = [v.name for v in variants]
    for v in variants:
        if names.count(v.name) > 1 and v.run_dir is not None:
            v.model = f"{v.run_dir.parent.name}/{v.run_dir.name}" if v.run_dir.name == v.model else v.run_dir.name
            v.name = f"{v.model}/{v.label}"
    seen: dict[str, int] = {}
    pairs: dict[tuple[str, str], int] = {}
    for v in variants:  # what still collides (one file given twice, two export stages) is numbered
        seen[v.name] = seen.get(v.name, 0) + 1
        pairs[(v.model, v.label)] = pairs.get((v.model, v.label), 0) + 1
        count = max(seen[v.name], pairs[(v.model, v.label)])
        if count > 1:
            v.name, v.label = f"{v.name}#{count}", f"{v.label}#{count}"


def read_input_spec(path: Path) -> InputSpec | None:
    """The first input of an artifact, read from the file by its format (no runtime needed)."""
    return input_spec(path)


def pick_baseline(variants: list[Variant], wanted: str | None) -> Variant:
    """The variant ratios are taken against: ``wanted`` (a full name like ``run/onnx.fp32``, or a label or
    file name, first match), else the first timed fp32 variant, else the first timed one."""
    timed = [v for v in variants if v.timed]
    if wanted is not None:
        match = next((v for v in variants if v.name == wanted), None) or next(
            (v for v in variants if wanted in (v.label, v.path.name if v.path else None)), None)
        if match is None:
            raise UsageError(f"--baseline {wanted!r} names no variant on the command line",
                             hint="use one of: " + ", ".join(v.name for v in variants))
        if not match.timed:
            raise UsageError(f"--baseline {wanted!r} is {match.status} and has no runtime here, so it has no figures",
                             hint="choose a built variant: " + ", ".join(v.name for v in timed))
        return match
    if not timed:
        listed = ", ".join(f"{v.name} ({v.status})" for v in variants)
        raise InputError(f"nothing to time: no built artifact a runtime can load among {listed}",
                         hint="prepared artifacts are built with their vendor tool first (see their README)")
    return next((v for v in timed if v.precision == "fp32"), timed[0])
