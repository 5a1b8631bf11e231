"""Statistics a service owner can trust from `pruneflow bench` (issue 38, item 6) and bench files from other hosts
read as data (issue 41): enough runs behind a p99 or a low-confidence mark, NOISY rows by report.md's rule, the largest
batch timed flagged, exit 1 when nothing meets the budget, cost from the cores a lane uses, Prometheus in seconds,
merged files checked against a schema, non-finite options refused, a container's memory limit honoured, and the
README's serving snippets run as written.

The branches are driven by timings injected into the pure functions (no assert on how fast anything ran), and by
real onnxruntime runs of a one-op model where the command line is the subject."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import invoke
from test_bench import _relu_onnx

ROOT = Path(__file__).resolve().parents[1]


def _no_constants(name: str):
    raise AssertionError(f"{name} in JSON: not strict JSON")


BENCH = ("bench", "--runtime", "onnxruntime", "--warmup", "1")


# --------------------------------------------------------------------------- a synthetic result, figures injected


HOST = {"cpu": {"model": "Test CPU", "arch": "x86_64", "isa": ["avx2"], "logical_cpus": 8, "usable_cpus": 8},
        "os": "Linux", "python": "3", "gpus": [], "versions": {}}


def _result(times: dict[tuple[str, int], list[float]], file: Path | None = None, **settings):
    """A BenchResult of variants named in ``times`` ({(variant, batch): run times in ms}), the first the baseline;
    ``file``: an .onnx file they all name (the HTML report draws variants that have one)."""
    from pruneflow.benchmark import BenchResult, BenchSettings
    from pruneflow.benchmark.measure import Lane, Row, add_ratios
    from pruneflow.benchmark.variants import Variant
    from pruneflow.runtime import LatencyStats

    names = list(dict.fromkeys(v for v, _ in times))
    variants = {n: Variant(name=f"m/{n}", model="m", label=n, path=file, precision="fp32") for n in names}
    lanes = {n: Lane(variants[n], "onnxruntime", None) for n in names}
    rows = [Row(lanes[v], batch, stats=LatencyStats.of(t, batch)) for (v, batch), t in times.items()]
    baseline = variants[names[0]]
    add_ratios(rows, baseline)
    batches = sorted({b for _, b in times})
    return BenchResult(HOST, BenchSettings(batches=batches, **settings), list(variants.values()), rows, baseline,
                       {}, {"asked": False, "available": False, "how": "not asked"})


def steady(ms: float, runs: int = 200) -> list[float]:
    """Run times around ``ms`` with a tight spread (p90/p50 about 1.02)."""
    return [ms * (1 + 0.03 * (i % 10) / 10) for i in range(runs)]


def test_noisy_rows_are_marked_by_the_rule_of_report_md():
    """NOISY when p90/p50 passes headline.NOISY_SPREAD on the row, or on the baseline row its ratio is against."""
    from pruneflow import headline
    from pruneflow.benchmark import measure
    from pruneflow.benchmark.exposition import result_json
    from pruneflow.benchmark.html import table_cells

    assert measure.NOISY_SPREAD is headline.NOISY_SPREAD  # one rule, not a second one
    jumpy = [1.0] * 50 + [2.0] * 50  # p50 1.5, p90 2.0: p90/p50 1.33, under the bar
    wild = [1.0] * 60 + [3.0] * 40   # p50 1.0, p90 3.0: p90/p50 3.0
    result = _result({("base", 1): steady(1.0), ("calm", 1): steady(0.5), ("jumpy", 1): jumpy, ("wild", 1): wild,
                      ("base", 8): wild, ("calm", 8): steady(4.0)})
    by = {(r.lane.variant.label, r.batch): r for r in result.rows}
    assert not by[("calm", 1)].noisy and not by[("jumpy", 1)].noisy and by[("wild", 1)].noisy
    assert by[("wild", 1)].spread == pytest.approx(3.0)
    assert by[("calm", 8)].noisy and by[("calm", 8)].spread == pytest.approx(3.0)  # its ratio's baseline is noisy
    rows = {(r["label"], r["batch"]): r for r in result_json(result)["results"]}
    assert rows[("wild", 1)]["noisy"] is True and rows[("calm", 1)]["noisy"] is False
    assert "NOISY (p90/p50 3.00)" in table_cells(result, by[("wild", 1)])[-1]
    assert "NOISY" not in table_cells(result, by[("calm", 1)])[-1]


def test_a_p99_from_fewer_than_200_runs_is_marked_low_confidence_in_table_json_and_html(tmp_path):
    from pruneflow.benchmark.exposition import result_json
    from pruneflow.benchmark.html import LOW_CONFIDENCE, html_report, low_confidence_note, table_cells
    from pruneflow.benchmark.measure import MIN_P99_RUNS

    assert MIN_P99_RUNS == 200
    distinct = [float(i) for i in range(200)]  # of 50 runs the p99 lies between the two worst; of 200, two are slower
    assert np.percentile(distinct[:50], 99) > distinct[48] and np.percentile(distinct, 99) < distinct[198]
    few, enough = steady(1.0, 50), steady(1.0, 200)
    result = _result({("a", 1): few, ("b", 1): few, ("a", 4): enough, ("b", 4): enough}, _relu_onnx(tmp_path / "x.onnx"))
    marked = {(r["label"], r["batch"]): r["p99_low_confidence"] for r in result_json(result)["results"]}
    assert marked == {("a", 1): True, ("b", 1): True, ("a", 4): False, ("b", 4): False}
    cells = {(r.lane.variant.label, r.batch): table_cells(result, r) for r in result.rows}
    assert cells[("a", 1)][5].endswith(LOW_CONFIDENCE) and not cells[("a", 4)][5].endswith(LOW_CONFIDENCE)
    note = low_confidence_note(result)
    assert note is not None and "from 50 timed runs, fewer than 200" in note
    assert "low confidence" in html_report(result)


def test_the_best_batch_that_is_the_largest_timed_carries_a_warning_and_its_marks():
    from pruneflow.benchmark.html import entry_note

    result = _result({("a", 1): steady(1.0), ("a", 8): steady(2.0), ("a", 64): steady(6.0, 50),
                      ("b", 1): steady(1.0), ("b", 8): steady(3.0), ("b", 64): steady(40.0)}, p99_budget_ms=20.0)
    chosen = {e["variant"]: e for e in result.under_budget()}
    assert chosen["m/a"]["batch"] == 64 and chosen["m/a"]["largest_timed"] is True
    assert "batch 64 is the largest timed" in chosen["m/a"]["warning"] and "128" in chosen["m/a"]["warning"]
    assert chosen["m/a"]["p99_low_confidence"] is True and chosen["m/a"]["runs"] == 50
    assert "a larger one may do better" in entry_note(chosen["m/a"]) and "low confidence" in entry_note(chosen["m/a"])
    assert chosen["m/b"]["batch"] == 8 and chosen["m/b"]["largest_timed"] is False and "warning" not in chosen["m/b"]
    assert entry_note(chosen["m/b"]) == "" and result.exit_code() == 0


def test_a_p99_close_to_the_budget_marks_the_best_batch_noisy():
    """ResNet-56 timed twice: batch 8's p99 was 20.3 ms, then 19.3 ms, under a 20 ms budget, so the best batch flipped
    between 4 and 8; either way the entry must say the choice is a close call."""
    from pruneflow.benchmark.html import entry_note

    over = _result({("a", 4): steady(10.0), ("a", 8): steady(20.3), ("a", 16): steady(40.0),
                    ("b", 4): steady(10.0), ("b", 8): steady(15.0), ("b", 16): steady(40.0)}, p99_budget_ms=20.0)
    under = _result({("a", 4): steady(10.0), ("a", 8): steady(19.3), ("a", 16): steady(40.0)}, p99_budget_ms=20.0)
    first, second = ({e["variant"]: e for e in r.under_budget()} for r in (over, under))
    assert (first["m/a"]["batch"], second["m/a"]["batch"]) == (4, 8)
    assert first["m/a"]["noisy"] and first["m/a"]["close_call"] and second["m/a"]["noisy"] and second["m/a"]["close_call"]
    assert re.search(r"batch 8's p99 20\.\d ms within 10% of the budget", first["m/a"]["warning"])
    assert "may change between runs" in entry_note(first["m/a"])
    assert first["m/b"]["batch"] == 8 and not first["m/b"]["noisy"] and "close_call" not in first["m/b"]


def test_nothing_within_the_budget_is_exit_code_1_in_the_result(tmp_path):
    from pruneflow.benchmark.exposition import result_json
    from pruneflow.benchmark.html import html_report

    times = {("a", 1): steady(5.0), ("a", 8): steady(9.0)}
    assert _result(times).meets_budget() is None and _result(times).exit_code() == 0  # no budget, no gate
    tight = _result(times, _relu_onnx(tmp_path / "x.onnx"), p99_budget_ms=1.0)
    assert tight.meets_budget() is False and tight.exit_code() == 1 and result_json(tight)["exit_code"] == 1
    assert "nothing meets --p99-budget-ms 1" in html_report(tight)
    assert _result(times, p99_budget_ms=6.0).exit_code() == 0


def test_cost_per_million_is_the_share_of_the_machine_the_lane_uses():
    """Price x cores used / usable CPUs: one thread of an 8-CPU machine pays an eighth of its hour."""
    times = {("a", 4): steady(2.0)}
    for threads, cores in ((1, 1), (2, 2), (None, 8), (16, 8)):
        result = _result(times, threads=threads, price_per_hour=0.8)
        (row,) = result.rows
        economics = result.economics(row)
        assert economics["cores"] == cores
        assert economics["throughput_per_core"] == pytest.approx(row.stats.throughput / cores)
        assert economics["cost_per_million"] == pytest.approx(0.8 * cores / 8 / (row.stats.throughput * 3600) * 1e6)


def test_prometheus_times_are_in_seconds():
    from pruneflow.benchmark.exposition import prometheus_text

    result = _result({("a", 1): steady(2.0), ("a", 8): steady(4.0)}, p99_budget_ms=20.0)
    text = prometheus_text(result)
    assert "pruneflow_latency_ms" not in text and "# TYPE pruneflow_latency_seconds gauge" in text
    p50 = result.rows[0].stats.p50_ms
    line = next(x for x in text.splitlines() if x.startswith("pruneflow_latency_seconds") and 'quantile="0.5"' in x
                and 'batch="1"' in x)
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(p50 / 1000)
    assert re.search(r'pruneflow_best_batch\{.*p99_budget_seconds="0.02".*\} 8', text)


# --------------------------------------------------------------------------- the timing window


def test_the_window_of_each_way_of_timing():
    from pruneflow.benchmark.measure import AUTO_SECONDS, MAX_RUNS, MIN_P99_RUNS, BenchSettings, Window, timed_window

    assert BenchSettings().window() == Window(50, MIN_P99_RUNS, AUTO_SECONDS)  # neither --runs nor --duration
    assert BenchSettings(runs=7).window() == Window(7, 7, None)
    assert BenchSettings(duration=2.5).window() == Window(3, MAX_RUNS, 2.5)
    calls = {"a": 0, "b": 0}

    def lane(name):
        return lambda _x: calls.__setitem__(name, calls[name] + 1)

    ready = {"a": lane("a"), "b": lane("b")}
    assert {k: len(v) for k, v in timed_window(ready, None, Window(50, 200, 3600.0)).items()} == {"a": 200, "b": 200}
    assert {k: len(v) for k, v in timed_window(ready, None, Window(50, 200, 0.0)).items()} == {"a": 50, "b": 50}
    assert {k: len(v) for k, v in timed_window(ready, None, Window(7, 7, None)).items()} == {"a": 7, "b": 7}
    assert calls == {"a": 257, "b": 257}  # every lane once a repetition, in turn
    slow = {"a": lambda _x: time.sleep(0.002)}
    start = time.perf_counter()
    times = timed_window(slow, None, Window(3, MAX_RUNS, 0.05))
    assert time.perf_counter() - start >= 0.05 and 3 <= len(times["a"]) < MAX_RUNS  # a window of time, not a count


def test_without_runs_bench_times_enough_runs_for_the_p99_and_with_few_it_says_so(tmp_path):
    model = _relu_onnx(tmp_path / "relu.onnx", width=8)
    auto = invoke(*BENCH, model, "--batch", "1", "--json")
    assert auto.exit_code == 0, auto.output
    data = json.loads(auto.stdout, parse_constant=_no_constants)
    assert data["settings"]["runs"] is None
    assert [(r["runs"], r["p99_low_confidence"]) for r in data["results"]] == [(200, False)]
    few = invoke(*BENCH, model, "--batch", "1", "--runs", "20")
    assert few.exit_code == 0, few.output
    text = " ".join(few.output.split())
    assert "from 20 timed runs, fewer than 200" in text and "timing: interleaved, 20 runs (20 timed)" in text
    assert re.search(r"\d\.\d{3}~", few.output)  # the p99 cell carries the mark


# --------------------------------------------------------------------------- exit codes and options


def test_nothing_within_the_budget_exits_1_with_a_line_saying_so_and_writes_every_file(tmp_path):
    model = _relu_onnx(tmp_path / "relu.onnx")
    args = (*BENCH, model, "--batch", "1,4", "--runs", "5", "--p99-budget-ms", "0.0001")
    table = invoke(*args, "--json", tmp_path / "b.json", "--html", tmp_path / "b.html", "--prometheus", tmp_path / "b.prom")
    assert table.exit_code == 1, table.output
    assert "nothing meets --p99-budget-ms 0.0001" in " ".join(table.output.split())
    assert json.loads((tmp_path / "b.json").read_text())["exit_code"] == 1
    assert (tmp_path / "b.html").is_file() and (tmp_path / "b.prom").is_file()
    on_stdout = invoke(*args, "--json")
    assert on_stdout.exit_code == 1 and json.loads(on_stdout.stdout)["exit_code"] == 1
    roomy = invoke(*args[:-1], "1000", "--json")
    assert roomy.exit_code == 0 and json.loads(roomy.stdout)["exit_code"] == 0


@pytest.mark.parametrize("option, value, message", [
    ("--p99-budget-ms", "inf", "--p99-budget-ms inf: must be a positive finite number"),
    ("--p99-budget-ms", "nan", "--p99-budget-ms nan: must be a positive finite number"),
    ("--duration", "inf", "--duration inf: must be a positive finite number"),
    ("--runs", "0", "--runs 0"),
    ("--runs", "-3", "--runs -3"),
])
def test_a_bad_number_is_refused_before_any_timing(tmp_path, option, value, message):
    model = _relu_onnx(tmp_path / "relu.onnx")
    result = invoke(*BENCH, model, "--batch", "1", option, value)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Fix:" in result.output


# --------------------------------------------------------------------------- merge: files from other hosts are data


@pytest.fixture(scope="module")
def host_file(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hosts")
    model = _relu_onnx(folder / "relu.onnx")
    result = invoke(*BENCH, model, "--batch", "1,8", "--runs", "10", "--json", folder / "a.json")
    assert result.exit_code == 0, result.output
    return json.loads((folder / "a.json").read_text())


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_merge_reads_a_bench_file_written_before_the_marks_and_cores_existed(host_file, tmp_path):
    old = json.loads(json.dumps(host_file))
    for row in old["results"]:
        for key in ("spread", "noisy", "p99_low_confidence", "cores"):
            row.pop(key)
    a, b = _write(tmp_path / "old.json", old), _write(tmp_path / "new.json", host_file)
    result = invoke("bench", "--merge", a, b, "--price-per-hour", "1.0", "--json", "--prometheus", tmp_path / "m.prom")
    assert result.exit_code == 0, result.output
    merged = json.loads(result.stdout, parse_constant=_no_constants)
    olds = [r for r in merged["results"] if r["host"].endswith("(old)")]
    assert olds and all(r["p99_low_confidence"] is True and r["noisy"] == (r["p90_ms"] / r["p50_ms"] > 1.5) for r in olds)
    usable = host_file["host"]["cpu"]["usable_cpus"]
    assert all(r["cost_per_million"] == pytest.approx(1.0 / usable / (r["throughput"] * 3600) * 1e6) for r in olds)
    assert "pruneflow_latency_seconds" in (tmp_path / "m.prom").read_text()


def test_merge_exits_1_when_no_host_meets_the_budget(host_file, tmp_path):
    a, b = _write(tmp_path / "a.json", host_file), _write(tmp_path / "b.json", host_file)
    result = invoke("bench", "--merge", a, b, "--p99-budget-ms", "0.0001")
    assert result.exit_code == 1 and "nothing meets --p99-budget-ms 0.0001" in " ".join(result.output.split())
    assert invoke("bench", "--merge", a, b, "--p99-budget-ms", "inf").exit_code == 2


def _hostile(doc: dict, case: str) -> str:
    """The text of a bench file broken in one way."""
    row = doc["results"][0]
    if case == "missing key":
        del row["batch"]
    elif case == "string for a number":
        row["p50_ms"] = str(row["p50_ms"])
    elif case == "string for the CPUs":
        doc["host"]["cpu"]["usable_cpus"] = "2"
    elif case == "negative latency":
        row["p50_ms"] = row["p90_ms"] = row["p99_ms"] = -1.0
    elif case == "negative cost":
        row["cost_per_million"] = -0.5
    elif case == "negative price":
        doc["settings"]["price_per_hour"] = -2.0
    elif case == "latencies out of order":
        row["p99_ms"] = row["p50_ms"] / 2
    elif case == "half a row timed":
        row["p99_ms"] = None
    elif case == "NaN":
        return json.dumps(doc).replace(json.dumps(row["p50_ms"]), "NaN", 1)
    elif case == "Infinity":
        return json.dumps(doc).replace(json.dumps(row["throughput"]), "Infinity", 1)
    elif case == "deeply nested":
        return json.dumps(doc)[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    return json.dumps(doc)


@pytest.mark.parametrize("case, where", [
    ("missing key", "results.0.batch"), ("string for a number", "results.0.p50_ms"),
    ("string for the CPUs", "host.cpu.usable_cpus"), ("negative latency", "results.0.p50_ms"),
    ("negative cost", "results.0.cost_per_million"), ("negative price", "settings.price_per_hour"),
    ("latencies out of order", "latencies out of order"), ("half a row timed", "all of them"),
    ("NaN", "not strict JSON"), ("Infinity", "not strict JSON"), ("deeply nested", "nested too deeply"),
])
def test_merge_refuses_a_malformed_file_naming_it_and_the_key(host_file, tmp_path, case, where):
    good = _write(tmp_path / "good.json", host_file)
    bad = tmp_path / "bad.json"
    bad.write_text(_hostile(json.loads(json.dumps(host_file)), case))
    result = invoke("bench", "--merge", good, bad, "--html", tmp_path / "m.html")
    text = " ".join(result.output.split())
    assert result.exit_code == 2, (case, result.output)
    assert "bad.json" in text and where in text and "Fix:" in text, (case, result.output)
    assert not (tmp_path / "m.html").exists()


def test_rich_markup_in_a_name_is_printed_as_it_is(host_file, tmp_path):
    doc = json.loads(json.dumps(host_file))
    for row in doc["results"]:
        row["variant"] = row["label"] = "[/][bold red]evil[/bold red]"
    doc["host"]["label"] = "[link=http://x]host[/link] [/]"
    a, b = _write(tmp_path / "a.json", doc), _write(tmp_path / "b.json", host_file)
    result = invoke("bench", "--merge", a, b, "--p99-budget-ms", "1000", "--html", tmp_path / "m.html")
    assert result.exit_code == 0, result.output
    assert "[/][bold red]evil[/bold red]" in result.output and "[link=http://x]host[/link]" in result.output
    assert "[/][bold red]evil[/bold red]" in (tmp_path / "m.html").read_text()  # text in the HTML too


# --------------------------------------------------------------------------- a container's memory limit


def _cgroup_v2(root: Path, group: str, limit: int | str, used: int, cache: int = 0) -> Path:
    folder = root / group.strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(f"{limit}\n")
    (folder / "memory.current").write_text(f"{used}\n")
    (folder / "memory.stat").write_text(f"anon {used}\ninactive_file {cache}\nactive_file 0\n")
    return folder


def test_the_memory_left_under_a_cgroup_limit_v2_and_v1(tmp_path):
    from pruneflow.benchmark import cgroup_memory_left

    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    proc.write_text("0::/app/job\n")
    _cgroup_v2(root, "app/job", "max", 100)
    assert cgroup_memory_left(proc, root) is None  # no limit set
    _cgroup_v2(root, "app", 2**30, 300 * 2**20, cache=100 * 2**20)  # the parent's limit binds; its page cache is free
    assert cgroup_memory_left(proc, root) == 2**30 - 200 * 2**20
    _cgroup_v2(root, "app/job", 512 * 2**20, 400 * 2**20)
    assert cgroup_memory_left(proc, root) == 112 * 2**20  # the tightest level
    proc.write_text("0::/host/path/hidden/by/the/namespace\n")
    _cgroup_v2(root, "", 2**30, 2**28)
    assert cgroup_memory_left(proc, root) == 2**30 - 2**28  # the container's own group is the mount itself

    v1 = tmp_path / "v1"
    group = v1 / "memory" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    (group / "memory.usage_in_bytes").write_text(f"{2**29}\n")
    (group / "memory.stat").write_text(f"cache 0\ntotal_inactive_file {2**27}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5\n")
    proc.write_text("12:pids:/docker/abc\n4:cpu,memory:/docker/abc\n0::/\n")
    assert cgroup_memory_left(proc, v1) == 2**30 - (2**29 - 2**27)
    proc.write_text("4:memory:/\n")
    assert cgroup_memory_left(proc, v1) is None
    assert cgroup_memory_left(tmp_path / "no-such-file", v1) is None


def test_a_batch_past_a_containers_limit_is_refused_and_the_batch_advised_runs_next_time(tmp_path, monkeypatch):
    """Inside a 1 GiB cgroup bench saw the machine's memory, and the kernel killed it (issue 41)."""
    import pruneflow.config as config

    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    proc.write_text("0::/job\n")
    _cgroup_v2(root, "job", 2**30, 2**27)
    monkeypatch.setattr(config, "SELF_CGROUP", proc)
    monkeypatch.setattr(config, "CGROUP_ROOT", root)
    model = _relu_onnx(tmp_path / "relu.onnx")  # 1,024 bytes a sample
    refused = invoke(*BENCH, model, "--batch", "5000000", "--runs", "1")
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2, refused.output
    assert "GB available under this container's memory limit (cgroup)" in text and "0.94 GB" in text
    advised = int(re.search(r"use --batch (\d+) or less", text)[1])
    assert advised == int(0.8 * 0.1 * (2**30 - 2**27) // 1024)
    _cgroup_v2(root, "job", 2**30, 2**27 + 2**26)  # the next run finds a little less memory free
    again = invoke(*BENCH, model, "--batch", str(advised), "--runs", "1", "--warmup", "0")
    assert again.exit_code == 0, again.output


# --------------------------------------------------------------------------- the README's serving snippets


def _serving_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Serving an artifact", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readmes_serving_snippets_run_as_written_with_the_irs_precision_hint(tmp_path, monkeypatch):
    """Each runtime's snippet runs on a `my-model`-shaped run's files; the OpenVINO one compiles with the hint its IR's
    deployment record names (f32 for INT8), or OpenVINO's default for an IR whose record names none."""
    import openvino as ov
    import torch

    from pruneflow.deployment import openvino_int8_runtime
    from pruneflow.formats.onnx import stamp_onnx
    from pruneflow.formats.openvino import read_ir, stamp_ir

    blocks = _serving_blocks()
    assert len(blocks) == 2 and "onnxruntime" in blocks[0] and "openvino_hint(read_ir(" in blocks[1]
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(256, 10)).eval()
    onnx_file = tmp_path / "runs/my-model/export/onnx/model.int8.onnx"
    ir_file = tmp_path / "runs/my-model/export/openvino/model.int8.xml"
    onnx_file.parent.mkdir(parents=True)
    ir_file.parent.mkdir(parents=True)
    torch.onnx.export(model, (torch.zeros(1, 1, 8, 8),), str(onnx_file), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    import onnx

    proto = onnx.load(str(onnx_file))
    stamp_onnx(proto, {"format": "pruneflow-deployment/1", "runtime": None}, "int8")
    onnx.save(proto, str(onnx_file))
    with torch.no_grad():
        expected = model(torch.zeros(8, 1, 8, 8)).numpy()

    ran = {}
    exec(compile(blocks[0], "README.md (onnxruntime)", "exec"), ran)
    assert ran["logits"].shape == (8, 10) and np.allclose(ran["logits"], expected, atol=1e-4)

    for runtime, hint in ((openvino_int8_runtime(), "f32"), (None, None)):
        ir = ov.convert_model(str(onnx_file))
        stamp_ir(ir, {"format": "pruneflow-deployment/1", "runtime": runtime}, "int8")
        ov.save_model(ir, str(ir_file), compress_to_fp16=False)
        assert (read_ir(ir_file).get("runtime") or {}).get("openvino", {}).get("INFERENCE_PRECISION_HINT") == hint
        ran = {}
        exec(compile(blocks[1], "README.md (openvino)", "exec"), ran)
        assert ran["hint"] == hint and ran["logits"].shape == (8, 10)
        used = ran["compiled"].get_property("INFERENCE_PRECISION_HINT").to_string()
        default = ov.Core().compile_model(str(ir_file), "CPU").get_property("INFERENCE_PRECISION_HINT").to_string()
        assert used == ("f32" if hint else default)
        assert np.allclose(ran["logits"], expected, atol=1e-2)
