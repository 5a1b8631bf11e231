"""Issue 39: a click log streamed at 10^5, 10^6, 10^7 rows; and the column-op encoder against a plain pandas script.

    python benchmarks/stream_scale.py encode --rows 1000000          # 20 fields, pruneflow vs plain pandas/pyarrow
    python benchmarks/stream_scale.py scale --rows 100000 1000000    # generate shards, data pass, recipe end to end
    python benchmarks/stream_scale.py scale --rows 1000000 --nproc 2 # the same recipe under --nproc 2
    python benchmarks/stream_scale.py report                         # fitted exponents, results/stream_scale.md

Every figure is measured by this script and merged into ``benchmarks/results/stream_scale.json`` (one entry per
rows and process count, the latest run replacing an older one); ``report`` writes the markdown page from it. Peak
RSS is each child process's own (``/usr/bin/time -f %M``; under --nproc the launcher's children are counted by the
kernel's RUSAGE_CHILDREN of that process tree, i.e. the largest rank). Not a unit test: timings are noisy (2 shared
cores), so the page says the host and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "stream_scale.json"
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _host() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                  .stdout.splitlines() if line.startswith("Model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(),
            "commit": commit}


def _merge(key: str, entry: dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = entry
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def _timed(cmd: list[str], timeout: int = 7200) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd`` under /usr/bin/time: (process, wall seconds, peak RSS in MiB)."""
    stats = Path(f"/tmp/stream_scale_time_{os.getpid()}.txt")
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(stats), *cmd], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)
    wall = time.perf_counter() - start
    rss = int(stats.read_text().strip().splitlines()[-1]) / 1024
    return proc, wall, rss


# --------------------------------------------------------------------------- encoding, side by side


