"""The CPUs a run's artifacts will be served on (issue 38, item 5: built here, served there).

What the export chooses by measuring on the build host can be wrong on the server: an INT8 ONNX in the
``u8s8_vnni`` form, fastest on a VNNI host, saturates on an x86 CPU without VNNI (its u8 x s8 kernels add product
pairs in int16). So a recipe names the serving CPUs (``deploy: {cpu: [avx2, avx512_vnni]}``, or ``optimize --for``)
and every host-specific choice is made for all of them at once:

- the INT8 form (``form: auto`` of the onnx and openvino targets): a form that needs VNNI only when every named CPU
  has VNNI or AMX (or is not x86); otherwise ``u8s8``, the form exact on every x86 CPU. With no CPU named the
  same portable rule holds (a CI runner is not the server);
- OpenVINO's INT8 precision hint (``int8_hint: auto``): ``f32`` when no named CPU computes bf16 (OpenVINO's
  default is f32 there, so timing the bf16 default here decides nothing for them).

A CPU is named by one ISA flag of ``runtime.host.ISA_FLAGS`` (what it implies is added: ``avx512_bf16`` CPUs all
have AVX-512 VNNI), or several joined by ``+`` (``avx2+avx_vnni``). The names and rules are data in the kernel
(``recipe/cpus.py``, which the recipe's schema and the deployment record read); this module applies them to
artifacts and runs the emulation.

Emulation: OpenVINO's CPU plugin runs its oneDNN kernels under ``ONEDNN_MAX_CPU_ISA=AVX2`` as an AVX2-only server
would (``emulate_avx2``; oneDNN reads the variable once per process, so it runs in a subprocess). The plugin still
reads bf16 support from CPUID, so an IR compiled at its default precision there asks oneDNN for bf16 kernels the
cap forbids and fails ("could not create a primitive descriptor" for MatMul/GRU, an empty descriptor list for
Softmax); with ``INFERENCE_PRECISION_HINT=f32`` -- an AVX2 server's own default -- every INT8 IR we tried compiled
and ran. onnxruntime's MLAS picks its kernels from CPUID and has no such cap: its files are checked by
construction (the ``u8s8`` form's weights are fitted so int16 pair sums cannot saturate), not by emulation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..formats import format_of_kind, runs_elsewhere
from ..recipe.cpus import (ARM_FLAGS, BF16_FLAGS, IMPLIED, PORTABLE_FORM, VNNI_FLAGS, canonical, computes_bf16,
                           cpu_flags, exact_int8, host_of, int8_form_for, int8_hint_for, known_names, normalise)

__all__ = ["ARM_FLAGS", "AVX2_CAP", "BF16_FLAGS", "IMPLIED", "NOT_AVX2", "PORTABLE_FORM", "VNNI_FLAGS", "canonical",
           "computes_bf16", "cpu_flags", "emulate_avx2", "exact_int8", "form_conflict", "host_of", "int8_form_for",
           "int8_hint_for", "known_names", "needs_avx2_emulation", "normalise", "served_on", "time_avx2"]

#: The oneDNN cap that emulates an AVX2-only x86 server, and the names its kernels then carry.
AVX2_CAP = "AVX2"
#: Primitive names that an AVX2 server cannot run (their presence under emulation: the cap did not hold).
NOT_AVX2 = ("avx512", "amx", "vnni", "avx10")


def form_conflict(form: str, hosts: list[str] | None) -> list[str]:
    """The named CPUs an artifact of INT8 ``form`` (``forms.needs_vnni``) would compute wrongly on."""
    from .forms import needs_vnni

    return [h for h in hosts or [] if needs_vnni(form) and not exact_int8(h)]


def served_on(artifact: Any, hosts: list[str] | None) -> dict[str, Any]:
    """One row of the report's ``served on`` table: the CPUs (named, or any) ``artifact`` is for, and why."""
    from .forms import needs_vnni

    form = artifact.metrics.get("int8_form") if artifact.precision == "int8" else None
    named = ", ".join(hosts) if hosts else None
    fmt = format_of_kind(artifact.target)
    if fmt is None or not fmt.serves_on_cpu or runs_elsewhere(artifact):
        foreign = f", {fmt.foreign_int8_title}" if fmt is not None and runs_elsewhere(artifact) else ""
        where, why = "its target's device", f"not a CPU artifact ({artifact.target}{foreign})"
    elif form and needs_vnni(form):
        wrong = form_conflict(form, hosts)
        where = (f"NOT {', '.join(wrong)}; " if wrong else "") + (named or "x86 CPUs with VNNI/AMX, and ARM")
        why = f"INT8 form {form} needs VNNI/AMX on x86 ({', '.join(VNNI_FLAGS)})"
    else:
        where = named or "any x86-64 or ARM CPU (none named)"
        why = (f"INT8 form {form}: exact on every CPU" if form else
               "bf16 arithmetic only where the CPU has AVX-512 BF16/AMX, f32 elsewhere" if artifact.precision == "bf16"
               else f"{artifact.precision}: runs alike on every CPU")
        if fmt.native_runtime is not None and artifact.precision == "int8":
            hint = fmt.recorded_hint(fmt.native_runtime, artifact.deployment)
            why += f"; float parts at {hint or 'OpenVINO default'} precision"
    row = {"artifact": artifact.label, "for": where, "why": why}
    emulated = artifact.metrics.get("cosine_emulated_avx2")
    if emulated is not None:
        row["emulated AVX2"] = f"cosine {emulated:.6f}, {artifact.metrics.get('agreement_emulated_avx2', float('nan')):.4f} agreement"
    return row


