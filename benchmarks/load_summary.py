"""A results page from `pruneflow bench --load --json` files (issue 38's acceptance tables).

    R=runs/serve/resnet56-cifar10-ptq
    pruneflow bench $R/export/reference/onnx/model.fp32.onnx $R/export/onnx/model.int8.onnx \
        $R/export/reference/openvino/model.fp32.xml $R/export/openvino/model.int8.xml --load --p99-budget-ms 20 \
        --max-batch 1,8,32 --max-delay-ms 0,2,5 --threads 1 --price-per-hour 1 --metrics-port 0 \
        --json benchmarks/results/load_resnet56.json --html benchmarks/results/load_resnet56.html
    python benchmarks/load_summary.py benchmarks/results/load_resnet56.json --out benchmarks/results/load_resnet56.md

Every figure is read from the JSON (nothing is measured here): the host, per artifact the best configuration within
the budget and its ratio to FP32 served one request at a time, every lane's knee, and how close a scrape of the live
/metrics came to bench's own QPS and p99 at every point.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summary(doc: dict, source: Path) -> list[str]:
    cpu = doc["host"]["cpu"]
    s = doc["settings"]
    budget = s.get("p99_budget_ms")
    lines = [f"# `bench --load`: {source.stem}", "",
             f"Host: {cpu['model']} ({cpu['arch']}), ISA {' '.join(cpu['isa'])}, {cpu['usable_cpus']} usable CPUs; "
             f"{doc['host']['versions'].get('onnxruntime', '?')} onnxruntime, OpenVINO {doc['host']['versions'].get('openvino', '?')}.",
             f"Open-loop Poisson arrivals, {s['duration']:g} s (at most {s['max_requests']} requests) per point; "
             f"policies max_batch {s['max_batches']} x max_delay_ms {s['max_delays_ms']}; threads {s['threads']}; "
             + (f"search for the highest rate within p99 {budget:g} ms." if s.get("rates") is None else f"rates {s['rates']}."),
             f"Reference (FP32 served one request at a time): {doc.get('reference') or 'none held'}.", "",
             "## Best configuration per artifact", "",
             "| artifact | runtime | policy | threads | QPS held | p99 ms | mean batch | vs FP32 one at a time | cost / 1M |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in doc["best"]:
        if b.get("qps") is None:
            lines.append(f"| {b['variant']} | {b['why']} | | | | | | | |")
            continue
        ratio = f"{b['vs_fp32_one_at_a_time']:.2f}x" if b.get("vs_fp32_one_at_a_time") else "–"
        cost = f"{b['cost_per_million']:.4g}" if b.get("cost_per_million") is not None else "–"
        lines.append(f"| {b['variant']} | {b['runtime']} | {b['policy']} | {b['threads']} | {b['qps']:,.0f} | "
                     f"{b['p99_ms']:.3g} | {b['mean_batch']:.1f} | {ratio} | {cost} |")
    lines += ["", "## Every lane's knee (the highest rate held with every lower rate holding)", "",
              "| artifact | runtime | policy | threads | knee QPS | points tried |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for lane in doc["lanes"]:
        knee = f"{lane['knee_qps']:,.0f}" if lane.get("knee_qps") else "–"
        lines.append(f"| {lane['variant']} | {lane['runtime_label']} | {lane['policy']} | {lane['threads']} | {knee} | "
                     f"{len(lane['points'])} |")
    scraped = [(p["scraped"], p) for lane in doc["lanes"] for p in lane["points"] if p.get("scraped")]
    if scraped:
        qps = [abs(sc["qps"] / p["achieved_qps"] - 1) for sc, p in scraped if p["achieved_qps"]]
        p99 = [abs(sc["p99_ms"] / p["p99_ms"] - 1) for sc, p in scraped if p["p99_ms"]]
        lines += ["", "## Live /metrics against bench's own figures", "",
                  f"Scraped over HTTP before and after each of {len(scraped)} points: QPS within {max(qps):.1%} "
                  f"(median {sorted(qps)[len(qps) // 2]:.1%}), p99 from the latency histogram within {max(p99):.1%} "
                  f"(median {sorted(p99)[len(p99) // 2]:.1%})."]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("load_json", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    lines = summary(json.loads(args.load_json.read_text()), args.load_json)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