def _encode_log(folder: Path, rows: int) -> None:
    """A 20-field log: 8 categorical (2 integer ids hashed, 1 text id hashed, 5 vocabularies) and 12 numeric."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    gen = np.random.default_rng(0)
    (folder / "train").mkdir(parents=True, exist_ok=True)
    (folder / "eval").mkdir(parents=True, exist_ok=True)
    for split, n, parts in (("train", rows, 4), ("eval", max(rows // 20, 1000), 1)):
        for part in range(parts):
            m = n // parts
            cols = {"user_id": gen.zipf(1.3, m) % 10**7, "item_id": gen.integers(0, 10**6, m),
                    "session": np.char.add("s", gen.integers(0, 10**6, m).astype(str)),
                    "country": np.char.add("c", gen.zipf(1.5, m).clip(0, 300).astype(str)),
                    "device": np.array(["android", "ios", "web", "tv", " other"])[gen.integers(0, 5, m)],
                    "hour": gen.integers(0, 24, m), "category": gen.integers(0, 200, m),
                    "campaign": np.char.add("k", gen.zipf(1.2, m).clip(0, 20000).astype(str))}
            for j in range(12):
                x = gen.lognormal(1.0, 1.0, m)
                x[gen.random(m) < 0.01] = np.nan
                cols[f"n{j}"] = x
            cols["clicked"] = (gen.random(m) < 0.2).astype(np.int64)
            pq.write_table(pa.table(cols), folder / split / f"part-{part:05d}.parquet", row_group_size=131_072)


ENCODE_FEATURES = {"categorical": ["user_id", "item_id", "session", "country", "device", "hour", "category", "campaign"],
                   "numeric": [f"n{j}" for j in range(12)], "log1p": ["n0", "n1", "n2"], "min_count": 2,
                   "hash_buckets": {"user_id": 1_000_000, "item_id": 100_000, "session": 1 << 20}}


def _plain(batch, schema, vocab_index: dict) -> dict:
    """A plain vectorised pandas/numpy encoder doing the same work: ids (hashes modulo buckets, vocabulary lookups with
    an out-of-vocabulary 0), standardised numbers with missing values at the mean. Text is hashed with
    ``pandas.util.hash_array`` (the plain tool; pruneflow hashes with FNV-1a, which a server reproduces)."""
    import pandas as pd
    import torch

    df = batch.to_pandas()
    ids = []
    for f in schema.categorical:
        col = df[f.name]
        if f.buckets is not None:
            if col.dtype.kind in "iu":
                ids.append(np.mod(col.to_numpy(np.int64), f.buckets))
            else:
                ids.append((pd.util.hash_array(col.str.strip().to_numpy(object)) % np.uint64(f.buckets)).astype(np.int64))
        else:
            index = vocab_index[f.name]
            values = col.to_numpy() if index[1] else col.astype(str).str.strip().to_numpy(object)
            ids.append(index[0].get_indexer(values) + 1)
    dense = []
    for f in schema.numeric:
        x = df[f.name].to_numpy(np.float64)
        if f.log1p:
            x = np.sign(x) * np.log1p(np.abs(x))
        dense.append(((np.where(np.isnan(x), f.mean, x) - f.mean) / f.std).astype(np.float32))
    return {"ids": torch.from_numpy(np.stack(ids, 1)), "dense": torch.from_numpy(np.stack(dense, 1))}


def encode_bench(rows: int, repeats: int) -> dict:
    import pandas as pd

    from pruneflow.recipe.models import DataSpec
    from pruneflow.tabular_stream import open_source
    from pruneflow.data import load_data
    from pruneflow.tasks import make_task

    folder = Path(f"/tmp/stream_scale/encode-{rows}")
    if not (folder / "train").exists():
        _encode_log(folder, rows)
    spec = DataSpec(format="parquet", train=str(folder / "train"), eval=str(folder / "eval"), label_column="clicked",
                    features=ENCODE_FEATURES, stream={"eval_rows": 1000, "sample_rows": 1000})
    start = time.perf_counter()
    bundle = load_data(spec, task=make_task("binary"))
    count_s = time.perf_counter() - start
    schema, source = bundle.tabular, open_source(spec.train, spec, "data.train")
    vocab_index = {}
    for f in schema.categorical:
        if f.buckets is None:
            try:
                ints = [int(v) for v in f.vocabulary]
                vocab_index[f.name] = (pd.Index(ints), True) if all(str(i) == v for i, v in zip(ints, f.vocabulary)) else None
            except ValueError:
                vocab_index[f.name] = None
            if vocab_index[f.name] is None:
                vocab_index[f.name] = (pd.Index(f.vocabulary), False)
    batches = [b for _, _, b in source.batches()]  # read once, held: both encoders get the same record batches
    times: dict[str, list[float]] = {"pruneflow": [], "plain": []}
    for _ in range(repeats):  # interleaved
        for name in ("pruneflow", "plain"):
            start = time.perf_counter()
            for b in batches:
                if name == "pruneflow":
                    schema.encode({c: b.column(c) for c in b.column_names})
                else:
                    _plain(b, schema, vocab_index)
            times[name].append(time.perf_counter() - start)
    plain, ours = _plain(batches[0], schema, vocab_index), schema.encode({c: batches[0].column(c) for c in batches[0].column_names})
    vocab_cols = [i for i, f in enumerate(schema.categorical) if f.buckets is None]
    same = bool((ours["ids"][:, vocab_cols] == plain["ids"][:, vocab_cols]).all() and
                np.allclose(ours["dense"].numpy(), plain["dense"].numpy()))
    best = {k: min(v) for k, v in times.items()}
    return {"rows": rows, "fields": "8 categorical (3 hashed: 2 integer ids, 1 text id; 5 vocabularies), 12 numeric",
            "counting_pass_s": count_s, "encode_s": times, "best_s": best, "rows_per_s": {k: rows / v for k, v in best.items()},
            "ratio_pruneflow_over_plain": best["pruneflow"] / best["plain"], "same_vocab_ids_and_dense": same,
            "host": _host()}


# --------------------------------------------------------------------------- scale


def data_pass(folder: str) -> None:
    """In a child process: the counting pass and one epoch of batches (read, encode, shuffle; no model): JSON on stdout."""
    import torch

    from pruneflow.data import load_data
    from pruneflow.recipe.models import DataSpec
    from pruneflow.tasks import make_task

    spec = DataSpec(**_stream_data(folder))
    start = time.perf_counter()
    import pandas  # noqa: F401 - first imports (pyarrow.dataset pulls pandas in): a fixed cost, timed on its own
    import pyarrow.compute  # noqa: F401
    import pyarrow.dataset  # noqa: F401

    imports_s = time.perf_counter() - start
    start = time.perf_counter()
    bundle = load_data(spec, task=make_task("binary"))
    first_s = time.perf_counter() - start  # with the first calls' own costs (imports inside, Arrow's registries)
    start = time.perf_counter()
    bundle = load_data(spec, task=make_task("binary"))
    count_s = time.perf_counter() - start
    rss_count = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start, rows = time.perf_counter(), 0
    for _, y in bundle.train_batches(8192, torch.Generator().manual_seed(0)):
        rows += len(y)
    epoch_s = time.perf_counter() - start
    print(json.dumps({"train_rows": bundle.train_rows, "imports_s": imports_s, "count_first_s": first_s, "count_s": count_s, "epoch_read_encode_s": epoch_s, "epoch_rows": rows,
                      "peak_rss_mib_after_count": rss_count,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _stream_data(folder: str) -> dict:
    import yaml

    data = yaml.safe_load((ROOT / "recipes" / "ctr-scale-stream.yaml").read_text())["data"]
    data.pop("clicklog")
    return {**data, "format": "parquet", "train": f"{folder}/train", "eval": f"{folder}/eval"}


def scale(rows: int, nproc: int, out: Path, data_only: bool = False) -> dict:
    import yaml

    folder = out / f"log-{rows}"
    entry: dict = {"rows": rows, "nproc": nproc, "host": _host()}
    if data_only:  # the data pass again, into the entry a full run wrote
        entry = json.loads(RESULTS.read_text()).get(f"scale-{rows}-np{nproc}", entry)
        proc, wall, rss = _timed([PY, __file__, "data-pass", str(folder)])
        assert proc.returncode == 0, proc.stderr[-2000:]
        entry["data_pass"] = {**json.loads(proc.stdout), "process_peak_rss_mib": rss, "wall_s": wall,
                              "host": _host()}
        return entry
    if not (folder / "planted.json").exists():
        shards = max(4, rows // 250_000)
        proc, wall, rss = _timed([PY, "-m", "pruneflow.clicklog", "--rows", str(rows), "--shards", str(shards),
                                  "--out", str(folder)])
        assert proc.returncode == 0, proc.stderr[-2000:]
        entry["generate"] = {"seconds": wall, "peak_rss_mib": rss, "shards": shards}
    else:  # generated by an earlier run: keep what that run measured
        earlier = json.loads(RESULTS.read_text()).get(f"scale-{rows}-np1", {}) if RESULTS.exists() else {}
        if "generate" in earlier:
            entry["generate"] = earlier["generate"]
    entry["planted"] = json.loads((folder / "planted.json").read_text())
    if nproc == 1:
        proc, wall, rss = _timed([PY, __file__, "data-pass", str(folder)])
        assert proc.returncode == 0, proc.stderr[-2000:]
        entry["data_pass"] = {**json.loads(proc.stdout), "process_peak_rss_mib": rss, "wall_s": wall}
    recipe = yaml.safe_load((ROOT / "recipes" / "ctr-scale-stream.yaml").read_text())
    recipe["data"] = _stream_data(str(folder))
    recipe["name"] = f"ctr-scale-stream-{rows}-np{nproc}"
    path = out / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    scratch = out / f"scratch-{rows}"
    env_extra = ["env", f"PRUNEFLOW_RANK_SCRATCH={scratch}"] if nproc > 1 else []
    proc, wall, rss = _timed([*env_extra, PY, "-m", "pruneflow", "optimize", str(path), "--out", str(out / "runs"), "--json",
                              *(["--nproc", str(nproc)] if nproc > 1 else [])])
    result = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    stages = {s["name"]: s["seconds"] for s in result.get("stages", [])}
    train_rows = entry["planted"]["rows"] - entry["planted"]["eval_rows"]
    entry["recipe"] = {"exit_code": proc.returncode, "wall_s": wall, "peak_rss_mib": rss, "stage_seconds": stages,
                       "before_first_stage_s": wall - sum(stages.values()),
                       "train_rows_per_s": 2 * train_rows / stages["train"] if "train" in stages else None,
                       "auc": {a["path"]: a["metrics"].get("auc") for a in result.get("artifacts", []) if "auc" in a["metrics"]},
                       "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}
    entry["rank_logs"] = _rank_lines(out / "runs" / recipe["name"], scratch / "rank1" / recipe["name"])
    return entry


def _rank_lines(run: Path, rank1: Path) -> list[str]:
    lines = []
    for folder in (run, rank1):
        log = folder / "logs" / "pruneflow.log"
        if log.exists():
            lines += [line.split(" INFO ", 1)[-1] for line in log.read_text().splitlines() if "streamed train split" in line][:2]
    return lines


# --------------------------------------------------------------------------- report


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2 or any(y <= 0 for y in ys):
        return None
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _plot(xs: list[int], series: dict[str, list[float]]) -> None:
    """stream_scale.svg: each timed stage's seconds against rows on log-log axes, with a dashed line of slope 1 (time
    in proportion to rows) from the recipe's first point, drawn by the bench report's own chart code."""
    from pruneflow.benchmark.curves import Axes, Series, line_chart

    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    lines = [Series(name, colours[i % len(colours)], "", [(x, y) for x, y in zip(xs, ys) if y and y > 0])
             for i, (name, ys) in enumerate(series.items())]
    recipe = series["recipe end to end"]
    lines.append(Series("∝ rows (slope 1), from the recipe's first point", "#7f7f7f", "8 4",
                        [(x, recipe[0] * x / xs[0]) for x in xs]))
    axes = Axes.fit(lines)
    axes.log_y = True  # a power law is a straight line only on log-log axes
    axes.y_lo, axes.y_hi = min(y for s in lines for _, y in s.points) / 1.3, max(y for s in lines for _, y in s.points) * 1.3
    (RESULTS.parent / "stream_scale.svg").write_text(line_chart(lines, axes, "seconds", "rows (log scale)") + "\n")


def _scale_lines(runs: list[dict]) -> list[str]:
    """The one-process table, the fitted exponents and the RSS ratios."""
    lines = ["## Scale (one process)", "",
             "Data pass (`data-pass`, its own process, no model): the counting pass timed warm (a second call; the first "
             "call also pays first imports and Arrow's registries), then one epoch of batches read, encoded and "
             "shuffled through the 262,144-row buffer. Recipe: `recipes/ctr-scale-stream.yaml` pointed at the same "
             "shards, end to end (`pruneflow optimize --json`), peak RSS by `/usr/bin/time`.", "",
             "| rows | generate s | counting pass s (first call) | epoch read+encode s (M rows/s) | data pass peak RSS MiB | "
             "recipe wall s | before first stage s | train s (rows/s) | reference export s | calibrate s | ptq s | export s | "
             "recipe peak RSS MiB | exit | AUC FP32 / INT8 ONNX | load 1m |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        d, rc = r.get("data_pass", {}), r["recipe"]
        s, auc = rc["stage_seconds"], rc["auc"]
        rate = d.get("epoch_rows", 0) / d["epoch_read_encode_s"] / 1e6 if d.get("epoch_read_encode_s") else None
        lines.append(
            f"| {r['rows']:,} | {_f(r.get('generate', {}).get('seconds'))} | {_f(d.get('count_s'), 2)} ({_f(d.get('count_first_s'), 2)}) | "
            f"{_f(d.get('epoch_read_encode_s'), 2)} ({_f(rate, 2)}) | {_f(d.get('process_peak_rss_mib'), 0)} | {_f(rc['wall_s'])} | "
            f"{_f(rc['before_first_stage_s'])} | {_f(s.get('train'))} ({_f(rc.get('train_rows_per_s'), 0)}) | {_f(s.get('reference'))} | "
            f"{_f(s.get('calibrate'))} | {_f(s.get('ptq'))} | {_f(s.get('export'))} | {_f(rc['peak_rss_mib'], 0)} | {rc['exit_code']} | "
            f"{_f(auc.get('export/reference/onnx/model.fp32.onnx'), 4)} / {_f(auc.get('export/onnx/model.int8.onnx'), 4)} | "
            f"{_f(r['host']['load_avg_1m'], 1)} |")
    xs = [r["rows"] for r in runs]
    lines += ["", f"Fitted exponent b of time ∝ rows^b (least squares on log-log over {', '.join(f'{x:,}' for x in xs)} rows):", ""]
    series = {"generate (the clicklog writer)": [r.get("generate", {}).get("seconds", 0) for r in runs],
              "counting pass (warm)": [r.get("data_pass", {}).get("count_s", 0) for r in runs],
              "epoch read+encode+shuffle": [r.get("data_pass", {}).get("epoch_read_encode_s", 0) for r in runs],
              "train stage (2 epochs, steps ∝ rows)": [r["recipe"]["stage_seconds"].get("train", 0) for r in runs],
              "recipe end to end": [r["recipe"]["wall_s"] for r in runs]}
    _plot(xs, series)
    lines[-2:-2] = ["![seconds against rows, log-log, each stage beside a line of slope 1](stream_scale.svg)", ""]
    for name, ys in series.items():
        steps = [f"{xs[i]:.0e}→{xs[i + 1]:.0e}: {_f(_slope(xs[i:i + 2], ys[i:i + 2]), 3)}" for i in range(len(xs) - 1)]
        lines.append(f"- {name}: {_f(_slope(xs, ys), 3)}" + (f" (step by step: {', '.join(steps)})" if len(xs) > 2 else ""))
    lines += ["- fixed-step stages (not fitted): reference export, calibrate, ptq and export evaluate the eval rows held "
              "(every eval row up to `eval_rows` = 200,000, then a sample of that many: 10,000 / 100,000 / 200,000 rows "
              "here) and a calibration set of fixed size, so their time stops growing with the log;"]
    rss = {r["rows"]: (r["recipe"]["peak_rss_mib"], r.get("data_pass", {}).get("process_peak_rss_mib")) for r in runs}
    lines += ["", "Peak RSS, recipe / data pass: " + ", ".join(f"{x:,} rows {_f(a, 0)} / {_f(b, 0)} MiB" for x, (a, b) in rss.items()) + "."]
    if 10_000_000 in rss and 1_000_000 in rss:
        lines.append(f"10^7 over 10^6: recipe {rss[10_000_000][0] / rss[1_000_000][0]:.2f}x, data pass "
                     f"{(rss[10_000_000][1] or 0) / (rss[1_000_000][1] or 1):.2f}x (bar: ≤ 1.5x).")
    return lines + [""]


def _after_fix(commits: list) -> bool:
    """Whether the run's recorded commit holds the train-figures cap (65293eb); a run that recorded none predates it."""
    if not commits or not commits[0]:
        return False
    found = subprocess.run(["git", "merge-base", "--is-ancestor", "65293eb", commits[0]], cwd=ROOT)
    return found.returncode == 0