def needs_avx2_emulation(hosts: list[str] | None, build: dict[str, Any] | None = None) -> bool:
    """Whether a named CPU is x86 without VNNI while this (x86) host has more: what it computes can then differ."""
    from ..runtime.host import host_info

    cpu = (build or host_info())["cpu"]
    if cpu.get("arch") not in ("x86_64", "AMD64") or "avx2" not in (cpu.get("isa") or []):
        return False
    here = set(cpu.get("isa") or [])
    return any(not exact_int8(h) for h in hosts or []) and bool(here & (set(VNNI_FLAGS) | {"avx512f"}))


def emulate_avx2(ir: str | Path, x: Any, timeout: float = 300) -> tuple[Any, dict[str, list[str]]]:
    """``(outputs, {layer type: oneDNN primitives})`` of the OpenVINO IR ``ir`` run on ``x`` (numpy, or a dict of
    them) in a subprocess capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, f32 inference precision: an AVX2 server's
    default). RuntimeError with OpenVINO's message when it cannot run there, or when a kernel above AVX2 ran."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="pruneflow-avx2-") as tmp:
        feed = x if isinstance(x, dict) else {"": x}
        arrays: dict[str, Any] = {k or "__single__": np.asarray(v) for k, v in feed.items()}
        np.savez(Path(tmp) / "x.npz", **arrays)
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": AVX2_CAP}
        done = subprocess.run([sys.executable, "-m", "pruneflow.export.deploy_hosts", str(ir), tmp], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(tail[-1] if tail else f"exit {done.returncode}")
        kernels = json.loads((Path(tmp) / "kernels.json").read_text())
        out = np.load(Path(tmp) / "out.npy")
    above = sorted({p for ps in kernels.values() for p in ps if any(s in p.lower() for s in NOT_AVX2)})
    if above:
        raise RuntimeError(f"the AVX2 cap did not hold: kernels {', '.join(above)} ran")
    return out, kernels


def time_avx2(irs: list[str | Path], feeds: dict[int, Any], runs: int = 20, timeout: float = 600) -> dict[str, dict[int, float]]:
    """Median latency in ms per IR and batch size of the OpenVINO IRs ``irs`` in a subprocess capped at AVX2 (f32, one
    thread, every IR once per repetition in turn, as the export stage times), on ``feeds`` (batch size -> a numpy
    batch, or a dict of them). An IR that cannot run a batch (a static batch of another size) has no figure there.
    RuntimeError with OpenVINO's message when the subprocess fails."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="pruneflow-avx2-time-") as tmp:
        for batch, x in feeds.items():
            feed = x if isinstance(x, dict) else {"": x}
            arrays: dict[str, Any] = {k or "__single__": np.asarray(v) for k, v in feed.items()}
            np.savez(Path(tmp) / f"x{batch}.npz", **arrays)
        (Path(tmp) / "spec.json").write_text(json.dumps({"irs": [str(i) for i in irs], "batches": sorted(feeds),
                                                         "runs": runs}))
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": AVX2_CAP}
        done = subprocess.run([sys.executable, "-m", "pruneflow.export.deploy_hosts", "--time", tmp], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(tail[-1] if tail else f"exit {done.returncode}")
        found = json.loads((Path(tmp) / "times.json").read_text())
    return {ir: {int(b): float(ms) for b, ms in per.items()} for ir, per in found.items()}


def _emulated_times(folder: str) -> None:
    """The subprocess of ``time_avx2``."""
    import time

    import numpy as np
    import openvino as ov

    spec = json.loads((Path(folder) / "spec.json").read_text())
    core = ov.Core()
    compiled = {ir: core.compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
                for ir in spec["irs"]}
    requests = {ir: c.create_infer_request() for ir, c in compiled.items()}
    times: dict[str, dict[int, float]] = {ir: {} for ir in spec["irs"]}
    for batch in spec["batches"]:
        data = np.load(Path(folder) / f"x{batch}.npz")
        feed = {k: data[k] for k in data.files}
        x = feed["__single__"] if "__single__" in feed else feed
        ready = {ir: r for ir, r in requests.items() if not compiled[ir].inputs[0].get_partial_shape()[0].is_static
                 or compiled[ir].inputs[0].get_partial_shape()[0].get_length() == batch}
        for request in ready.values():
            for _ in range(3):
                request.infer(x)
        laps: dict[str, list[float]] = {ir: [] for ir in ready}
        for _ in range(int(spec["runs"])):
            for ir, request in ready.items():
                start = time.perf_counter()
                request.infer(x)
                laps[ir].append((time.perf_counter() - start) * 1000)
        for ir, values in laps.items():
            times[ir][batch] = float(np.median(values))
    (Path(folder) / "times.json").write_text(json.dumps(times))


def _emulated_run(ir: str, folder: str) -> None:
    """The subprocess of ``emulate_avx2`` (``ONEDNN_MAX_CPU_ISA`` already in its environment)."""
    import numpy as np
    import openvino as ov

    data = np.load(Path(folder) / "x.npz")
    compiled = ov.Core().compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    feed = {k: data[k] for k in data.files}
    single = "__single__" in feed
    batch1 = compiled.inputs[0].get_partial_shape()[0].is_static  # a static-batch IR: one sample at a time
    rows = [{k: v[i:i + 1] for k, v in feed.items()} for i in range(len(next(iter(feed.values()))))] if batch1 else [feed]
    out = np.concatenate([np.asarray(compiled(r["__single__"] if single else r)[0], dtype=np.float32) for r in rows])
    kernels: dict[str, set[str]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "layerType" in info and "primitiveType" in info:
            layer = info["layerType"].astype(str)
            if layer in ("Convolution", "FullyConnected", "MatMul", "GroupConvolution", "RNNSeq", "GRUSequence"):
                kernels.setdefault(layer, set()).add(info["primitiveType"].astype(str))
    np.save(Path(folder) / "out.npy", out)
    (Path(folder) / "kernels.json").write_text(json.dumps({k: sorted(v) for k, v in kernels.items()}))


if __name__ == "__main__":
    if sys.argv[1] == "--time":
        _emulated_times(sys.argv[2])
    else:
        _emulated_run(sys.argv[1], sys.argv[2])
