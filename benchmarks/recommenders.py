"""The production recommenders' acceptance table (issue 37), read from the four shipped recipes' own runs.

    pruneflow optimize recipes/mmoe-feed.yaml --out runs/rec        # each about 1-15 minutes on two cores
    pruneflow optimize recipes/dlrm-bags.yaml --out runs/rec
    pruneflow optimize recipes/sasrec-next-item.yaml --out runs/rec
    pruneflow optimize recipes/gru4rec-session.yaml --out runs/rec
    python benchmarks/recommenders.py runs/rec --out benchmarks/results/recommenders
    python benchmarks/recommenders.py runs/rerun --out benchmarks/results/recommenders --update   # refresh some rows

Every figure is copied from a run's metrics.json (nothing is computed here but ratios): per model and head, the
original FP32 model's metric (the `reference` export, before pruning) against the INT8 ONNX and OpenVINO IR in their
own runtimes; MACs before and after pruning (torch's FlopCounter: entering the first prune stage, after the last);
the INT8 ONNX's size against the FP32 ONNX of the same pruned model (a tied table counted once); and the INT8 ONNX's
speed against that FP32 ONNX at each timed batch, both timed interleaved in one loop by the export stage. Writes
OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: recipe name -> (heads, the figure judged, the bar: an absolute drop or a relative share)
MODELS = {
    "mmoe-feed": (["click", "finish"], "auc", ("drop", 0.002)),
    "dlrm-bags": ([None], "auc", ("drop", 0.002)),
    "sasrec-next-item": ([None], "hr", ("share", 0.97)),
    "gru4rec-session": ([None], "hr", ("share", 0.97)),
}


def rows_of(run: Path, name: str) -> list[dict]:
    flat = json.loads((run / "metrics.json").read_text())["flat"]
    heads, metric, (kind, bar) = MODELS[name]
    rows = []
    for head in heads:
        key = f"{head}.{metric}" if head else metric
        ref = flat[f"reference.onnx.fp32.{key}"]
        for artifact in ("onnx.int8", "openvino.int8"):
            got = flat[f"{artifact}.{key}"]
            held = (ref - got <= bar) if kind == "drop" else (got >= bar * ref)
            row = {"model": name, "head": head or "", "artifact": artifact, "metric": metric, "fp32 (original)": ref,
                   "int8": got, "bar": f"drop <= {bar}" if kind == "drop" else f">= {bar:.0%} of fp32", "held": held}
            if metric == "auc":
                pctr = f"{head}.mean_pctr" if head else "mean_pctr"
                row["mean pCTR fp32 -> int8"] = f"{flat[f'reference.onnx.fp32.{pctr}']:.4f} -> {flat[f'{artifact}.{pctr}']:.4f}"
            rows.append(row)
    return rows


def prune_stages(flat: dict) -> list[str]:
    """The recipe's prune stages in their order (``prune``, ``prune-2``, ...: a recipe may prune in several steps)."""
    ids = {key.rsplit(".", 1)[0] for key in flat if key.endswith(".macs_before") and key.startswith("prune")}
    return sorted(ids, key=lambda i: int(i.rpartition("-")[2]) if i.rpartition("-")[2].isdigit() else 1)


def size_speed(run: Path, name: str) -> dict:
    flat = json.loads((run / "metrics.json").read_text())["flat"]
    stages = prune_stages(flat) or ["prune"]  # MACs entering the first prune stage, and after the last one
    out = {"model": name, "MACs before": flat.get(f"{stages[0]}.macs_before"), "MACs after": flat.get(f"{stages[-1]}.macs"),
           "onnx fp32 MB": flat["onnx.fp32.size_mb"], "onnx int8 MB": flat["onnx.int8.size_mb"],
           "size ratio": flat["onnx.fp32.size_mb"] / flat["onnx.int8.size_mb"]}
    for key, value in flat.items():
        if key.startswith("onnx.int8.speedup_b") and key[len("onnx.int8.speedup_b"):].isdigit():
            out[f"int8 speed-up b{key[len('onnx.int8.speedup_b'):]} (onnxruntime)"] = value
    return out


def table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [f"{v:.4f}" if isinstance(v, float) else "" if v is None else str(v) for v in (r.get(c) for c in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the --out folder of the four recipe runs")
    parser.add_argument("--out", type=Path, required=True, help="OUT.md and OUT.json are written")
    parser.add_argument("--update", action="store_true", help="keep OUT.json's rows of the models not in RUNS (and OUT.md's "
                        "sections after the tables): rerun some recipes, refresh their rows only")
    args = parser.parse_args(argv)
    found = {name: args.runs / name for name in MODELS if (args.runs / name / "metrics.json").is_file()}
    quality = [r for name, run in found.items() for r in rows_of(run, name)]
    sizes = [size_speed(run, name) for name, run in found.items()]
    hosts = {name: json.loads((run / "manifest.json").read_text()).get("host", {}).get("cpu", {}) for name, run in found.items()}
    tail = ""
    if args.update and args.out.with_suffix(".json").is_file():
        old = json.loads(args.out.with_suffix(".json").read_text())
        order = list(MODELS)
        quality = sorted([r for r in old["quality"] if r["model"] not in found] + quality, key=lambda r: order.index(r["model"]))
        sizes = sorted([r for r in old["size_speed"] if r["model"] not in found] + sizes, key=lambda r: order.index(r["model"]))
        hosts = {n: ({**old["hosts"], **hosts})[n] for n in order if n in {**old["hosts"], **hosts}}
        text_md = args.out.with_suffix(".md").read_text() if args.out.with_suffix(".md").is_file() else ""
        tail = "\n" + text_md[text_md.index("\n## "):].rstrip("\n") if "\n## " in text_md else ""
    text = "\n\n".join(["# Production recommenders: the four shipped recipes", "Every artifact against the original FP32 "
                        "model (before pruning), in its own runtime, on the recipe's held-out rows.", table(quality),
                        "Size and speed: the INT8 ONNX against the FP32 ONNX of the same pruned model (speed-up > 1: INT8 "
                        "faster; both timed interleaved by the export stage, one thread).", table(sizes),
                        "Hosts: " + "; ".join(f"{n}: {h.get('model', '?')} ({', '.join(h.get('isa') or [])})" for n, h in hosts.items())])
    text += tail
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"quality": quality, "size_speed": sizes, "hosts": hosts}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