def _figures_lines(data: dict) -> list[str]:
    """The train-figures check: a tiny model's streamed epoch with the 2^20-row cap on training figures, and without."""
    check = data.get("train_figures_rss")
    if not check:
        return []
    runs = check["runs"]
    commits = [v.get("host", {}).get("commit") for k, v in data.items() if k == "scale-10000000-np1"]
    rows = [f"| {int(n):,} | {v['fix']['peak_rss_kb'] / 1024:,.0f} MiB, {v['fix']['seconds']:.1f} s | "
            f"{v['nofix']['peak_rss_kb'] / 1024:,.0f} MiB, {v['nofix']['seconds']:.1f} s |" for n, v in runs.items()]
    before = data.get("before_fix-10000000-np1")
    earlier = ([f"The one-process 10^7-row run before the fix (kept in the JSON as `before_fix-10000000-np1`): recipe peak RSS "
                f"{before['recipe']['peak_rss_mib']:,.0f} MiB, {before['recipe']['peak_rss_mib'] / data['scale-1000000-np1']['recipe']['peak_rss_mib']:.2f}x "
                f"the 10^6 run's; train stage {before['recipe']['stage_seconds']['train']:.1f} s, wall {before['recipe']['wall_s']:.1f} s, "
                f"AUC FP32 ONNX {before['recipe']['auc']['export/reference/onnx/model.fp32.onnx']:.4f}.", ""]
               if before and before is not data.get("scale-10000000-np1") and "scale-1000000-np1" in data else [])
    return ["## What grew with the rows, and the fix", "", *earlier,
            f"The one-process 10^7-row recipe above ran {'after' if _after_fix(commits) else 'before'} this fix (65293eb); "
            "the --nproc 2 one before it. The train stage's training figures (train AUC) kept "
            "every output of the epoch (a binary task's AUC reads them all), so the stage's memory and its AUC time grew "
            "with the log. Since then an epoch's training figures read every k-th batch past 2^20 rows (`train.FIGURE_ROWS`; "
            "every split of up to 2^20 rows an epoch, so every existing recipe, is read as before). " + check["what"] + ":", "",
            "| rows | with the cap | without |", "|---|---|---|", *rows, ""]


