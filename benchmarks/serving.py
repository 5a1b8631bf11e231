"""The serving executor's acceptance (issue 38): many clients, one dynamic batcher, the same answers as a direct run.

    pruneflow optimize recipes/resnet56-cifar10-ptq.yaml --out runs/serve
    pruneflow optimize recipes/minilm-embed.yaml --out runs/serve
    python benchmarks/serving.py runs/serve/resnet56-cifar10-ptq/export/openvino/model.int8.xml \
        runs/serve/resnet56-cifar10-ptq/export/onnx/model.int8.onnx runs/serve/minilm-embed/export/onnx/model.int8.onnx \
        --out benchmarks/results/serving_executor

Per artifact: 1,000 single-sample requests from the run's eval split, sent by 8 client threads through
``pruneflow.runtime.Server`` (max_batch 16, max_delay 2 ms, text bucketed by length), against ONE direct batched call
of the same artifact on the same 1,000 samples (text padded to the longest). Counted: answers, requests lost or
answered twice, batches and their sizes; compared per row: the largest absolute difference, the lowest cosine, and
the top-1 agreement. Then shutdown: 500 requests queued behind a busy executor, ``close(drain=False)``: each one must
be answered or refused. Writes OUT.md and OUT.json, host recorded.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pruneflow.benchmark.inputs import Feeds
from pruneflow.benchmark.variants import collect_variants
from pruneflow.runtime import BatchPolicy, Server, ServerClosed, host_info, open_artifact
from pruneflow.deployment import openvino_hint
from pruneflow.formats.openvino import read_ir

REQUESTS, CLIENTS = 1000, 8


def check(path: Path) -> dict:
    (variant,) = collect_variants([path])
    feeds = Feeds(0)
    batch = feeds.batch(variant, REQUESTS)
    samples = [{k: v[i] for k, v in batch.items()} for i in range(REQUESTS)] if isinstance(batch, dict) else list(batch)
    hint = openvino_hint(read_ir(path)) if path.suffix == ".xml" else None
    direct = open_artifact(path, threads=1, precision_hint=hint)
    expected = np.asarray(direct(batch)).reshape(REQUESTS, -1)

    server = Server.open(path, policy=BatchPolicy(max_batch=16, max_delay_ms=2), threads=1)
    answers: list = [None] * REQUESTS
    times = [0] * REQUESTS
    lock = threading.Lock()

    def client(worker: int) -> None:
        for i in range(worker, REQUESTS, CLIENTS):
            out = server(samples[i], timeout=60)
            with lock:
                answers[i] = out
                times[i] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    wall = time.perf_counter() - start
    server.close()
    got = np.stack([np.asarray(a).reshape(-1) for a in answers])
    diff = float(np.abs(got - expected).max())
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1) + 1e-12)
    top1 = float((got.argmax(1) == expected.argmax(1)).mean())
    stats = server.stats

    # shutdown with requests queued: a second server, its queue filled faster than it drains
    closing = Server.open(path, policy=BatchPolicy(max_batch=4, max_delay_ms=0), threads=1)
    futures = [closing.submit(samples[i % REQUESTS]) for i in range(500)]
    closing.close(drain=False)
    outcome = {"answered": 0, "refused": 0, "other": 0}
    for f in futures:
        exc = f.exception(timeout=60)
        outcome["answered" if exc is None else "refused" if isinstance(exc, ServerClosed) else "other"] += 1
    return {"artifact": str(path), "runtime": server.executors[0].label, "timed_on": feeds.source(variant).what,
            "requests": REQUESTS, "clients": CLIENTS, "answered": stats.answered, "answered_once": times.count(1),
            "lost": times.count(0), "twice": sum(t > 1 for t in times), "batches": len(stats.batch_rows),
            "mean_batch": float(np.mean(stats.batch_rows)), "largest_batch": max(stats.batch_rows), "wall_s": wall,
            "max_abs_diff": diff, "min_cosine": float(cos.min()), "top1_agreement": top1,
            "shutdown": {"queued": 500, **outcome}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    host = host_info()
    rows = [check(p) for p in args.artifacts]
    args.out.with_suffix(".json").write_text(json.dumps({"host": host, "rows": rows}, indent=2) + "\n")
    cpu = host["cpu"]
    lines = ["# The serving executor under 8 clients (issue 38)", "",
             f"Host: {cpu['model']}, {cpu['usable_cpus']} usable CPUs, ISA {' '.join(cpu['isa'])}; one runtime thread; "
             "max_batch 16, max_delay 2 ms. Reproduce with the commands in `benchmarks/serving.py`.", "",
             "| artifact | runtime | answered once | lost | twice | batches (mean / largest) | max abs diff | min cosine "
             "| top-1 agreement | shutdown of 500 queued: answered + refused |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        s = r["shutdown"]
        lines.append(f"| {Path(r['artifact']).parent.parent.parent.name}/{Path(r['artifact']).name} | {r['runtime']} "
                     f"| {r['answered_once']}/{r['requests']} | {r['lost']} | {r['twice']} | {r['batches']} "
                     f"({r['mean_batch']:.1f} / {r['largest_batch']}) | {r['max_abs_diff']:.2e} | {r['min_cosine']:.6f} "
                     f"| {r['top1_agreement']:.3f} | {s['answered']} + {s['refused']} = {s['answered'] + s['refused']}"
                     + (f" ({s['other']} other)" if s["other"] else "") + " |")
    lines += ["", "Inputs: " + "; ".join(f"{Path(r['artifact']).name}: {r['timed_on']}" for r in rows), ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
