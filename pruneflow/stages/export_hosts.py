"""The export stage and the CPUs its artifacts are served on: `auto` settings pinned for them or to what a resumed run
chose (manifest.json ``choices``), the choice recorded on each artifact, and an INT8 IR built for an AVX2-only CPU
checked and timed under AVX2 emulation (``export/deploy_hosts.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..artifacts import Artifact
from ..export import deploy_hosts
from ..export.forms import needs_vnni
from ..formats import format_of, format_of_kind, runs_elsewhere
from ..gates import GateResult
from ..inputs import as_numpy, take, trim
from ..runtime import host_info
from ..stage import Target
from .export_config import LatencySpec, ParitySpec
from .measure import parity_gate, parity_metrics, reference_outputs


@dataclass(frozen=True)
class Pins:
    """Which `auto` settings of a target ``pinned`` set, and from where: taken from the resumed run's record
    (``from_record``: setting -> value), or chosen for the serving CPUs (``for_hosts``: setting -> (value, why))."""

    from_record: dict[str, Any] = field(default_factory=dict)
    for_hosts: dict[str, tuple[Any, str]] = field(default_factory=dict)


def pinned(name: str, target: Target, recorded: dict[str, Any], hosts: list[str] | None = None) -> tuple[Target, Pins]:
    """``target`` with `auto` settings pinned: to what an earlier run chose by measuring (``recorded``: nothing is
    timed again, and the files come out as that run wrote them), else to what the serving CPUs (``hosts``, None:
    unknown) leave to choose (``deploy_hosts``: ``u8s8`` unless every one has VNNI; f32 where none computes bf16);
    with the ``Pins`` saying which (``target`` itself, and no pins, when nothing was left to pin)."""
    from_record, for_hosts = {}, {}
    auto = target.config.left_to_host()
    if "form" in auto:
        form, why = deploy_hosts.int8_form_for(hosts)
        if recorded.get("int8_form") and form in (None, recorded["int8_form"]):  # (one the hosts allow)
            from_record["form"] = recorded["int8_form"]
        elif form is not None:
            for_hosts["form"] = (form, why)
    if "int8_hint" in auto:
        if recorded.get("int8_hint"):
            from_record["int8_hint"] = recorded["int8_hint"]
        else:
            hint, why = deploy_hosts.int8_hint_for(hosts)
            if hint is not None:
                for_hosts["int8_hint"] = (hint, why)
    updates = {**from_record, **{k: v for k, (v, _) in for_hosts.items()}}
    if not updates:
        return target, Pins()
    return type(target)(target.config.model_copy(update=updates)), Pins(from_record, for_hosts)


def form_choice(name: str, pins: Pins, artifact: Artifact, recorded: dict[str, Any], recorded_choices: dict[str, Any] | None,
                choices: dict[str, Any] | None) -> None:
    """Record the INT8 form (and OpenVINO hint) ``artifact`` was written in, into its metrics and notes and ``choices`` (what
    this run chose, manifest.json's ``choices``); one taken from ``recorded`` (this target's entry of
    ``recorded_choices``, the resumed run's) says so."""
    if artifact.deployment is not None and "runtime" in artifact.deployment and artifact.deployment["runtime"] is None:
        del artifact.deployment["runtime"]  # asks nothing of the runtime: absent, as in every fp32 record
    if artifact.precision != "int8" or runs_elsewhere(artifact):
        return
    for setting, (value, why) in pins.for_hosts.items():
        if setting == "form":
            artifact.metrics["int8_form"] = value
            artifact.notes[:] = [n for n in artifact.notes if not n.startswith(f"INT8 form {value}: set in the recipe")]
            artifact.notes.append(f"INT8 form {value}, chosen for the serving CPUs without timing: {why}")
        else:
            artifact.notes.append(f"OpenVINO {setting} {value}, chosen for the serving CPUs without timing: {why}")
    pinned = pins.from_record
    if pinned:
        form = pinned.get("form") or artifact.metrics.get("int8_form")
        if form:
            artifact.metrics["int8_form"] = form
        # the target saw a pinned form and hint: its own note would say the recipe set them
        artifact.notes[:] = [n for n in artifact.notes if not n.startswith(f"INT8 form {form}: set in the recipe")]
        host = (recorded_choices or {}).get("host")
        elsewhere = f", measured on another host ({host.get('cpu')})" if isinstance(host, dict) and host != host_key() else ""
        settings = ", ".join(f"{k} {v}" for k, v in pinned.items())
        artifact.notes.append(f"{settings}: the choice of the run this one resumed (manifest.json `choices`{elsewhere}), "
                              "taken again without timing so the file is the one that run wrote; `--retime` measures again")
        if form and needs_vnni(form):  # what forms.record_choice says of a form it chose by timing
            artifact.notes.append(f"the {form} form needs an x86 CPU with VNNI or AMX (or a non-x86 one): without them "
                                  "its int8 kernels can saturate; pin `form: u8s8` to build for such a host")
    chose = {k: artifact.metrics[k] for k in ("int8_form", "int8_hint") if artifact.metrics.get(k)}
    if chose:
        (choices or {}).setdefault("targets", {}).setdefault(name, {}).update(chose)


def check_emulated_avx2(stage_id: str, parity_spec: ParitySpec, artifact: Artifact, state, ctx) -> list[GateResult]:
    """An INT8 IR built for a named AVX2-only CPU, run in OpenVINO capped at AVX2 (``deploy_hosts.emulate_avx2``)
    against the quantized torch model: the ``LABEL.parity_emulated_avx2`` gate, under the int8 parity limits.
    onnxruntime has no such cap (MLAS picks kernels by CPUID): an ONNX gets a note, its form being exact by
    construction. One that cannot run under the cap gets a note (emulation has its own failures), no gate."""
    fmt = format_of_kind(artifact.kind)
    if fmt is None or runs_elsewhere(artifact):
        return []  # (TensorRT's form: a GPU's, not a CPU's)
    if not fmt.emulates_cpus:
        if fmt.no_emulation_note:
            artifact.notes.append(fmt.no_emulation_note)
        return []
    if len(state.task.output_names) != 1:
        return []
    x = trim(take(state.data.eval.x, slice(0, parity_spec.samples)))  # the samples `_check` compares
    try:
        got, kernels = deploy_hosts.emulate_avx2(ctx.run_dir / artifact.path, as_numpy(x))
    except Exception as exc:  # noqa: BLE001 - the emulation's own failure is reported, not the artifact's
        artifact.notes.append(f"not checked under AVX2 emulation (OpenVINO, ONEDNN_MAX_CPU_ISA=AVX2): {exc}")
        ctx.reporter.warning(f"{stage_id}: {artifact.label} could not run under AVX2 emulation: {exc}")
        return []
    parity = parity_metrics(reference_outputs(state.model, x, state.task), got, state.task)
    suffix, agreement = "_emulated_avx2", state.task.agreement.name
    artifact.metrics.update({f"{k}{suffix}": v for k, v in parity.items()})
    artifact.metrics[f"agreement{suffix}"] = parity.get(agreement, parity["cosine"])  # (the served-on table's)
    artifact.metrics[f"{agreement}_fp32{suffix}"] = parity_metrics(  # and with the float model, as `_check` does
        reference_outputs(state.handle.float_module(), x, state.task), got, state.task)[agreement]
    ran = ", ".join(f"{layer} {'/'.join(p)}" for layer, p in kernels.items())
    artifact.notes.append(f"emulated AVX2 (OpenVINO with ONEDNN_MAX_CPU_ISA=AVX2, f32 hint, kernels {ran}): cosine "
                          f"{parity['cosine']:.6f} with the quantized torch model on {len(got)} eval samples "
                          "(figures `*_emulated_avx2`)")

    class _Emulated:
        label = "openvino, emulated AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, f32)"

    limits = parity_spec.limits("int8", "f32", state.task)
    return [parity_gate(artifact, suffix, _Emulated(), parity, bool(np.isfinite(got).all()), limits)]  # type: ignore[arg-type]


def time_emulated_avx2(stage_id: str, lat: LatencySpec | None, artifacts: list[Artifact], state, ctx) -> None:
    """With an AVX2 CPU named on a richer host: every OpenVINO IR timed again with oneDNN capped at AVX2 (f32, one
    thread, in turn; ``deploy_hosts.time_avx2``), as ``latency_b{bs}_median_ms_emulated_avx2``, so the delivery
    choice (``export_choice``) asks INT8 to win there too. onnxruntime has no such cap: its files are not timed so."""
    irs = [a for a in artifacts if a.status == "built" and (fmt := format_of(a.path)) is not None and fmt.emulates_cpus]
    if lat is None or len(irs) < 2:
        return
    ctx.reporter.info(f"{stage_id}: timing {len(irs)} OpenVINO IRs again under AVX2 emulation (ONEDNN_MAX_CPU_ISA=AVX2)")
    try:
        found = deploy_hosts.time_avx2([ctx.run_dir / a.path for a in irs],
                                       _emulated_feeds(state.data.eval.x, lat.batch_sizes), runs=lat.runs)
    except Exception as exc:  # noqa: BLE001 - the emulation's own failure is reported, the choice made without it
        ctx.reporter.warning(f"{stage_id}: AVX2 emulation could not time the IRs ({exc}); the choice is this host's")
        return
    for a in irs:
        for bs, ms in found.get(str(ctx.run_dir / a.path), {}).items():
            a.metrics[f"latency_b{bs}_median_ms_emulated_avx2"] = ms
        a.notes.append("timed under AVX2 emulation (OpenVINO, oneDNN capped at AVX2, f32 hint, one thread): "
                       + ", ".join(f"batch {bs} {ms:.3g} ms" for bs, ms in sorted(found.get(str(ctx.run_dir / a.path), {}).items())))


def _emulated_feeds(x: Any, batch_sizes: list[int]) -> dict[int, Any]:
    """Fresh numpy batches of the eval split, one per batch size, as the export stage times them."""
    from ..runtime.timing import fresh_batch

    return {bs: fresh_batch(x, bs) for bs in batch_sizes}


def host_key() -> dict[str, Any]:
    """The host a choice was measured on (CPU model, ISA flags), as manifest.json's ``choices`` record it."""
    cpu = host_info()["cpu"]
    return {"cpu": cpu.get("model"), "isa": sorted(cpu.get("isa") or [])}


def host_record(threads: int | None) -> dict[str, Any]:
    """One row for the stage's ``host`` table: where its latency was measured (``runtime.host_info``)."""
    host = host_info()
    versions = host["versions"]
    return {
        "cpu": host["cpu"]["model"], "arch": host["cpu"]["arch"], "isa": " ".join(host["cpu"]["isa"]),
        "usable_cpus": host["cpu"]["usable_cpus"], "threads": threads or "runtime default",
        "gpus": ", ".join(host.get("gpus", [])), "os": host["os"],
        "versions": ", ".join(f"{k} {versions[k]}" for k in ("onnxruntime", "openvino", "tensorrt", "torch") if k in versions),
    }
