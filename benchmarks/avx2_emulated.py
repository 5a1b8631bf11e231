"""The AVX2 host's precision choice, emulated (issue 38 items 4 and 7): OpenVINO's FP32 and INT8 IRs of a run timed
with oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, read once per process) and uncapped, on this machine.

    python benchmarks/avx2_emulated.py runs/resnet56-cifar10-ptq runs/minilm-embed --out benchmarks/results/avx2_emulated

Per run: ``pruneflow bench FP32.xml INT8.xml --openvino-precision f32 --batch 1,32`` in a subprocess, capped and
uncapped, twice each in alternation (ABAB, so drift hits both); the median of the two p50s per lane. Both IRs are timed
at the f32 hint: an AVX2 CPU has no bf16 arithmetic, and OpenVINO under the cap fails to compile most INT8 IRs at its
default precision (it reads bf16 support from CPUID, not from the cap). onnxruntime's MLAS has no such cap: its kernels
follow CPUID, so no onnxruntime row is emulated. Figures labelled "emulated AVX2" are what the cap gives on this CPU,
not a measurement on an AVX2 server (cache sizes, clocks and memory differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def bench(files: list[Path], capped: bool, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"} | (
        {"ONEDNN_MAX_CPU_ISA": "AVX2"} if capped else {})
    cmd = [str(Path(sys.executable).with_name("pruneflow")), "bench", *map(str, files), "--runtime", "openvino",
           "--openvino-precision", "f32", "--batch", "1,32", "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1200)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows, host = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs:
            files = sorted(run.glob("export/**/model.fp32.xml")) + sorted(run.glob("export/**/model.int8.xml"))
            p50: dict[tuple[str, bool, int], list[float]] = {}
            for i, capped in enumerate([True, False, True, False]):
                doc = bench(files, capped, Path(tmp) / f"{run.name}{i}.json")
                host = doc["host"]
                for r in doc["results"]:
                    if r["p50_ms"] is not None:
                        p50.setdefault((r["precision"], capped, r["batch"]), []).append(r["p50_ms"])
            for capped in (True, False):
                for batch in (1, 32):
                    fp32 = float(np.median(p50[("fp32", capped, batch)]))
                    int8 = float(np.median(p50[("int8", capped, batch)]))
                    rows.append({"run": run.name, "isa": "emulated AVX2" if capped else "native (AVX-512 VNNI)",
                                 "batch": batch, "fp32_ms": fp32, "int8_ms": int8, "int8_speedup": fp32 / int8,
                                 "int8_delivered": fp32 / int8 >= 1.02})
    args.out.with_suffix(".json").write_text(json.dumps({"host": host, "rows": rows}, indent=2) + "\n")
    cpu = host["cpu"]
    lines = ["# The AVX2 host's INT8-or-float choice, emulated (issue 38)", "",
             f"Host: {cpu['model']}, ISA {' '.join(cpu['isa'])}, {cpu['usable_cpus']} usable CPUs; OpenVINO "
             f"{host['versions'].get('openvino', '?')}, one thread, both IRs at the f32 hint. \"emulated AVX2\": oneDNN capped "
             "with ONEDNN_MAX_CPU_ISA=AVX2 on this CPU (not an AVX2 server). Reproduce with `benchmarks/avx2_emulated.py`.", "",
             "| run | ISA | batch | FP32 IR p50 ms | INT8 IR p50 ms | INT8 speed-up | the default delivers |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['isa']} | {r['batch']} | {r['fp32_ms']:.3g} | {r['int8_ms']:.3g} | "
                     f"{r['int8_speedup']:.2f}x | {'INT8' if r['int8_delivered'] else 'FP32'} |")
    lines += ["", "\"The default delivers\" applies the export stage's rule (INT8 only where it is at least 2 % faster) "
              "to these figures batch by batch; the stage itself decides over every served batch at once.", ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