def report() -> None:
    data = json.loads(RESULTS.read_text())
    runs = sorted((v for k, v in data.items() if k.startswith("scale-") and v["nproc"] == 1), key=lambda v: v["rows"])
    lines = ["# Issue 39: a click log streamed, 10^5 → 10^7 rows", "",
             "Written by `benchmarks/stream_scale.py report` from `stream_scale.json` (every figure measured by that script).",
             ""]
    if "encode" in data:
        e = data["encode"]
        lines += ["## Encoding, side by side (20 fields: " + e["fields"] + ")", "",
                  f"{e['rows']:,} rows, the same record batches held in memory, interleaved, best of {len(e['encode_s']['plain'])}: "
                  f"pruneflow {e['best_s']['pruneflow']:.3f} s ({e['rows_per_s']['pruneflow'] / 1e6:.2f} M rows/s), plain pandas/numpy "
                  f"{e['best_s']['plain']:.3f} s ({e['rows_per_s']['plain'] / 1e6:.2f} M rows/s): **ratio {e['ratio_pruneflow_over_plain']:.2f}x** "
                  f"(bar: ≤ 1.5x). Vocabulary ids and dense values identical: {e['same_vocab_ids_and_dense']}. "
                  f"Host: {e['host']['cpu']}, {e['host']['cores']} cores, load {e['host']['load_avg_1m']:.2f}. The plain script "
                  "(`_plain` here): `batch.to_pandas()`, `np.mod` for integer ids, `pandas.util.hash_array` on stripped text "
                  "for the hashed text id, `pd.Index.get_indexer` on each vocabulary, numpy for the numbers; pruneflow's "
                  "encoder is `TabularSchema.encode` on the Arrow columns (FNV-1a over the distinct values, `pc.index_in`).", ""]
    if runs:
        lines += _scale_lines(runs)
    ddp = [v for k, v in data.items() if k.startswith("scale-") and v["nproc"] > 1]
    for r in ddp:
        one = next((v for v in runs if v["rows"] == r["rows"]), None)
        rc = r["recipe"]
        lines += [f"## --nproc {r['nproc']} on {r['rows']:,} rows", "",
                  f"exit {rc['exit_code']}, wall {rc['wall_s']:.1f} s, train stage {rc['stage_seconds'].get('train', float('nan')):.1f} s, "
                  f"peak RSS {rc['peak_rss_mib']:.0f} MiB (the launcher's largest child)."]
        if one is not None and "train" in one["recipe"]["stage_seconds"] and "train" in rc["stage_seconds"]:
            a1 = one["recipe"]["auc"].get("export/reference/onnx/model.fp32.onnx")
            a2 = rc["auc"].get("export/reference/onnx/model.fp32.onnx")
            lines.append(f"Train-stage throughput ratio (2 processes / 1): {one['recipe']['stage_seconds']['train'] / rc['stage_seconds']['train']:.2f}x; "
                         f"FP32 ONNX AUC {a2:.4f} vs one process {a1:.4f} (difference {abs(a2 - a1):.4f}; bar 0.002). Host load "
                         f"(1 min) {r['host']['load_avg_1m']:.1f} for this run, {one['host']['load_avg_1m']:.1f} for the one-process one.")
        before = data.get("before_fix-10000000-np1") if r["rows"] == 10_000_000 else None
        if before and "train" in rc["stage_seconds"]:
            lines.append(f"Against the one-process run of the same code (before the train-figures fix, like this one; host load "
                         f"{before['host']['load_avg_1m']:.1f} there, {r['host']['load_avg_1m']:.1f} here): "
                         f"{before['recipe']['stage_seconds']['train'] / rc['stage_seconds']['train']:.2f}x.")
        lines += ["", "What each rank logged:", ""] + [f"- `{line}`" for line in r.get("rank_logs", [])] + [""]
    lines += _figures_lines(data)
    (RESULTS.parent / "stream_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    enc = sub.add_parser("encode")
    enc.add_argument("--rows", type=int, default=1_000_000)
    enc.add_argument("--repeats", type=int, default=3)
    sc = sub.add_parser("scale")
    sc.add_argument("--rows", type=int, nargs="+", required=True)
    sc.add_argument("--nproc", type=int, default=1)
    sc.add_argument("--out", type=Path, default=Path("/tmp/stream_scale"))
    sc.add_argument("--data-only", action="store_true", help="measure the data pass again, keep the rest of the entry")
    dp = sub.add_parser("data-pass")
    dp.add_argument("folder")
    sub.add_parser("report")
    args = parser.parse_args()
    if args.cmd == "encode":
        result = encode_bench(args.rows, args.repeats)
        _merge("encode", result)
        print(json.dumps(result, indent=2))
    elif args.cmd == "scale":
        for rows in args.rows:
            entry = scale(rows, args.nproc, args.out, args.data_only)
            _merge(f"scale-{rows}-np{args.nproc}", entry)
            print(json.dumps(entry, indent=2))
    elif args.cmd == "data-pass":
        data_pass(args.folder)
    else:
        report()


if __name__ == "__main__":
    main()
